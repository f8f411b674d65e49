"""Bit packing: golden bit patterns (the on-disk layout) and exact round trips."""

from __future__ import annotations

import pytest
import torch

from squeeze.errors import FormatError
from squeeze.quant.packing import (
    PACKED_BITS,
    SUPPORTED_BITS,
    check_bits,
    codes_at,
    pack_codes,
    packed_row_bytes,
    unpack_codes,
)


def u8(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.uint8)


# Each golden was worked out by hand from the layout: code j -> stream bits [j*bits, (j+1)*bits), LSB of
# the code first; stream bit b -> bit b % 8 of byte b // 8.
GOLDEN = [
    # 4-bit: code 0 is the low nibble of byte 0.  1 | 2<<4 = 0x21; 3 -> 0x03
    (4, [1, 2, 3], [0x21, 0x03]),
    (4, [0xF, 0x0, 0x5, 0xA], [0x0F, 0xA5]),
    # 3-bit, 8 codes in 3 bytes. Stream bits (b0 first): 100 010 110 001 101 011 111 000
    #   byte0 = bits 0..7  = 1,0,0,0,1,0,1,1 -> 0b11010001 = 0xD1
    #   byte1 = bits 8..15 = 0,0,0,1,1,0,1,0 -> 0b01011000 = 0x58
    #   byte2 = bits 16..23 = 1,1,1,1,1,0,0,0 -> 0b00011111 = 0x1F
    (3, [1, 2, 3, 4, 5, 6, 7, 0], [0xD1, 0x58, 0x1F]),
    # 3-bit, 3 codes = 9 bits -> 2 bytes: 111 111 111 -> 0xFF, then bit 8 -> 0x01 (pad bits zero)
    (3, [7, 7, 7], [0xFF, 0x01]),
    # 3-bit, one code: 5 = 101 -> 0x05
    (3, [5], [0x05]),
    # 2-bit: 1 | 2<<2 | 3<<4 | 0<<6 = 0x39; then 3 -> 0x03
    (2, [1, 2, 3, 0, 3], [0x39, 0x03]),
    # 8-bit: identity
    (8, [0, 255, 17], [0, 255, 17]),
    # 6-bit (embedding rows), 4 codes in 3 bytes. Codes 1, 2, 3, 63: stream bits (b0 first)
    #   100000 010000 110000 111111
    #   byte0 = bits 0..7   = 1,0,0,0,0,0,0,1 -> 0b10000001 = 0x81  (code 0, then code 1's low 2 bits: 10)
    #   byte1 = bits 8..15  = 0,0,0,0,1,1,0,0 -> 0b00110000 = 0x30  (code 1's high 4, code 2's low 4)
    #   byte2 = bits 16..23 = 0,0,1,1,1,1,1,1 -> 0b11111100 = 0xFC  (code 2's high 2, code 3)
    (6, [1, 2, 3, 63], [0x81, 0x30, 0xFC]),
    # 6-bit, 5 codes = 30 bits -> 4 bytes; the 5th code 0b101010 = 42 alone in byte 3 (2 pad bits zero)
    (6, [0, 0, 0, 0, 42], [0x00, 0x00, 0x00, 0x2A]),
    # 6-bit, 2 codes = 12 bits: 63 | 5 << 6 = 0x17F -> 0x7F, 0x01
    (6, [63, 5], [0x7F, 0x01]),
]


@pytest.mark.parametrize(("bits", "codes", "expected"), GOLDEN)
def test_golden_bit_patterns(bits: int, codes: list[int], expected: list[int]) -> None:
    packed = pack_codes(u8([codes]), bits)
    assert packed.dtype == torch.uint8
    assert packed[0].tolist() == expected
    assert unpack_codes(packed, bits, len(codes))[0].tolist() == codes


def test_rows_are_packed_independently() -> None:
    # the second row starts its own stream at byte 0 of that row
    packed = pack_codes(u8([[1, 2, 3], [3, 2, 1]]), 4)
    assert packed.tolist() == [[0x21, 0x03], [0x23, 0x01]]


