"""How one layer's keys or values become codes and back: the per-token codecs of the quantized KV cache.

:class:`TokenCodec` (int8 / int4 grids, key normalisation with an optional rotating centre, the int4 value
codebook) and :class:`FP8Codec` (vLLM's fp8 cache), built per layer from a calibrated spec by
:func:`layer_codecs`; and the RoPE tables the rotating centre reads. Shared by squeeze run's cache
(squeeze.runtime.quantized_cache), squeeze serve's paged pool and the native attention kernel's view of both
(squeeze.runtime.kernels.cpu_attention), which is why it stands apart from the cache itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from squeeze.quant.kv import (
    KeyRotation,
    codebook_scale,
    denormalize_keys_,
    dequantize,
    dequantize_fp8,
    normalize_keys,
    pack_int4,
    quantize,
    quantize_codebook,
    quantize_fp8,
    rope_trig,
    token_grid,
    unpack_int4,
)
from squeeze.quant.kv_spec import LayerFP8, LayerKV

PARAM_DTYPE = torch.float16  # per-token scales / offsets, as counted in KVSpec.bytes_per_token

#: cos / sin of ``p * freq`` for positions 0..P-1, (P, D) fp32 each, per (freq, device): shared by every layer
#: with the same RoPE frequencies, grown on demand; each position is computed once (squeeze.quant.kv.rope_trig).
_TRIG_TABLES: dict[tuple[bytes, str], tuple[Tensor, Tensor]] = {}


def trig_table(freq: Tensor, rows: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """The shared cos / sin table of ``freq (D,)`` on ``device``: (P, D) fp32 each, P >= ``rows`` (grown first;
    row p is position p)."""
    key = (freq.detach().cpu().float().numpy().tobytes(), str(device))
    empty = torch.empty((0, freq.numel()), dtype=torch.float32, device=device)
    cos, sin = _TRIG_TABLES.get(key, (empty, empty))
    if rows > cos.shape[0]:
        grown = max(rows, 2 * cos.shape[0], 256)
        more = [t.to(device) for t in rope_trig(torch.arange(cos.shape[0], grown), freq)]
        cos, sin = torch.cat([cos, more[0]]), torch.cat([sin, more[1]])
        _TRIG_TABLES[key] = (cos, sin)
    return cos, sin


def trig_rows(freq: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
    """cos / sin (T, D) fp32 of ``positions (T,)`` int64 times ``freq (D,)``, on ``positions``' device, from the
    shared table (extended to the largest position first)."""
    need = int(positions.max()) + 1 if positions.numel() else 0
    cos, sin = trig_table(freq, need, positions.device)
    return cos.index_select(0, positions), sin.index_select(0, positions)


@dataclass(frozen=True)
class EncodedTokens:
    """Tokens as stored: ``codes (B, H, n, D)`` int8 / uint8, or ``(B, H, n, D/2)`` uint8 packed int4; ``scale``
    fp32 (B, H, n, G) holding fp16 values (G grids per token); ``offset`` likewise, asymmetric grids only."""

    codes: Tensor
    scale: Tensor
    offset: Tensor | None


class TokenCodec:
    """How one tensor of one layer (keys or values) turns tokens into codes and back.

    Every token gets its own fp16 grid per ``group`` channels (squeeze.quant.kv.token_grid) from its range
    times ``clip`` (a float or a per-head (H,) tensor): int8 codes and a scale when ``symmetric``, else
    uint8 codes, a scale and an offset. With a codebook ``levels`` fp32 (2**bits,), codes are uint8 level
    indices and the scale is the grid's absmax (``clip`` unused). ``channel``: an optional per-channel
    normaliser (scale, centre) fp32 (H, D) applied first (calibrated keys; their grid is symmetric), with
    ``rotation`` (a rotating centre, squeeze.quant.kv.KeyRotation) added to its centre at each token's cache
    position: then :meth:`encode` and :meth:`decode_into` need the tokens' ``positions``.
    Tokens are independent: how they are batched or stored (contiguous or paged) never changes their codes.
    """

    def __init__(
        self,
        bits: int,
        *,
        channel: tuple[Tensor, Tensor] | None,
        clip: Tensor | float,
        symmetric: bool,
        group: int | None = None,
        levels: Tensor | None = None,
        rotation: KeyRotation | None = None,
    ):
        if rotation is not None and channel is None:
            raise ValueError("a rotating key centre needs the per-channel normaliser")
        self.bits = bits
        self.rotation = rotation
        self.group = group  # channels per grid; None: the whole head
        self.channel = channel
        self.clip = clip
        self.levels = levels
        self.symmetric = symmetric or levels is not None
        self._channel_cache: dict[tuple[torch.device, torch.dtype], tuple[Tensor, Tensor]] = {}
        self._table_cache: dict[tuple[torch.device, torch.dtype], Tensor] = {}

    @property
    def code_dtype(self) -> torch.dtype:
        """int8 for symmetric uniform int8 grids, else uint8 (asymmetric, codebook indices, packed int4)."""
        return torch.int8 if self.bits == 8 and self.symmetric and self.levels is None else torch.uint8

    def code_width(self, head_dim: int) -> int:
        """Bytes of codes per token and head: D, or D/2 packed at int4."""
        return head_dim // 2 if self.bits == 4 else head_dim

    def groups(self, head_dim: int) -> int:
        """Grids (scales) per token and head."""
        return head_dim // (self.group or head_dim)

    def _channel(self, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """The normaliser as (1, H, 1, D) tensors on ``device`` in ``dtype`` (converted once)."""
        assert self.channel is not None
        key = (device, dtype)
        if key not in self._channel_cache:
            scale, center = (t.to(device, dtype)[None, :, None, :] for t in self.channel)
            self._channel_cache[key] = (scale, center)
        return self._channel_cache[key]

    def _center(self, positions: Tensor | None, device: torch.device) -> Tensor:
        """The normaliser's centre fp32: (1, H, 1, D), or (1, H, T, D) with the rotating centre at ``positions``."""
        center = self._channel(device, torch.float32)[1]
        if self.rotation is None:
            return center
        if positions is None:
            raise ValueError("a KV codec with a rotating key centre needs the tokens' positions")
        cos, sin = trig_rows(self.rotation.freq, positions.to(device))
        return center + self.rotation.center(cos, sin)[None]  # the reference's order: k_zero + rotation

    def _table(self, device: torch.device, dtype: torch.dtype) -> Tensor:
        """The codebook by stored byte, in ``dtype`` on ``device`` (built once): at int4 (256, 2), the levels
        of a packed byte's low and high nibble, so one lookup unpacks and decodes; at int8 the levels (256,)."""
        assert self.levels is not None
        key = (device, dtype)
        if key not in self._table_cache:
            levels = self.levels.to(device, dtype)
            byte = torch.arange(256, device=device)
            self._table_cache[key] = (
                torch.stack((levels[byte & 0x0F], levels[byte >> 4]), dim=-1) if self.bits == 4 else levels
            )
        return self._table_cache[key]

    def _clip(self, device: torch.device) -> Tensor | float:
        """``clip`` as a (1, H, 1, 1, 1) tensor on ``device`` (converted once), or the float."""
        if not isinstance(self.clip, Tensor):
            return self.clip
        if self.clip.device != device or self.clip.dim() != 5:
            self.clip = self.clip.reshape(1, -1, 1, 1, 1).to(device)
        return self.clip

    def encode(self, x: Tensor, positions: Tensor | None = None) -> EncodedTokens:
        """Quantize ``x (B, H, n, D)`` (any float dtype); ``positions (n,)`` int64: the tokens' cache positions
        (used by a rotating key centre only)."""
        xf = x.float()
        if self.channel is not None:
            scale = self._channel(x.device, torch.float32)[0]
            xf = normalize_keys(xf, scale, self._center(positions, x.device))  # (B, H, n, D)
        grouped = xf.unflatten(-1, (-1, self.group or xf.shape[-1]))  # (B, H, n, G, g)
        if self.levels is not None:
            scale, offset = codebook_scale(grouped), None  # (B, H, n, G, 1)
            codes = quantize_codebook(grouped, scale, self.levels).flatten(-2)  # (B, H, n, D) uint8
        else:
            scale, offset = token_grid(grouped, self.bits, self._clip(x.device), self.symmetric)  # (B, H, n, G, 1)
            codes = quantize(grouped, scale, offset, self.bits).flatten(-2)  # (B, H, n, D)
        if self.bits == 4:
            codes = pack_int4(codes)
        return EncodedTokens(codes, scale[..., 0], offset[..., 0] if offset is not None else None)

    def decode_into(
        self, codes: Tensor, scale: Tensor, offset: Tensor | None, out: Tensor, positions: Tensor | None = None
    ) -> None:
        """Write the tokens stored as ``codes (B, H, T, D or D/2)``, ``scale`` / ``offset (B, H, T, G)`` (may be
        strided views) into ``out (B, H, T, D)`` (any float dtype, may be a view); ``positions (T,)`` int64: their
        cache positions (a rotating key centre only).

        The same operations as the reference (quant.kv.dequantize / dequantize_codebook, fake_quantize_keys):
        one pass that converts and scales the codes (a codebook lookup first), plus one for the key normaliser.
        """
        groups = scale.shape[-1]
        scale = scale[..., None].to(out.dtype)  # (B, H, T, G, 1): T*G numbers
        offset = offset[..., None].to(out.dtype) if offset is not None else None
        if self.levels is not None:
            table = self._table(out.device, out.dtype)  # (256, 2) at int4, (256,) at int8
            looked_up = table.index_select(0, codes.reshape(-1).int()).view(out.shape)  # (B, H, T, D)
            torch.mul(looked_up.unflatten(-1, (groups, -1)), scale, out=out.unflatten(-1, (groups, -1)))
        elif self.bits == 4:
            even, odd = unpack_int4(codes, signed=self.symmetric)  # (B, H, T, D/2) each
            pairs = out.unflatten(-1, (-1, 2))  # (B, H, T, D/2, 2) view of out
            for half, target in ((even, pairs[..., 0]), (odd, pairs[..., 1])):
                dequantize(half.unflatten(-1, (groups, -1)), scale, offset, out=target.unflatten(-1, (groups, -1)))
        else:
            dequantize(codes.unflatten(-1, (groups, -1)), scale, offset, out=out.unflatten(-1, (groups, -1)))
        if self.rotation is not None:
            center = self._center(positions, out.device).to(out.dtype)
            denormalize_keys_(out, self._channel(out.device, out.dtype)[0], center)
        elif self.channel is not None:
            denormalize_keys_(out, *self._channel(out.device, out.dtype))


