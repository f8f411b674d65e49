"""Validation of a safetensors header against the file it heads.

Layout: 8-byte little-endian header length N, N bytes of JSON (``{name: {dtype, shape, data_offsets}}``
plus an optional ``__metadata__`` string map), then the data region. Every tensor's byte range must lie
inside the data region, match dtype x shape, and the ranges must tile the region without overlap.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO

from squeeze.errors import FormatError
from squeeze.format.dtypes import SAFETENSORS_DTYPES
from squeeze.format.paths import short_repr
from squeeze.format.strict_json import strict_json_loads

#: safetensors' own limit on header size; a larger declared length is treated as corrupt.
MAX_HEADER_BYTES = 100 * 2**20
#: Largest dimension, and largest product of the non-zero dimensions, of a tensor (exact as a JSON number
#: or double; far past any real tensor). A zero-size tensor needs no bytes, so without this bound a shape
#: like [0, 2**64] would pass the byte-count check and overflow torch's int64 sizes at load.
MAX_ELEMENTS = 2**53


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's entry in a safetensors header; offsets are relative to the data region."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class SafetensorsHeader:
    """A validated header: its byte length, metadata and tensor table."""

    header_len: int
    metadata: dict[str, str]
    tensors: dict[str, TensorInfo]

    @property
    def data_start(self) -> int:
        return 8 + self.header_len


def declared_header_length(prefix: bytes, file_size: int, name: str) -> int:
    """The header length the first 8 bytes declare, checked against ``file_size``."""
    if file_size < 8 or len(prefix) < 8:
        raise FormatError(f"{name}: safetensors file is {file_size} bytes, too short for a header")
    length: int
    (length,) = struct.unpack("<Q", prefix[:8])
    if length > MAX_HEADER_BYTES:
        raise FormatError(f"{name}: safetensors header declares {length} bytes, over the {MAX_HEADER_BYTES} limit")
    if 8 + length > file_size:
        raise FormatError(
            f"{name}: safetensors header declares {length} bytes but the file has only {file_size - 8} after the length"
        )
    return length


def read_header_prefix(handle: BinaryIO) -> bytes:
    """From an open shard at offset 0: the 8-byte length and at most MAX_HEADER_BYTES of header that follow.

    Never more than that, whatever the length declares; ``parse_safetensors_header`` then judges it.
    """
    prefix = handle.read(8)
    if len(prefix) == 8:
        prefix += handle.read(min(int.from_bytes(prefix, "little"), MAX_HEADER_BYTES))
    return prefix


def parse_safetensors_header(prefix: bytes, file_size: int, name: str) -> SafetensorsHeader:
    """Validate the header in ``prefix`` (at least 8 + N bytes of the file) against ``file_size``."""
    length = declared_header_length(prefix, file_size, name)
    if len(prefix) < 8 + length:
        raise FormatError(f"{name}: only {len(prefix)} header bytes available, {8 + length} needed")
    raw = strict_json_loads(prefix[8 : 8 + length], f"{name} header")
    if not isinstance(raw, dict):
        raise FormatError(f"{name}: safetensors header must be a JSON object")
    metadata = raw.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise FormatError(f"{name}: safetensors __metadata__ must map strings to strings")
    data_len = file_size - 8 - length
    tensors = {key: _tensor_info(key, value, name) for key, value in raw.items()}
    covered = 0
    for key, info in sorted(tensors.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if info.begin != covered:
            raise FormatError(
                f"{name}: tensor {key!r} starts at byte {info.begin}, expected {covered} (gap or overlap)"
            )
        covered = info.end
    if covered != data_len:
        raise FormatError(f"{name}: tensors cover {covered} data bytes but the file holds {data_len}")
    return SafetensorsHeader(header_len=length, metadata=dict(metadata), tensors=tensors)


def _tensor_info(key: str, value: Any, name: str) -> TensorInfo:
    where = f"{name}: tensor {short_repr(key)}"
    if not isinstance(value, dict):
        raise FormatError(f"{where} entry must be an object")
    dtype, shape, offsets = value.get("dtype"), value.get("shape"), value.get("data_offsets")
    if dtype not in SAFETENSORS_DTYPES:
        raise FormatError(f"{where} has unknown dtype {short_repr(dtype)}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise FormatError(f"{where} has an invalid shape {short_repr(shape)}")
    elements = 1
    for dim in shape:  # each dimension, and any product of them, is bounded (stops at the first overflow)
        elements *= max(dim, 1)
        if elements > MAX_ELEMENTS:
            raise FormatError(f"{where} has shape {short_repr(shape)}: its dimensions multiply past 2^53")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise FormatError(f"{where} has invalid data_offsets {short_repr(offsets)}")
    expected = math.prod(shape) * SAFETENSORS_DTYPES[dtype].itemsize
    if offsets[1] - offsets[0] != expected:
        raise FormatError(
            f"{where} spans {offsets[1] - offsets[0]} bytes, but {dtype} x {short_repr(shape)} needs {expected}"
        )
    return TensorInfo(dtype=dtype, shape=tuple(shape), begin=offsets[0], end=offsets[1])
