"""The native CPU attention kernel (cpu_attention.cpp) from Python, and the torch reference it is tested against.

One call attends every row of a ragged step over its layer's stored keys and values, read as stored (int8 /
packed int4 codes on per-token fp16 grids, codebook indices, fp8 bytes, or full-precision float32 tokens, plus
the full-precision sink tokens): K/V are dequantized per tile of 16 tokens inside the kernel, never as a whole
history. Rows are described by :class:`RaggedRows`; a layer's keys or values by :class:`KVStore`.

A row's result never depends on the other rows, on how its queries are split, on the thread count or on the
instruction set (cpu_attention.cpp's header says why): squeeze run and squeeze serve call the same kernel and
get the same bits for a request. The kernel computes softmax(q k^T * scaling) v with a float32 online softmax;
:func:`reference_attention` computes the same in float64 from the histories the caches dequantize, and the
two agree to about 1e-6 of the values' magnitude (tests/runtime/test_cpu_attention.py).

The library is built like the LUT kernels (squeeze.runtime.kernels.cpu_build, same cache, own name); without a
compiler :func:`attention_kernels` warns once and returns None, and callers keep their torch path.
"""

from __future__ import annotations

import ctypes
import functools
import threading
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from squeeze.runtime.kernels.cpu_build import (
    ISAS,
    KernelBuildError,
    KernelWarning,
    NativeLibrary,
    best_isa,
    build_library,
)

SOURCE = Path(__file__).with_name("cpu_attention.cpp")
#: the KV write (squeeze.runtime.kernels.cpu_kv_write), linked into the same library
WRITE_SOURCE = Path(__file__).with_name("cpu_kv_write.cpp")
#: cpu_attention.cpp's sq_kv.kind values.
KV_F32, KV_I8, KV_U8, KV_I4, KV_U4, KV_T8, KV_T4 = range(7)


class SqKV(ctypes.Structure):
    """cpu_attention.cpp's ``sq_kv``: one layer's keys or values (pointers into tensors Python owns)."""

    _fields_ = [
        ("codes", ctypes.c_void_p),
        ("scale", ctypes.c_void_p),
        ("offset", ctypes.c_void_p),
        ("table", ctypes.c_void_p),
        ("ch_scale", ctypes.c_void_p),
        ("ch_center", ctypes.c_void_p),
        ("sink", ctypes.c_void_p),
        ("head_stride", ctypes.c_int64),
        ("sink_head_stride", ctypes.c_int64),
        ("center_rows", ctypes.c_int64),
        ("const_scale", ctypes.c_float),
        ("kind", ctypes.c_int32),
        ("groups", ctypes.c_int32),
    ]


@dataclass(frozen=True)
class AttentionKernels(NativeLibrary):
    """The loaded attention library and the instruction set it runs here."""

    what = "attention kernel"


_lock = threading.Lock()


@functools.cache
def attention_kernels() -> AttentionKernels | None:
    """The attention kernel, built on first use; None (after one KernelWarning) when it cannot be built/loaded."""
    with _lock:
        try:
            path = build_library((SOURCE, WRITE_SOURCE), "squeeze_cpu_attention")
            lib = _load(path)
        except KernelBuildError as exc:
            warnings.warn(
                f"squeeze: native CPU attention unavailable ({exc}); using torch's attention", KernelWarning, 2
            )
            return None
        return AttentionKernels(lib=lib, isa=best_isa(lib), path=path)


def _load(path: Path) -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise KernelBuildError(f"cannot load {path.name}: {exc}") from exc
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
    lib.sq_isa_supported.argtypes, lib.sq_isa_supported.restype = [ctypes.c_int], ctypes.c_int
    lib.sq_attention.argtypes = [ptr, i32, i32, i32, ctypes.c_float, i64, ptr, ptr, ptr, ptr, ptr]
    lib.sq_attention.argtypes += [ctypes.POINTER(SqKV), ctypes.POINTER(SqKV), ptr, i32, i32]
    lib.sq_attention.restype = None
    lib.sq_kv_write.argtypes = [ptr, i64, i64, i64, i32, i32, ptr, ptr, ctypes.POINTER(SqKV), ptr, ptr, ptr, i32, i32]
    lib.sq_kv_write.restype = None
    return lib


@dataclass(frozen=True, eq=False)
class KVStore:
    """Keys or values of one layer as the kernel reads them: the struct, and every tensor it points into."""

    struct: SqKV
    keep: tuple[Tensor, ...]


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _dense(t: Tensor, dtype: torch.dtype, what: str) -> Tensor:
    if t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"the attention kernel reads {what} as contiguous {dtype} on the CPU, found {t.dtype}")
    return t


