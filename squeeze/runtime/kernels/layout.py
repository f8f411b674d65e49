"""The kernels' own code layout, and ``prepare``: everything the LUT kernels need, derived once at load time.

Why a layout of our own: the file's layout packs each row as one LSB-first bit stream (docs/format.md),
so column c's code sits at stream bit ``c * bits``. A kernel that decodes it in column order reads bytes at
per-column offsets (3-bit codes straddle bytes) and, to vectorise, would have to interleave the decoded
codes again. Since a dot product does not care about the order of its terms, the kernels instead read a
TILE-PERMUTED layout in which every load is contiguous:

* A row is cut into tiles of ``CPG * T`` columns (CPG = codes per whole-byte group: 4, 8, 2, 1 for
  2, 3, 4, 8 bits; T = ``tile``, DEFAULT_TILE below). The last tile is padded with code 0.
* In tile k, "group" t (0 <= t < T) holds the CPG codes of columns ``k*CPG*T + s*T + t`` for
  s = 0 .. CPG-1, code s at bits [s*bits, (s+1)*bits) of a little-endian word of BPG bytes
  (BPG = 1, 3, 1, 1 bytes for 2, 3, 4, 8 bits).
* The word's byte p is stored in byte plane p: ``codes[r, k, p, t]``, a uint8 tensor (R, NT, BPG, T).

So for slot s the T codes of a tile (one byte plane load per plane, T contiguous bytes) and the T
activations they multiply (``x[k*CPG*T + s*T : ... + T]``) are both contiguous. The layout costs exactly
``bits`` bits per code plus the padding of the last tile of each row (none when ``in_features`` is a
multiple of ``CPG * T``: 512 columns at 4 bits, 1024 at 3 bits with the default tiles).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from squeeze.limits import WEIGHT_BITS
from squeeze.quant.packing import check_bits, unpack_codes
from squeeze.quant.schemes.lut import LutWeight
from squeeze.runtime.kernels.reference import sparse_residual

#: bits -> (codes per group CPG, bytes per group BPG): the smallest whole-byte group of codes, for every width
#: squeeze supports: {2: (4, 1), 3: (8, 3), 4: (2, 1), 8: (1, 1)}.
GROUPS: dict[int, tuple[int, int]] = {b: (math.lcm(b, 8) // b, math.lcm(b, 8) // 8) for b in WEIGHT_BITS}

#: Default tile width T (groups per tile) by bits: tiles of 512 columns at 2 and 4 bits, 1024 at 3 bits,
#: 256 at 8 bits. Wide tiles give the decode GEMV 32-48 bytes of codes per thread per tile, so that enough
#: bytes are in flight to stream at full bandwidth; wider ones would pad odd row lengths more (at most one
#: tile per row: +2.3 % for 11008 columns at 3 and 4 bits).
DEFAULT_TILE: dict[int, int] = {2: 128, 3: 128, 4: 256, 8: 256}


def tile_pack(codes: Tensor, bits: int, tile: int | None = None) -> Tensor:
    """uint8 (R, N) codes -> uint8 (R, NT, BPG, T) in the tile-permuted layout (module docstring);
    ``tile`` (T) defaults to DEFAULT_TILE[bits]."""
    cpg, bpg = _group(bits)
    tile = DEFAULT_TILE[bits] if tile is None else tile
    _check_tile(tile)
    if codes.dtype != torch.uint8 or codes.dim() != 2:
        raise ValueError(f"codes must be a 2-D uint8 tensor, found {codes.dtype} {tuple(codes.shape)}")
    rows, n = codes.shape
    span = cpg * tile  # columns per tile
    n_tiles = -(-n // span)
    padded = torch.zeros(rows, n_tiles * span, dtype=torch.int32, device=codes.device)
    padded[:, :n] = codes
    slots = padded.view(rows, n_tiles, cpg, tile)  # [r, k, s, t] = code of column k*span + s*T + t
    word = torch.zeros(rows, n_tiles, tile, dtype=torch.int32, device=codes.device)  # (R, NT, T)
    for s in range(cpg):
        word |= slots[:, :, s, :] << (s * bits)
    planes = [((word >> (8 * p)) & 0xFF).to(torch.uint8) for p in range(bpg)]
    return torch.stack(planes, dim=2).contiguous()  # (R, NT, BPG, T)


def tile_unpack(tiles: Tensor, bits: int, n: int) -> Tensor:
    """Inverse of :func:`tile_pack`: uint8 (R, NT, BPG, T) -> uint8 (R, n) codes."""
    cpg, bpg = _group(bits)
    if tiles.dtype != torch.uint8 or tiles.dim() != 4 or tiles.shape[2] != bpg:
        raise ValueError(f"tiles must be uint8 (R, NT, {bpg}, T), found {tiles.dtype} {tuple(tiles.shape)}")
    rows, n_tiles, _, tile = tiles.shape
    word = torch.zeros(rows, n_tiles, tile, dtype=torch.int32, device=tiles.device)  # (R, NT, T)
    for p in range(bpg):
        word |= tiles[:, :, p, :].to(torch.int32) << (8 * p)
    slots = torch.stack([(word >> (s * bits)) & ((1 << bits) - 1) for s in range(cpg)], dim=2)  # (R, NT, CPG, T)
    return slots.reshape(rows, n_tiles * cpg * tile)[:, :n].to(torch.uint8).contiguous()


@dataclass(frozen=True)
class PreparedLut:
    """A LutWeight made ready for the Triton kernels, on one device (build it with :func:`prepare`).

    codes uint8 (R, NT, BPG, T): tile-permuted codes (module docstring).
    lut float32 (R, 2**bits): the row LUTs, widened once so the hot loop needs no conversion.
    rowptr int32 (R+1,), cols int32 (nnz,), resid float32 (nnz,): the ADDITIVE sparse residual
    (:func:`~squeeze.runtime.kernels.reference.sparse_residual`), or all None without a sparse part.
    """

    bits: int
    in_features: int
    out_features: int
    tile: int
    codes: Tensor
    lut: Tensor
    rowptr: Tensor | None = None
    cols: Tensor | None = None
    resid: Tensor | None = None

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def n_tiles(self) -> int:
        return int(self.codes.shape[1])

    @property
    def has_sparse(self) -> bool:
        return self.resid is not None

    @property
    def nnz(self) -> int:
        return 0 if self.resid is None else int(self.resid.numel())

    def sparse_positions(self) -> tuple[Tensor, Tensor]:
        """(rows, cols), int64 (nnz,) each: where the sparse residual entries are (empty without one)."""
        if self.rowptr is None or self.cols is None:
            empty = torch.zeros(0, dtype=torch.int64, device=self.device)
            return empty, empty
        counts = (self.rowptr[1:] - self.rowptr[:-1]).to(torch.int64)  # (R,)
        # output_size: no device -> host sync to learn the length (this may run inside a forward)
        rows = torch.repeat_interleave(
            torch.arange(self.out_features, device=self.device), counts, output_size=self.cols.numel()
        )
        return rows, self.cols.to(torch.int64)

    def codes_at(self, rows: Tensor, cols: Tensor) -> Tensor:
        """int64 codes at positions (rows, cols), each int64 (K,), read from the tile-permuted layout."""
        cpg, bpg = GROUPS[self.bits]
        span = cpg * self.tile
        tile_k, slot, group = cols // span, (cols % span) // self.tile, cols % self.tile
        word = torch.zeros_like(rows)
        for p in range(bpg):
            word |= self.codes[rows, tile_k, p, group].to(torch.int64) << (8 * p)
        return (word >> (slot * self.bits)) & ((1 << self.bits) - 1)

    def nbytes(self) -> int:
        """Device bytes this weight occupies (what a GEMV must read at least once)."""
        tensors = [self.codes, self.lut] + [t for t in (self.rowptr, self.cols, self.resid) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)


def prepare(qweight: LutWeight, device: torch.device | str, tile: int | None = None) -> PreparedLut:
    """Derive what the kernels need from ``qweight``, once, on ``device``: tile-permuted codes (tile T,
    default DEFAULT_TILE[bits]), a float32 LUT and the additive sparse residual (float32, int32 columns).
    Runs in plain torch."""
    if getattr(qweight, "kernel", None) != "lut":
        raise TypeError(f"prepare needs a weight of a LUT format, found {type(qweight).__name__}")
    _group(qweight.bits)
    tile = DEFAULT_TILE[qweight.bits] if tile is None else tile
    _check_tile(tile)
    device = torch.device(device)
    plain = unpack_codes(qweight.packed.to(device), qweight.bits, qweight.in_features)  # (R, N) uint8
    codes = tile_pack(plain, qweight.bits, tile)
    lut = qweight.lut_values(torch.float32).to(device=device).contiguous()  # 8-bit LUTs expanded once
    rowptr = cols = resid = None
    if qweight.sparse is not None and qweight.sparse.nnz > 0:
        rowptr, cols, resid = (t.contiguous() for t in sparse_residual(qweight, codes=plain))
    return PreparedLut(
        bits=qweight.bits,
        in_features=qweight.in_features,
        out_features=qweight.out_features,
        tile=tile,
        codes=codes,
        lut=lut,
        rowptr=rowptr,
        cols=cols,
        resid=resid,
    )


def _group(bits: int) -> tuple[int, int]:
    check_bits(bits)  # ValueError: a LutWeight's bits were checked when it was built or read
    return GROUPS[bits]


def _check_tile(tile: int) -> None:
    # tl.dot needs K >= 16 and Triton block shapes must be powers of two
    if isinstance(tile, bool) or not isinstance(tile, int) or tile < 16 or tile & (tile - 1):
        raise ValueError(f"tile must be a power of two >= 16, found {tile!r}")


__all__ = ["GROUPS", "DEFAULT_TILE", "PreparedLut", "prepare", "tile_pack", "tile_unpack"]
