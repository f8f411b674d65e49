"""Bit packing of quantization codes: exactly ``bits`` bits per code, any row length.

Layout (the on-disk format, see docs/format.md): every ROW is packed independently as an LSB-first bit
stream. Code j of a row occupies stream bits [j*bits, (j+1)*bits) with its own least-significant bit first,
and stream bit b lives in bit (b % 8) of byte b // 8 of that row. Trailing pad bits are zero. So with 4
bits code 0 is the LOW nibble of byte 0, with 3 bits 8 codes fill 3 bytes, and with 6 bits (embedding rows
only, squeeze.limits.EMBEDDING_ONLY_BITS) 4 codes fill 3 bytes.

Vectorised: codes are handled in groups of ``g`` codes that fill exactly ``g * bits / 8`` bytes (1 byte
for 2/4/8 bits, 3 bytes for 3 and 6 bits); the only Python loops are over the handful of (code, byte)
pairs inside one group.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from squeeze.errors import FormatError
from squeeze.limits import CODE_BITS, WEIGHT_BITS, is_weight_bits

#: Code widths the format supports for linears (the table is squeeze.limits.WEIGHT_BITS).
SUPPORTED_BITS = WEIGHT_BITS
#: Code widths the packing itself handles: SUPPORTED_BITS and the embedding-only widths (squeeze.limits).
PACKED_BITS = CODE_BITS


def packed_row_bytes(n: int, bits: int) -> int:
    """Bytes one packed row of ``n`` codes takes: ceil(n * bits / 8)."""
    check_code_bits(bits)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"row length must be an integer >= 0, found {n!r}")
    return (n * bits + 7) // 8


def pack_codes(codes: Tensor, bits: int) -> Tensor:
    """Pack codes uint8 (R, N), each < 2**bits, into uint8 (R, ceil(N * bits / 8))."""
    check_code_bits(bits)
    if not isinstance(codes, Tensor) or codes.dtype != torch.uint8 or codes.dim() != 2:
        found = f"{codes.dtype} {tuple(codes.shape)}" if isinstance(codes, Tensor) else type(codes).__name__
        raise ValueError(f"codes must be a 2-D uint8 tensor, found {found}")
    R, N = codes.shape
    if codes.numel() and int(codes.max()) >= 1 << bits:
        raise ValueError(f"codes must be < 2**{bits} = {1 << bits} for {bits}-bit packing, found {int(codes.max())}")
    g, gb = _group(bits)
    G = -(-N // g)  # groups per row
    padded = torch.zeros(R, G * g, dtype=torch.uint8, device=codes.device)
    padded[:, :N] = codes
    grouped = padded.view(R, G, g)
    out = torch.zeros(R, G, gb, dtype=torch.uint8, device=codes.device)
    for i, j, lo, hi in _overlaps(bits):
        # stream bits [lo, hi) belong to code i (starting at bit bits*i) and byte j (starting at 8*j)
        part = (grouped[:, :, i] >> (lo - bits * i)) & ((1 << (hi - lo)) - 1)  # (R, G)
        out[:, :, j] |= part << (lo - 8 * j)
    return out.view(R, G * gb)[:, : packed_row_bytes(N, bits)].contiguous()


def unpack_codes(packed: Tensor, bits: int, n: int) -> Tensor:
    """Inverse of :func:`pack_codes`: packed uint8 (R, ceil(n * bits / 8)) -> codes uint8 (R, n).

    Raises FormatError when ``packed`` is not a 2-D uint8 tensor of exactly that width (it comes from files).
    """
    check_code_bits(bits)
    expected = packed_row_bytes(n, bits)
    if not isinstance(packed, Tensor) or packed.dtype != torch.uint8 or packed.dim() != 2:
        found = f"{packed.dtype} {tuple(packed.shape)}" if isinstance(packed, Tensor) else type(packed).__name__
        raise FormatError(f"packed codes must be a 2-D uint8 tensor, found {found}")
    if packed.shape[1] != expected:
        raise FormatError(
            f"packed codes for {n} {bits}-bit codes per row need {expected} bytes per row, found {packed.shape[1]}"
        )
    R = packed.shape[0]
    if bits == 8:
        return packed.clone()
    if 8 % bits == 0:  # 2 and 4 bits: whole codes per byte, one broadcast shift and mask (several x faster)
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)  # code i of a byte: bits*i
        codes = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # (R, W, 8 // bits)
        return codes.reshape(R, expected * (8 // bits))[:, :n].contiguous()
    g, gb = _group(bits)
    G = -(-n // g)
    padded = torch.zeros(R, G * gb, dtype=torch.uint8, device=packed.device)
    padded[:, :expected] = packed
    grouped = padded.view(R, G, gb)
    out = torch.zeros(R, G, g, dtype=torch.uint8, device=packed.device)
    for i, j, lo, hi in _overlaps(bits):
        part = (grouped[:, :, j] >> (lo - 8 * j)) & ((1 << (hi - lo)) - 1)  # (R, G)
        out[:, :, i] |= part << (lo - bits * i)
    return out.view(R, G * g)[:, :n].contiguous()


def codes_at(packed: Tensor, rows: Tensor, cols: Tensor, bits: int) -> Tensor:
    """uint8 codes at (rows, cols) (int64, same shape) of rows packed by :func:`pack_codes` (uint8 (R, W)),
    without unpacking whole rows: a code spans at most two bytes of its row's stream."""
    bit = cols * bits
    byte = bit >> 3
    lo = packed[rows, byte].to(torch.int32)
    hi = packed[rows, torch.clamp(byte + 1, max=packed.shape[1] - 1)].to(torch.int32)
    return (((lo | (hi << 8)) >> (bit & 7)) & ((1 << bits) - 1)).to(torch.uint8)


def check_bits(bits: int) -> None:
    """ValueError unless ``bits`` is a supported code width: the quantizers' and kernels' contract (user input
    was checked against squeeze.limits at the boundary)."""
    if not is_weight_bits(bits):
        raise ValueError(f"bits must be one of {list(WEIGHT_BITS)}, found {bits!r}")


def check_code_bits(bits: int) -> None:
    """ValueError unless the packing handles ``bits``: a linear width or an embedding-only one (6)."""
    if not is_weight_bits(bits, CODE_BITS):
        raise ValueError(f"bits must be one of {list(CODE_BITS)}, found {bits!r}")


def _group(bits: int) -> tuple[int, int]:
    """(codes, bytes) of the smallest whole-byte group: (4, 1), (8, 3), (2, 1), (4, 3), (1, 1) for 2, 3, 4, 6,
    8 bits."""
    group_bits = math.lcm(bits, 8)
    return group_bits // bits, group_bits // 8


def _overlaps(bits: int) -> list[tuple[int, int, int, int]]:
    """(code i, byte j, lo, hi): stream bits [lo, hi) of one group shared by code i and byte j."""
    g, gb = _group(bits)
    pairs = []
    for i in range(g):
        for j in range(gb):
            lo, hi = max(bits * i, 8 * j), min(bits * (i + 1), 8 * (j + 1))
            if lo < hi:
                pairs.append((i, j, lo, hi))
    return pairs


__all__ = [
    "SUPPORTED_BITS",
    "PACKED_BITS",
    "check_bits",
    "check_code_bits",
    "codes_at",
    "pack_codes",
    "unpack_codes",
    "packed_row_bytes",
]