def full_store(tokens: Tensor, head_stride: int) -> KVStore:
    """Full-precision keys or values: ``tokens`` float32, contiguous, token ``(h, slot)`` at row
    ``h * head_stride + slot`` of its (-1, D) view (the pool's (H, S, D): ``head_stride`` S)."""
    _dense(tokens, torch.float32, "full-precision keys / values")
    return KVStore(SqKV(codes=tokens.data_ptr(), head_stride=head_stride, kind=KV_F32), (tokens,))


def quantized_store(
    codec: object,
    codes: Tensor,
    scale: Tensor,
    offset: Tensor | None,
    sink: Tensor | None,
    *,
    head_stride: int,
    sink_head_stride: int,
    positions: int,
) -> KVStore | None:
    """Keys or values stored by ``codec`` (squeeze.runtime.kv_codecs.TokenCodec or FP8Codec), or None for a codec
    the kernel does not read.

    ``codes`` uint8 / int8 (token ``(h, slot)`` at row ``h * head_stride + slot`` of its (-1, D or D/2) view),
    ``scale`` / ``offset`` fp16 indexed like it (-1, G); ``sink`` float32 (entry ``(h, e)`` at row
    ``h * sink_head_stride + e`` of its (-1, D) view), or None. ``positions``: one more than the largest cache
    position the kernel will read (a rotating key centre's table is grown to it: (H, P, D) float32 per layer).
    """
    from squeeze.runtime.kv_codecs import FP8Codec, TokenCodec

    if not isinstance(codec, TokenCodec):
        return None
    keep: list[Tensor] = [_dense(codes, codes.dtype, "codes")]
    fields: dict[str, object] = {"codes": codes.data_ptr(), "head_stride": head_stride}
    if sink is not None:
        keep.append(_dense(sink, torch.float32, "sink tokens"))
        fields |= {"sink": sink.data_ptr(), "sink_head_stride": sink_head_stride}
    if isinstance(codec, FP8Codec):
        table = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        keep.append(table)
        fields |= {"table": table.data_ptr(), "const_scale": codec.scale, "kind": KV_T8, "groups": 1}
        return KVStore(SqKV(**fields), tuple(keep))
    keep.append(_dense(scale, torch.float16, "grid scales"))
    fields |= {"scale": scale.data_ptr(), "groups": scale.shape[-1]}
    if offset is not None:
        keep.append(_dense(offset, torch.float16, "grid offsets"))
        fields["offset"] = offset.data_ptr()
    if codec.levels is not None:
        table = codec.levels.detach().to("cpu", torch.float32).contiguous()
        keep.append(table)
        fields |= {"table": table.data_ptr(), "kind": KV_T4 if codec.bits == 4 else KV_T8}
    elif codec.bits == 4:
        fields["kind"] = KV_I4 if codec.symmetric else KV_U4
    else:
        fields["kind"] = KV_I8 if codec.symmetric else KV_U8
    if codec.channel is not None:
        ch_scale, ch_center = (t.detach().to("cpu", torch.float32).contiguous() for t in codec.channel)
        if codec.rotation is not None:
            ch_center = _centre_table(codec, positions)
            fields["center_rows"] = ch_center.shape[1]
        keep += [ch_scale, ch_center]
        fields |= {"ch_scale": ch_scale.data_ptr(), "ch_center": ch_center.data_ptr()}
    return KVStore(SqKV(**fields), tuple(keep))


#: Each rotating-centre codec's centre table (see :func:`_centre_table`), kept while the codec lives.
_CENTRES: weakref.WeakKeyDictionary[object, Tensor] = weakref.WeakKeyDictionary()


def _centre_table(codec: Any, positions: int) -> Tensor:
    """The key normaliser's centre of ``codec`` (a TokenCodec with a rotating centre) at cache positions 0..P-1,
    (H, P, D) float32 with P >= ``positions`` (grown by doubling, from 256): the normaliser's centre plus the
    rotating one, as TokenCodec computes it (same ops, same bits), once per position instead of per token read."""
    from squeeze.runtime.kv_codecs import trig_table

    table = _CENTRES.get(codec)
    if table is None or table.shape[1] < positions:
        rows = max(positions, 2 * (table.shape[1] if table is not None else 0), 256)
        cos, sin = trig_table(codec.rotation.freq, rows, torch.device("cpu"))
        centre = codec.channel[1].detach().to("cpu", torch.float32)[:, None, :]
        table = (centre + codec.rotation.center(cos[:rows], sin[:rows])).contiguous()
        _CENTRES[codec] = table
    return table


