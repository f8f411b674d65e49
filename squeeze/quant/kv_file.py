"""The tensors of an artifact's KV file (:data:`KV_FILE`), checked as ``KVSpec.from_config`` reads them.

Split from ``squeeze.quant.kv_spec``, which builds the spec from them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from squeeze.errors import FormatError
from squeeze.quant.kv import KeyRotation

#: The artifact file holding the calibrated scales beside the shards: {attn}.k_scale / .k_zero, and .v_clip or
#: .v_levels (int grids), or {attn}.k_scale / .v_scale (fp8).
KV_FILE = "kv_cache.safetensors"
#: The tensors of a layer's rotating key centre in :data:`KV_FILE`: ``{attn}.<role>``.
ROTATION_ROLES = ("k_rot_freq", "k_rot_cos", "k_rot_sin")


def rotation_tensors(tensors: dict[str, Tensor], name: str, shape: tuple[int, ...]) -> KeyRotation:
    """The rotating key centre of layer ``name`` from the KV file, for keys of ``shape`` (H, D); FormatError
    unless ``.k_rot_freq`` is float32 (D,), finite and >= 0 and ``.k_rot_cos`` / ``.k_rot_sin`` float32 (H, D),
    finite."""
    hint = "re-run squeeze calibrate-kv on the artifact"
    parts = []
    for role, want in zip(ROTATION_ROLES, (shape[-1:], shape, shape), strict=True):
        tensor = tensors.get(f"{name}.{role}")
        if tensor is None:
            raise FormatError(f"KV rotating key centre {name}.{role} is missing from {KV_FILE}", hint=hint)
        if tensor.dtype != torch.float32 or tuple(tensor.shape) != want:
            raise FormatError(
                f"KV rotating key centre {name}.{role} must be float32 of shape {want}, found "
                f"{str(tensor.dtype).removeprefix('torch.')} of shape {tuple(tensor.shape)}",
                hint=hint,
            )
        if not bool(torch.isfinite(tensor).all()):
            raise FormatError(f"KV rotating key centre {name}.{role} must be finite", hint=hint)
        parts.append(tensor)
    if bool((parts[0] < 0).any()):
        raise FormatError(f"KV rotating key centre {name}.k_rot_freq must be >= 0", hint=hint)
    return KeyRotation(*parts)


def fp8_scale_tensor(tensors: dict[str, Tensor], key: str) -> Tensor:
    """The fp8 scale ``key`` of the KV file as a float32 0-dim tensor (FormatError unless one finite float32 > 0)."""
    scale = tensors.get(key)
    if scale is None:
        raise FormatError(
            f"KV scale {key} is missing from {KV_FILE}", hint="re-run squeeze calibrate-kv --bits fp8 on the artifact"
        )
    if scale.dtype != torch.float32 or scale.numel() != 1 or scale.dim() > 1:
        raise FormatError(
            f"KV scale {key} must be one float32 (shape () or (1,)), found {str(scale.dtype).removeprefix('torch.')} "
            f"of shape {tuple(scale.shape)}",
            hint="re-run squeeze calibrate-kv --bits fp8 on the artifact",
        )
    value = scale.reshape(())
    if not (bool(torch.isfinite(value)) and float(value) > 0):
        raise FormatError(
            f"KV scale {key} must be finite and > 0, found {float(value)}",
            hint="re-run squeeze calibrate-kv --bits fp8 on the artifact",
        )
    return value