class FP8Codec(TokenCodec):
    """One tensor of one layer as vLLM's fp8 cache stores it: every element float8_e4m3fn(x / scale), one fp32
    ``scale`` for the layer (squeeze.quant.kv.quantize_fp8 / dequantize_fp8), read back as code * scale.

    The storage interface of :class:`TokenCodec`, so the contiguous and the paged cache hold it alike: codes
    ``(B, H, n, D)`` uint8 (the float8 bytes), and no per-token parameters (``scale`` with 0 grids).
    """

    def __init__(self, scale: Tensor | float):
        super().__init__(8, channel=None, clip=1.0, symmetric=True)
        self.scale = float(scale)  # an fp32 value: exact as a float, and x / scale rounds once, in fp32

    @property
    def code_dtype(self) -> torch.dtype:
        return torch.uint8

    def code_width(self, head_dim: int) -> int:
        return head_dim

    def groups(self, head_dim: int) -> int:
        return 0

    def encode(self, x: Tensor, positions: Tensor | None = None) -> EncodedTokens:
        """Quantize ``x (B, H, n, D)`` (any float dtype); ``positions`` unused."""
        return EncodedTokens(quantize_fp8(x, self.scale), x.new_empty((*x.shape[:-1], 0), dtype=torch.float32), None)

    def decode_into(
        self, codes: Tensor, scale: Tensor, offset: Tensor | None, out: Tensor, positions: Tensor | None = None
    ) -> None:
        """Write ``codes (B, H, T, D)`` uint8, read back, into ``out (B, H, T, D)``; ``scale`` / ``offset`` /
        ``positions`` unused."""
        dequantize_fp8(codes, self.scale, out=out)


def layer_codecs(bits: int, layer: LayerKV | LayerFP8 | None) -> tuple[TokenCodec, TokenCodec]:
    """The (keys, values) codecs of one layer: calibrated from ``layer`` (int grids or fp8), or the per-token
    absmax baseline."""
    if isinstance(layer, LayerFP8):
        return FP8Codec(layer.k_scale), FP8Codec(layer.v_scale)
    if layer is None:  # uncalibrated baseline: per-token absmax for keys and values
        return (
            TokenCodec(bits, channel=None, clip=1.0, symmetric=True),
            TokenCodec(bits, channel=None, clip=1.0, symmetric=True),
        )
    keys = TokenCodec(
        bits,
        channel=(layer.k_scale, layer.k_zero),
        clip=1.0,
        symmetric=True,
        group=layer.k_group,
        rotation=layer.k_rotation,
    )
    values = TokenCodec(
        bits, channel=None, clip=layer.v_clip, symmetric=layer.v_symmetric, group=layer.v_group, levels=layer.v_levels
    )
    return keys, values


__all__ = ["PARAM_DTYPE", "EncodedTokens", "TokenCodec", "FP8Codec", "layer_codecs", "trig_table", "trig_rows"]