@dataclass(frozen=True)
class RaggedRows:
    """The rows of one step, as int64 CPU tensors.

    Row b: queries ``q_offsets[b]:q_offsets[b+1]`` of the step's N, history ``k_offsets[b]:k_offsets[b+1]`` of
    the step's K history tokens (its whole history, from position 0; the last n history tokens are the row's
    n queries' own). ``slots (K,)``: each history token's slot in the stores. ``sink_of (K,)``: its sink
    entry, -1 when it is read from the codes (None: no sink). ``key_start (B,)``: keys before it are not
    seen (left padding), or None.
    """

    q_offsets: Tensor
    k_offsets: Tensor
    slots: Tensor
    sink_of: Tensor | None = None
    key_start: Tensor | None = None

    @property
    def rows(self) -> int:
        return int(self.q_offsets.numel()) - 1


def attend(
    kernels: AttentionKernels,
    query: Tensor,
    kv_heads: int,
    rows: RaggedRows,
    keys: KVStore,
    values: KVStore,
    scaling: float,
    *,
    threads: int | None = None,
) -> Tensor:
    """softmax(q k^T * scaling) v of every row, causal within a row (aligned at its end).

    ``query (N, Hq, D)`` float32, post-RoPE; query head ``j`` reads kv head ``j // (Hq / kv_heads)``.
    Returns (N, Hq, D) float32.
    """
    n, hq, d = query.shape
    if hq % kv_heads:
        raise ValueError(f"{hq} query heads do not share {kv_heads} kv heads evenly")
    query = _dense(query.contiguous(), torch.float32, "queries")
    out = torch.empty_like(query)
    index = [_dense(t, torch.int64, "row indices") for t in (rows.q_offsets, rows.k_offsets, rows.slots)]
    extra = [None if t is None else _dense(t, torch.int64, "row indices") for t in (rows.key_start, rows.sink_of)]
    kernels.lib.sq_attention(
        query.data_ptr(),
        hq,
        kv_heads,
        d,
        float(scaling),
        rows.rows,
        index[0].data_ptr(),
        index[1].data_ptr(),
        _ptr(extra[0]),
        index[2].data_ptr(),
        _ptr(extra[1]),
        ctypes.byref(keys.struct),
        ctypes.byref(values.struct),
        out.data_ptr(),
        ISAS[kernels.isa],
        threads if threads is not None else torch.get_num_threads(),
    )
    return out


def reference_attention(
    query: Tensor, keys: Tensor, values: Tensor, rows: RaggedRows, scaling: float, *, dtype: torch.dtype = torch.float64
) -> Tensor:
    """What :func:`attend` computes, in torch: ``query (N, Hq, D)``, the step's histories ``keys`` / ``values
    (Hkv, K, D)`` as the caches dequantize them (squeeze.serve.engine.kv_pool.PagedKVPool.update reads them so), row
    after row as in ``rows`` (``slots`` / ``sink_of`` unused). Softmax attention in ``dtype``; (N, Hq, D) float32."""
    n, hq, d = query.shape
    group = hq // keys.shape[0]
    out = torch.zeros((n, hq, d), dtype=dtype)
    for b in range(rows.rows):
        q0, q1 = int(rows.q_offsets[b]), int(rows.q_offsets[b + 1])
        k0, k1 = int(rows.k_offsets[b]), int(rows.k_offsets[b + 1])
        start = int(rows.key_start[b]) if rows.key_start is not None else 0
        q = query[q0:q1].to(dtype).transpose(0, 1)  # (Hq, n, D)
        k = keys[:, k0:k1].to(dtype).repeat_interleave(group, 0)  # (Hq, L, D)
        v = values[:, k0:k1].to(dtype).repeat_interleave(group, 0)
        length, new = k1 - k0, q1 - q0
        pos = torch.arange(length - new, length)[:, None]
        key = torch.arange(length)[None, :]
        visible = (key <= pos) & (key >= start)  # (n, L)
        scores = (q @ k.transpose(1, 2) * scaling).masked_fill(~visible, float("-inf"))
        weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a query that sees no key: zeros
        out[q0:q1] = (weights @ v).transpose(0, 1)
    return out.float()


__all__ = [
    "AttentionKernels",
    "KVStore",
    "RaggedRows",
    "SqKV",
    "attend",
    "attention_kernels",
    "full_store",
    "quantized_store",
    "reference_attention",
]