@pytest.mark.parametrize("bits", PACKED_BITS)
@pytest.mark.parametrize("n", [1, 7, 33, 172])
def test_round_trip_is_exact(bits: int, n: int) -> None:
    g = torch.Generator().manual_seed(bits * 1000 + n)
    codes = torch.randint(0, 1 << bits, (5, n), generator=g, dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.shape == (5, packed_row_bytes(n, bits))
    assert torch.equal(unpack_codes(packed, bits, n), codes)


@pytest.mark.parametrize("bits", PACKED_BITS)
def test_trailing_pad_bits_are_zero(bits: int) -> None:
    n = 7
    codes = torch.full((2, n), (1 << bits) - 1, dtype=torch.uint8)  # all ones
    packed = pack_codes(codes, bits)
    pad = 8 * packed.shape[1] - n * bits  # the high `pad` bits of each row's last byte
    assert bool((packed[:, -1].to(torch.int64) >> (8 - pad) == 0).all())
    assert pad > 0 or bits == 8


@pytest.mark.parametrize("bits", PACKED_BITS)
def test_zero_rows_and_zero_columns(bits: int) -> None:
    empty_rows = torch.zeros(0, 9, dtype=torch.uint8)
    packed = pack_codes(empty_rows, bits)
    assert packed.shape == (0, packed_row_bytes(9, bits))
    assert unpack_codes(packed, bits, 9).shape == (0, 9)
    no_cols = torch.zeros(3, 0, dtype=torch.uint8)
    assert pack_codes(no_cols, bits).shape == (3, 0)
    assert unpack_codes(torch.zeros(3, 0, dtype=torch.uint8), bits, 0).shape == (3, 0)


def test_packed_row_bytes() -> None:
    assert packed_row_bytes(8, 3) == 3
    assert packed_row_bytes(172, 3) == 65  # ceil(516 / 8)
    assert packed_row_bytes(7, 4) == 4
    assert packed_row_bytes(1, 2) == 1
    assert packed_row_bytes(33, 8) == 33
    assert packed_row_bytes(0, 3) == 0
    assert packed_row_bytes(576, 6) == 432  # a SmolLM2 embedding row: 4 codes in 3 bytes
    assert packed_row_bytes(5, 6) == 4


def test_six_bits_packs_but_is_no_linear_width() -> None:
    assert PACKED_BITS == (2, 3, 4, 6, 8) and 6 not in SUPPORTED_BITS
    with pytest.raises(ValueError, match="bits must be one of"):
        check_bits(6)  # the LUT format and the kernels keep to the linears' widths


def test_wrong_packed_width_is_a_format_error() -> None:
    packed = pack_codes(torch.zeros(2, 10, dtype=torch.uint8), 3)  # 4 bytes per row
    with pytest.raises(FormatError, match="need 5 bytes per row, found 4"):
        unpack_codes(packed, 3, 11)  # 11 codes = 33 bits need 5 bytes
    with pytest.raises(FormatError):
        unpack_codes(packed[:, :3], 3, 10)
    with pytest.raises(FormatError, match="uint8"):
        unpack_codes(packed.to(torch.int16), 3, 10)
    with pytest.raises(FormatError):
        unpack_codes(packed.view(-1), 3, 10)


def test_bad_codes_and_bits_are_value_errors() -> None:
    with pytest.raises(ValueError, match="bits must be one of"):
        pack_codes(torch.zeros(1, 4, dtype=torch.uint8), 5)
    with pytest.raises(ValueError, match="< 2\\*\\*3"):
        pack_codes(u8([[0, 8]]), 3)
    with pytest.raises(ValueError, match="uint8"):
        pack_codes(torch.zeros(1, 4, dtype=torch.int64), 4)
    with pytest.raises(ValueError, match="2-D"):
        pack_codes(torch.zeros(4, dtype=torch.uint8), 4)
    with pytest.raises(ValueError, match="bits must be one of"):
        unpack_codes(torch.zeros(1, 1, dtype=torch.uint8), 7, 1)
    with pytest.raises(ValueError, match="bits must be one of"):
        packed_row_bytes(4, 1)


@pytest.mark.parametrize("bits", PACKED_BITS)
def test_codes_at_equals_unpacked_codes(bits: int) -> None:
    g = torch.Generator().manual_seed(bits)
    for n in (1, 13, 200):
        codes = torch.randint(0, 1 << bits, (6, n), generator=g, dtype=torch.uint8)
        packed = pack_codes(codes, bits)
        rows = torch.randint(0, 6, (50,), generator=g)
        cols = torch.cat([torch.randint(0, n, (48,), generator=g), torch.tensor([0, n - 1])])  # the last column too
        rows = torch.cat([rows[:48], torch.tensor([5, 5])])
        got = codes_at(packed, rows, cols, bits)
        assert got.dtype == torch.uint8 and torch.equal(got, unpack_codes(packed, bits, n)[rows, cols]), n
