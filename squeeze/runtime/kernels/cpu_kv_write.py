"""The KV write inside the native attention library (cpu_kv_write.cpp): a step's new keys or values quantized
straight into the stores the attention kernel reads, the bytes squeeze.runtime.kv_codecs.TokenCodec.encode
writes (tests/runtime/test_cpu_kv_write.py compares them byte for byte), in one call instead of ~20 torch ops.

Covered: int8 / int4 uniform grids (symmetric or not, any grid width), the int4 / int8 codebook, the key
normaliser with or without a rotating centre. Not covered (the caller keeps the torch codec): fp8 caches, a
codec whose clipping ratio is neither a float nor one per head, head dims above 1024.
"""

from __future__ import annotations

import ctypes
import os
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor

from squeeze.quant.kv import qmax
from squeeze.runtime.kernels.cpu_attention import AttentionKernels, KVStore

#: the kernel's per-head buffers (float v[1024])
MAX_HEAD_DIM = 1024
#: "0": every write goes through the torch codec (the same bytes; for measurements)
ENV = "SQUEEZE_NATIVE_KV_WRITE"


@dataclass(frozen=True)
class WriteParams:
    """Per-codec constants of the write: ``factor`` / ``clip`` (H,) float32 (the symmetric grids' clip / qmax,
    computed as torch computes it, and the clipping ratio), ``mids`` (K-1,) float32 (a codebook's level
    midpoints, else empty)."""

    factor: Tensor
    clip: Tensor
    mids: Tensor
    bits: int


_PARAMS: weakref.WeakKeyDictionary[object, WriteParams | None] = weakref.WeakKeyDictionary()


def write_params(codec: object, heads: int) -> WriteParams | None:
    """The constants :func:`write_tokens` needs for ``codec`` (built once per codec), or None when the native
    write does not cover it."""
    from squeeze.runtime.kv_codecs import FP8Codec, TokenCodec

    if os.environ.get(ENV, "1").strip() == "0":
        return None
    if codec in _PARAMS:
        return _PARAMS[codec]
    params = None
    if isinstance(codec, TokenCodec) and not isinstance(codec, FP8Codec) and codec.bits in (4, 8):
        params = _params(codec, heads)
    _PARAMS[codec] = params
    return params


def _params(codec: object, heads: int) -> WriteParams | None:
    clip = codec.clip  # type: ignore[attr-defined]
    bits: int = codec.bits  # type: ignore[attr-defined]
    if isinstance(clip, Tensor):
        clip_t = clip.detach().to("cpu", torch.float32).reshape(-1)
        if clip_t.numel() not in (1, heads):
            return None
        factor = (clip_t / qmax(bits)).expand(heads)  # torch's float32 clip / qmax
        clip_t = clip_t.expand(heads)
    else:
        factor = torch.full((heads,), clip / qmax(bits), dtype=torch.float32)  # a float: the scalar cast once
        clip_t = torch.full((heads,), float(clip), dtype=torch.float32)
    levels = codec.levels  # type: ignore[attr-defined]
    mids = torch.empty(0, dtype=torch.float32)
    if levels is not None:
        c = levels.detach().to("cpu", torch.float32)
        mids = ((c[:-1] + c[1:]) * 0.5).contiguous()  # squeeze.quant.kv.quantize_codebook's midpoints
    return WriteParams(factor.contiguous(), clip_t.contiguous(), mids, bits)


def write_tokens(
    kernels: AttentionKernels,
    params: WriteParams,
    store: KVStore,
    new: Tensor,
    slots: Tensor,
    positions: Tensor | None,
) -> bool:
    """Quantize ``new (H, N, D)`` float32 (any strides with contiguous channels) into ``store``'s codes / scale /
    offset at token ``slots (N,)`` int64 (head h's row ``h * head_stride + slot``); ``positions (N,)`` int64: the
    tokens' cache positions (a rotating key centre's rows, which ``store`` must hold). False (nothing written)
    for input the kernel does not take."""
    heads, n, d = new.shape
    if new.dtype != torch.float32 or new.device.type != "cpu" or new.stride(-1) != 1 or d > MAX_HEAD_DIM:
        return False
    if store.struct.center_rows and positions is None:
        return False
    slots = slots.to("cpu", torch.int64).contiguous()
    pos = positions.to("cpu", torch.int64).contiguous() if positions is not None else None
    kernels.lib.sq_kv_write(
        new.data_ptr(),
        n,
        new.stride(1),
        new.stride(0),
        heads,
        d,
        slots.data_ptr(),
        pos.data_ptr() if pos is not None else None,
        ctypes.byref(store.struct),
        params.factor.data_ptr(),
        params.clip.data_ptr(),
        params.mids.data_ptr() if params.mids.numel() else None,
        int(params.mids.numel()),
        params.bits,
    )
    return True


__all__ = ["ENV", "MAX_HEAD_DIM", "WriteParams", "write_params", "write_tokens"]
