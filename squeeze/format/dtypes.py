"""The one dtype table: safetensors' dtype names, their byte widths, torch dtypes and config.json's names.

Every place that turns one spelling of a dtype into another reads this table: the header parser (bytes per
element of every dtype a safetensors header may name), the loaders (the torch dtype a tensor is viewed as),
the source reader (which float dtype a checkpoint stores) and the memory estimate (config.json's
``torch_dtype`` / ``dtype`` name, as torch spells it: ``"bfloat16"``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from squeeze.errors import FormatError


@dataclass(frozen=True)
class Dtype:
    """One safetensors dtype. ``torch``: what squeeze loads it as; None where it never loads one (a header
    naming it is still valid, and its byte count checked)."""

    safetensors: str
    itemsize: int
    torch: torch.dtype | None

    @property
    def name(self) -> str | None:
        """torch's name of the dtype, as config.json writes it (``"float16"``); None when not loaded."""
        return str(self.torch).removeprefix("torch.") if self.torch is not None else None


#: Every dtype of the safetensors format, by its name there (``"BF16"``).
SAFETENSORS_DTYPES: dict[str, Dtype] = {
    d.safetensors: d
    for d in (
        Dtype("BOOL", 1, torch.bool),
        Dtype("U8", 1, torch.uint8),
        Dtype("I8", 1, torch.int8),
        Dtype("F8_E5M2", 1, None),
        Dtype("F8_E4M3", 1, None),
        Dtype("I16", 2, torch.int16),
        Dtype("U16", 2, None),
        Dtype("F16", 2, torch.float16),
        Dtype("BF16", 2, torch.bfloat16),
        Dtype("I32", 4, torch.int32),
        Dtype("U32", 4, None),
        Dtype("F32", 4, torch.float32),
        Dtype("I64", 8, torch.int64),
        Dtype("U64", 8, None),
        Dtype("F64", 8, torch.float64),
    )
}

#: The floating dtypes by the name config.json gives them (``"float32"``, ``"bfloat16"``...).
FLOAT_DTYPES: dict[str, torch.dtype] = {
    d.name: d.torch
    for d in SAFETENSORS_DTYPES.values()
    if d.name is not None and d.torch is not None and d.torch.is_floating_point
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype a tensor stored as safetensors' ``name`` (``"F16"``) loads as; FormatError for a dtype
    squeeze does not load (float8, unsigned 16-64 bit) or an unknown name."""
    entry = SAFETENSORS_DTYPES.get(name)
    if entry is None or entry.torch is None:
        raise FormatError(f"tensor dtype {name} is not supported by the squeeze loader")
    return entry.torch


def float_itemsize(name: object, default: int) -> int:
    """Bytes per element of the float dtype config.json calls ``name`` (``"bfloat16"``: 2); ``default`` for
    anything else (absent, not a string, not a float dtype)."""
    dtype = FLOAT_DTYPES.get(name) if isinstance(name, str) else None
    return dtype.itemsize if dtype is not None else default


__all__ = ["Dtype", "SAFETENSORS_DTYPES", "FLOAT_DTYPES", "torch_dtype", "float_itemsize"]
