"""The one dtype table (squeeze.format.dtypes) against the safetensors library's own writer and torch."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save

from squeeze.errors import FormatError
from squeeze.format.dtypes import FLOAT_DTYPES, SAFETENSORS_DTYPES, float_itemsize, torch_dtype
from squeeze.format.safetensors_header import parse_safetensors_header

LOADED = [d.torch for d in SAFETENSORS_DTYPES.values() if d.torch is not None]


def _header_dtype(tensor: torch.Tensor) -> str:
    """The dtype name the safetensors library writes for ``tensor`` (the reference spelling)."""
    blob = save({"t": tensor})
    (length,) = struct.unpack("<Q", blob[:8])
    return str(json.loads(blob[8 : 8 + length])["t"]["dtype"])


@pytest.mark.parametrize("dtype", LOADED, ids=str)
def test_every_loaded_dtype_round_trips_through_a_real_safetensors_file(dtype: torch.dtype) -> None:
    tensor = torch.zeros(3, 5, dtype=dtype)
    name = _header_dtype(tensor)  # what safetensors writes for it
    assert torch_dtype(name) == dtype
    assert SAFETENSORS_DTYPES[name].itemsize == dtype.itemsize
    blob = save({"t": tensor})
    header = parse_safetensors_header(blob[: 8 + struct.unpack("<Q", blob[:8])[0]], len(blob), "x.safetensors")
    assert header.tensors["t"].end - header.tensors["t"].begin == 15 * dtype.itemsize


@pytest.mark.parametrize("name", ["F8_E4M3", "F8_E5M2", "U16", "U32", "U64", "C64", "f16", ""])
def test_a_dtype_squeeze_does_not_load_is_a_format_error(name: str) -> None:
    with pytest.raises(FormatError, match=f"tensor dtype {name} is not supported by the squeeze loader"):
        torch_dtype(name)


def test_headers_may_name_every_safetensors_dtype_with_its_width() -> None:
    widths = {name: d.itemsize for name, d in SAFETENSORS_DTYPES.items()}
    assert widths["F8_E4M3"] == widths["F8_E5M2"] == widths["U8"] == 1
    assert widths["U16"] == 2 and widths["U32"] == 4 and widths["U64"] == 8
    assert "C64" not in widths  # the header parser refuses what the table lacks


def test_config_names_are_torchs_own() -> None:
    assert FLOAT_DTYPES == {
        "float16": torch.float16,
        "bfloat16": torch.bfloat16,
        "float32": torch.float32,
        "float64": torch.float64,
    }
    assert all(getattr(torch, name) == dtype for name, dtype in FLOAT_DTYPES.items())
    assert [float_itemsize(n, 4) for n in ("bfloat16", "float64", "int8", None, 16)] == [2, 8, 4, 4, 4]
