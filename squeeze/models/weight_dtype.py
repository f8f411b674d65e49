"""The floating dtype a checkpoint stores its weights in, and the one ``--keep-dtype`` writes unquantized
tensors in: read from safetensors headers and config.json, never by loading a tensor."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from squeeze.errors import FormatError
from squeeze.format.dtypes import FLOAT_DTYPES, SAFETENSORS_DTYPES
from squeeze.format.safetensors_header import parse_safetensors_header, read_header_prefix
from squeeze.models.remote_code import read_small_json

if TYPE_CHECKING:
    from squeeze.models.source import ModelSource

#: The dtypes ``--keep-dtype`` may name (``source``: the checkpoint's own), as squeeze spells them.
KEEP_DTYPES: dict[str, torch.dtype] = {name: FLOAT_DTYPES[name] for name in ("float32", "bfloat16", "float16")}


def source_dtype(source: ModelSource) -> torch.dtype:
    """The floating dtype the checkpoint stores its weights in: float32, bfloat16 or float16.

    GGUF files hold quantized blocks, not a float dtype: float16 (what llama.cpp converts from and to).
    A directory: the float dtype holding most bytes in its safetensors headers (read without loading any
    tensor), else config.json's ``torch_dtype`` / ``dtype``, else float32. Float64 counts as float32.
    """
    if source.kind == "gguf":
        return torch.float16
    by_dtype: dict[torch.dtype, int] = {}
    for path in sorted(source.path.glob("*.safetensors")):
        try:
            with path.open("rb") as handle:
                header = parse_safetensors_header(read_header_prefix(handle), path.stat().st_size, path.name)
        except (OSError, FormatError):
            continue  # transformers reports an unreadable checkpoint when it loads it
        for info in header.tensors.values():
            dtype = SAFETENSORS_DTYPES[info.dtype].torch  # the parser refuses a dtype not in the table
            if dtype is not None and dtype.is_floating_point:
                dtype = torch.float32 if dtype == torch.float64 else dtype
                by_dtype[dtype] = by_dtype.get(dtype, 0) + info.end - info.begin
    if by_dtype:
        return max(by_dtype, key=lambda d: by_dtype[d])
    config = read_small_json(source.path / "config.json")
    named = (config.get("torch_dtype") or config.get("dtype")) if isinstance(config, dict) else None
    return KEEP_DTYPES.get(named, torch.float32) if isinstance(named, str) else torch.float32


def keep_dtype(source: ModelSource, choice: str) -> torch.dtype:
    """The dtype unquantized tensors are written in: the source's (``"source"``) or the one named."""
    return source_dtype(source) if choice == "source" else KEEP_DTYPES[choice]


__all__ = ["KEEP_DTYPES", "source_dtype", "keep_dtype"]
