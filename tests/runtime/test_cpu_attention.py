"""The native attention kernel against its torch reference, over every KV layout the paged pool stores.

Bound: the kernel (float32 online softmax) and the float64 reference over the histories the pool dequantizes
differ by at most 1e-5 of the values' largest magnitude. Every instruction set gives the same bits, and a
row's result never depends on the rows beside it, on how many threads run, or on how its prompt was chunked.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from squeeze.quant.kv import KeyRotation
from squeeze.quant.kv_spec import KVSpec, LayerFP8, LayerKV
from squeeze.runtime.attention import RunAttention, native_kernels
from squeeze.runtime.kernels.cpu_attention import (
    AttentionKernels,
    RaggedRows,
    attend,
    attention_kernels,
    reference_attention,
)
from squeeze.runtime.kernels.cpu_build import KernelWarning
from squeeze.runtime.quantized_cache import SqueezeKVCache
from squeeze.serve.engine.blocks import BlockManager
from squeeze.serve.engine.kv_pool import AttentionShape, PagedKVPool, StepSlots

BOUND = 1e-5
SCALING = 0.3
HQ, HKV = 8, 4  # GQA: two query heads per kv head


def _calibrated(bits: int, d: int, *, symmetric_values: bool, levels: bool, rotating: bool = False) -> LayerKV:
    gen = torch.Generator().manual_seed(bits + d)
    freq = torch.logspace(0, -3, d // 2).repeat_interleave(2)
    rotation = KeyRotation(freq, torch.randn(HKV, d, generator=gen) * 4, torch.randn(HKV, d, generator=gen) * 4)
    return LayerKV(
        k_scale=torch.rand(HKV, d, generator=gen) + 0.5,
        k_zero=torch.randn(HKV, d, generator=gen) * 0.1,
        v_clip=torch.full((HKV,), 0.9),
        k_symmetric=True,
        v_symmetric=symmetric_values,
        k_group=d // 2,
        v_group=d // 2 if bits == 4 else None,
        v_levels=torch.linspace(-1, 1, 2**bits) if levels else None,
        k_rotation=rotation if rotating else None,
    )


def _spec(name: str, d: int) -> KVSpec | None:
    specs = {
        "int8-dynamic": lambda: KVSpec.dynamic(8, ("attn",), sink_tokens=4),
        "int4-dynamic": lambda: KVSpec.dynamic(4, ("attn",), sink_tokens=4),
        "int8-asymmetric": lambda: KVSpec(8, 4, ("attn",), (_calibrated(8, d, symmetric_values=False, levels=False),)),
        "int4-asymmetric": lambda: KVSpec(4, 4, ("attn",), (_calibrated(4, d, symmetric_values=False, levels=False),)),
        "int4-codebook": lambda: KVSpec(4, 4, ("attn",), (_calibrated(4, d, symmetric_values=True, levels=True),)),
        "int4-rotating": lambda: KVSpec(
            4, 4, ("attn",), (_calibrated(4, d, symmetric_values=True, levels=True, rotating=True),)
        ),
        "int4-no-sink": lambda: KVSpec.dynamic(4, ("attn",), sink_tokens=0),
        "fp8": lambda: KVSpec.fp8(("attn",), (LayerFP8(torch.tensor(0.02), torch.tensor(0.005)),)),
        "fp32": lambda: None,
    }
    return specs[name]()


SPECS = [
    "int8-dynamic",
    "int4-dynamic",
    "int8-asymmetric",
    "int4-asymmetric",
    "int4-codebook",
    "int4-rotating",
    "int4-no-sink",
    "fp8",
    "fp32",
]


@pytest.fixture(scope="module")
def kernels() -> AttentionKernels:
    loaded = attention_kernels()
    if loaded is None:
        pytest.skip("no C++ compiler: the native attention kernel is not built")
    return loaded


def _isas(kernels: AttentionKernels) -> list[AttentionKernels]:
    return [kernels.with_isa(isa) for isa in ("scalar", "avx2", "avx512") if kernels.supports(isa)]


class _Step:
    """A pool of one layer and its block manager, fed step by step like the engine feeds it."""

    def __init__(self, spec: KVSpec | None, d: int, block_size: int = 4, seed: int = 0):
        self.sink = spec.sink_tokens if spec is not None else 0
        self.pool = PagedKVPool(
            spec, AttentionShape(1, HKV, d), num_blocks=256, block_size=block_size, sequences=4, dtype=torch.float32
        )
        self.blocks = BlockManager(256, block_size, 4 if self.sink else 0)
        self.gen = torch.Generator().manual_seed(seed)
        self.d = d

    def feed(self, rows: list[tuple[str, int, int]]) -> tuple[Tensor, RaggedRows, Tensor, Tensor]:
        """Write rows (seq_id, start, new tokens) of random keys and values; the step's queries, rows and
        dequantized histories (Hkv, K, D)."""
        slots = self.slots(rows)
        n = sum(r[2] for r in rows)
        keys = torch.randn(1, HKV, n, self.d, generator=self.gen) * 3
        values = torch.randn(1, HKV, n, self.d, generator=self.gen)
        history_k, history_v = self.pool.update(0, keys, values, slots)
        q_offsets = torch.tensor([0, *[r[2] for r in rows]]).cumsum(0)
        k_offsets = torch.tensor([0, *[r[1] + r[2] for r in rows]]).cumsum(0)
        sink_of = torch.full((int(k_offsets[-1]),), -1, dtype=torch.long)
        sink_of[slots.sink_positions] = slots.sink_entries
        ragged = RaggedRows(q_offsets, k_offsets, slots.read_slots, sink_of if self.sink else None)
        query = torch.randn(n, HQ, self.d, generator=self.gen) * 2
        return query, ragged, history_k[0], history_v[0]

    def slots(self, rows: list[tuple[str, int, int]]) -> StepSlots:
        new, sink_new_tokens, sink_new, reads, sink_positions, sink_entries = [], [], [], [], [], []
        new_positions: list[int] = []
        read_positions: list[int] = []
        for seq_id, start, n in rows:
            new_positions += range(start, start + n)
            read_positions += range(start + n)
            self.blocks.grow(seq_id, start + n)
            sink_new_tokens += [len(new) + p - start for p in range(start, min(start + n, self.sink))]
            new += self.blocks.slots(seq_id, start, start + n)
            base = self.blocks.sinks.get(seq_id, 0) * self.sink
            sink_new += [base + p for p in range(start, min(start + n, self.sink))]
            kept = min(start + n, self.sink)
            sink_positions += range(len(reads), len(reads) + kept)
            sink_entries += range(base, base + kept)
            reads += self.blocks.slots(seq_id, 0, start + n)
        lists = (new, sink_new_tokens, sink_new, reads, sink_positions, sink_entries, new_positions, read_positions)
        return StepSlots(*(torch.tensor(v, dtype=torch.long) for v in lists))

    def attend(self, kernels: AttentionKernels, query: Tensor, rows: RaggedRows, threads: int = 2) -> Tensor:
        stores = self.pool.kernel_stores(0, int((rows.k_offsets[1:] - rows.k_offsets[:-1]).max()))
        assert stores is not None
        return attend(kernels, query, HKV, rows, *stores, SCALING, threads=threads)


Tensor = torch.Tensor

# a ragged step: a prompt chunk past its first block, a decode row, a prompt's first chunk, a long decode row
FIRST = [("a", 0, 37), ("b", 0, 2), ("c", 0, 20), ("d", 0, 70)]
SECOND = [("a", 37, 1), ("b", 2, 30), ("c", 20, 13), ("d", 70, 1)]


@pytest.mark.parametrize("d", [64, 8])
@pytest.mark.parametrize("name", SPECS)
def test_kernel_matches_the_reference_on_every_isa(kernels: AttentionKernels, name: str, d: int) -> None:
    step = _Step(_spec(name, d), d)
    for rows in (FIRST, SECOND):
        query, ragged, keys, values = step.feed(rows)
        reference = reference_attention(query, keys, values, ragged, SCALING)
        outs = [step.attend(isa, query, ragged) for isa in _isas(kernels)]
        error = float((outs[0] - reference).abs().max() / values.abs().max())
        assert error <= BOUND, (name, error)
        for other in outs[1:]:
            assert torch.equal(other, outs[0])  # every instruction set: the same bits


def test_a_row_does_not_depend_on_its_neighbours_threads_or_chunking(kernels: AttentionKernels) -> None:
    spec = _spec("int4-rotating", 64)
    packed = _Step(spec, 64, block_size=8, seed=1)
    packed.feed(FIRST)
    query, ragged, _, _ = packed.feed(SECOND)
    together = packed.attend(kernels, query, ragged, threads=2)
    alone = packed.attend(kernels, query, ragged, threads=1)
    assert torch.equal(together, alone)
    # row "b" alone: its 30 queries of the second step, rows from the same pool
    q0, q1, k0, k1 = (
        int(t) for t in (ragged.q_offsets[1], ragged.q_offsets[2], ragged.k_offsets[1], ragged.k_offsets[2])
    )
    sink_of = ragged.sink_of[k0:k1] if ragged.sink_of is not None else None
    single = RaggedRows(torch.tensor([0, q1 - q0]), torch.tensor([0, k1 - k0]), ragged.slots[k0:k1], sink_of)
    assert torch.equal(packed.attend(kernels, query[q0:q1], single), together[q0:q1])
    # its last query on its own (a decode row over the same history) gives that query's bits too
    last = RaggedRows(torch.tensor([0, 1]), torch.tensor([0, k1 - k0]), ragged.slots[k0:k1], sink_of)
    assert torch.equal(packed.attend(kernels, query[q1 - 1 : q1], last), together[q1 - 1 : q1])


def test_left_padding_is_not_seen_and_a_query_that_sees_nothing_gets_zeros(kernels: AttentionKernels) -> None:
    step = _Step(None, 8)
    query, ragged, keys, values = step.feed([("a", 0, 20), ("b", 0, 20)])
    padded = RaggedRows(ragged.q_offsets, ragged.k_offsets, ragged.slots, None, torch.tensor([0, 5]))
    out = step.attend(kernels, query, padded)
    reference = reference_attention(query, keys, values, padded, SCALING)
    assert float((out - reference).abs().max() / values.abs().max()) <= BOUND
    assert torch.equal(out[20:25], torch.zeros_like(out[20:25]))  # row b's padding queries


def test_without_a_compiler_one_warning_and_torch_attention(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    monkeypatch.setenv("SQUEEZE_KERNEL_CACHE", str(tmp_path / "kernels"))
    attention_kernels.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert attention_kernels() is None and attention_kernels() is None
            assert native_kernels(torch.nn.Linear(2, 2)) is None  # squeeze run and serve keep SDPA
        messages = [str(w.message) for w in caught if issubclass(w.category, KernelWarning)]
        assert len(messages) == 1 and "native CPU attention unavailable" in messages[0]
    finally:
        attention_kernels.cache_clear()


def test_the_switch_and_the_model_decide_the_native_path(
    kernels: AttentionKernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = torch.nn.Linear(2, 2)
    assert native_kernels(model) is not None
    assert native_kernels(model.to(torch.float16)) is None  # the kernel reads float32 queries and sinks
    monkeypatch.setenv("SQUEEZE_NATIVE_ATTENTION", "0")
    assert native_kernels(torch.nn.Linear(2, 2)) is None


@pytest.mark.parametrize("name", ["int4-rotating", "int8-asymmetric", "fp8"])
def test_squeeze_runs_contiguous_cache_is_read_in_place(kernels: AttentionKernels, name: str) -> None:
    """squeeze run's cache (batch rows, left padding, sinks apart from the streams) through RunAttention."""
    spec = _spec(name, 64)
    assert spec is not None
    cache = SqueezeKVCache(spec)
    cache.set_native(True)
    layer = cache.layers[0]
    gen = torch.Generator().manual_seed(3)
    key_start = torch.tensor([0, 6])  # row 1 is left-padded by 6 tokens
    run = RunAttention(kernels, cache, key_start)
    module = torch.nn.Module()
    module.layer_idx = 0  # type: ignore[assignment]
    for new in (21, 1, 1):  # a prompt batch, then two decode steps
        keys = torch.randn(2, HKV, new, 64, generator=gen) * 3
        values = torch.randn(2, HKV, new, 64, generator=gen)
        cache.update(keys, values, 0)
        query = torch.randn(2, HQ, new, 64, generator=gen)
        out = run.attend(module, query, SCALING)  # (B, T, Hq, D)
        # (B, Hkv, L, D) each, as the cache dequantizes them for SDPA
        history_k = layer._history(layer.sink_keys, layer.k_stream)
        history_v = layer._history(layer.sink_values, layer.v_stream)
        length = history_k.shape[2]
        offsets = torch.tensor([0, new, 2 * new]), torch.tensor([0, length, 2 * length])
        rows = RaggedRows(*offsets, torch.empty(0), None, key_start)  # slots: the reference reads none
        flat_k = history_k.transpose(0, 1).reshape(HKV, 2 * length, 64)
        flat_v = history_v.transpose(0, 1).reshape(HKV, 2 * length, 64)
        flat_q = query.transpose(1, 2).reshape(2 * new, HQ, 64)
        reference = reference_attention(flat_q, flat_k, flat_v, rows, SCALING).view(2, new, HQ, 64)
        visible = torch.ones(2, new, dtype=torch.bool)
        visible[1, : max(0, 6 - (length - new))] = False  # padding queries see nothing: zeros in both
        error = float((out - reference)[visible].abs().max() / flat_v.abs().max())
        assert error <= BOUND, (name, new, error)
