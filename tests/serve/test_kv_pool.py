"""The paged KV pool: what it reads back equals squeeze run's contiguous cache bit for bit, its bytes, its sizing."""

from __future__ import annotations

import pytest
import torch

from squeeze.errors import ConfigError
from squeeze.quant.kv import KeyRotation
from squeeze.quant.kv_spec import KVSpec, LayerFP8, LayerKV
from squeeze.runtime.quantized_cache import SqueezeKVLayer
from squeeze.serve.engine.blocks import BlockManager
from squeeze.serve.engine.kv_pool import AttentionShape, PagedKVPool, StepSlots, block_bytes

H, D = 2, 8
SHAPE = AttentionShape(layers=1, kv_heads=H, head_dim=D)


def _calibrated(bits: int, *, symmetric_values: bool, levels: bool, rotating: bool = False) -> LayerKV:
    gen = torch.Generator().manual_seed(bits)
    freq = torch.tensor([1.0, 0.1, 0.01, 0.001] * 2)
    rotation = KeyRotation(freq, torch.randn(H, D, generator=gen) * 4, torch.randn(H, D, generator=gen) * 4)
    return LayerKV(
        k_scale=torch.rand(H, D, generator=gen) + 0.5,
        k_zero=torch.randn(H, D, generator=gen) * 0.1,
        v_clip=torch.full((H,), 0.9),
        k_symmetric=True,
        v_symmetric=symmetric_values,
        k_group=D // 2,
        v_levels=torch.linspace(-1, 1, 2**bits) if levels else None,
        k_rotation=rotation if rotating else None,
    )


SPECS = {
    "int8-dynamic": KVSpec.dynamic(8, ("attn",), sink_tokens=2),
    "int4-dynamic": KVSpec.dynamic(4, ("attn",), sink_tokens=2),
    "int8-asymmetric": KVSpec(8, 2, ("attn",), (_calibrated(8, symmetric_values=False, levels=False),)),
    "int4-codebook": KVSpec(4, 2, ("attn",), (_calibrated(4, symmetric_values=True, levels=True),)),
    "int4-rotating": KVSpec(4, 2, ("attn",), (_calibrated(4, symmetric_values=True, levels=True, rotating=True),)),
    "fp8": KVSpec.fp8(("attn",), (LayerFP8(torch.tensor(0.02), torch.tensor(0.005)),)),
    "fp32": None,
}


def _slots(blocks: BlockManager, rows: list[tuple[str, int, int]], sink: int) -> StepSlots:
    """StepSlots for rows (seq_id, start, new tokens), packed as the engine packs them."""
    new_slots, sink_tokens, sink_new, reads, sink_positions, sink_entries = [], [], [], [], [], []
    new_positions: list[int] = []
    read_positions: list[int] = []
    for seq_id, start, n in rows:
        new_positions += range(start, start + n)
        read_positions += range(start + n)
        blocks.grow(seq_id, start + n)
        sink_tokens += [len(new_slots) + p - start for p in range(start, min(start + n, sink))]
        new_slots += blocks.slots(seq_id, start, start + n)
        base = blocks.sinks.get(seq_id, 0) * sink
        sink_new += [base + p for p in range(start, min(start + n, sink))]
        kept = min(start + n, sink)
        sink_positions += range(len(reads), len(reads) + kept)
        sink_entries += range(base, base + kept)
        reads += blocks.slots(seq_id, 0, start + n)
    as_long = lambda values: torch.tensor(values, dtype=torch.long)  # noqa: E731
    lists = (new_slots, sink_tokens, sink_new, reads, sink_positions, sink_entries, new_positions, read_positions)
    return StepSlots(*(as_long(v) for v in lists))


@pytest.mark.parametrize("name", list(SPECS))
def test_paged_history_equals_the_contiguous_cache_bit_for_bit(name: str) -> None:
    spec = SPECS[name]
    sink = spec.sink_tokens if spec is not None else 0
    pool = PagedKVPool(spec, SHAPE, num_blocks=16, block_size=4, sequences=2, dtype=torch.float32)
    blocks = BlockManager(16, 4, 2 if sink else 0)
    gen = torch.Generator().manual_seed(0)
    # two sequences fed in chunks of different sizes at once: (3, 5), then (6, 1), then (1, 1)
    feeds = [(3, 5), (6, 1), (1, 1)]
    total = [sum(f[i] for f in feeds) for i in range(2)]
    keys = [torch.randn(1, H, n, D, generator=gen) * 3 for n in total]
    values = [torch.randn(1, H, n, D, generator=gen) for n in total]
    refs = [SqueezeKVLayer(spec.bits, spec.layers[0], spec.sink_tokens) if spec is not None else None for _ in range(2)]
    done = [0, 0]
    for chunk in feeds:
        slots = _slots(blocks, [(f"s{i}", done[i], chunk[i]) for i in range(2)], sink)
        new_k = [keys[i][:, :, done[i] : done[i] + chunk[i]] for i in range(2)]
        new_v = [values[i][:, :, done[i] : done[i] + chunk[i]] for i in range(2)]
        k_hist, v_hist = pool.update(0, torch.cat(new_k, dim=2), torch.cat(new_v, dim=2), slots)  # (1, H, K, D)
        k0 = 0
        for i in range(2):
            done[i] += chunk[i]
            if refs[i] is None:
                want_k, want_v = keys[i][:, :, : done[i]], values[i][:, :, : done[i]]
            else:
                want_k, want_v = refs[i].update(new_k[i], new_v[i])
            assert torch.equal(k_hist[:, :, k0 : k0 + done[i]], want_k)
            assert torch.equal(v_hist[:, :, k0 : k0 + done[i]], want_v)
            k0 += done[i]
        assert k_hist.shape[2] == k0 == v_hist.shape[2]


@pytest.mark.parametrize("name", list(SPECS))
def test_pool_bytes_are_its_tensors(name: str) -> None:
    spec = SPECS[name]
    pool = PagedKVPool(spec, SHAPE, num_blocks=5, block_size=4, sequences=3, dtype=torch.float32)
    held = sum(
        t.numel() * t.element_size()
        for store in (*pool._keys, *pool._values)
        for t in vars(store).values()
        if isinstance(t, torch.Tensor)
    )
    assert pool.nbytes == held
    if spec is not None:  # int4 codes are a quarter of fp16's bytes, plus fp16 grid parameters
        assert block_bytes(spec, SHAPE, 4, torch.float16) < block_bytes(None, SHAPE, 4, torch.float16)


def test_sized_pool_fills_the_budget_and_refuses_less_than_one_full_sequence() -> None:
    spec = SPECS["int4-dynamic"]
    per_block = block_bytes(spec, SHAPE, 16, torch.float32)
    pool = PagedKVPool.sized(
        spec,
        SHAPE,
        memory_bytes=100 * per_block + 5000,
        block_size=16,
        sequences=2,
        dtype=torch.float32,
        min_tokens=64,
    )
    assert pool.nbytes <= 100 * per_block + 5000 < pool.nbytes + per_block
    with pytest.raises(ConfigError, match=r"one sequence of the full context \(4096 tokens\) needs 256") as caught:
        PagedKVPool.sized(
            spec,
            SHAPE,
            memory_bytes=100 * per_block,
            block_size=16,
            sequences=2,
            dtype=torch.float32,
            min_tokens=4096,
        )
    assert "--kv-memory" in (caught.value.hint or "")


def test_the_pool_names_its_cache_as_reports_do() -> None:
    labels = {
        name: PagedKVPool(spec, SHAPE, num_blocks=2, block_size=4, sequences=1, dtype=torch.float32).label
        for name, spec in SPECS.items()
    }
    assert labels == {
        "int8-dynamic": "int8",
        "int4-dynamic": "int4",
        "int8-asymmetric": "int8",
        "int4-codebook": "int4",
        "int4-rotating": "int4",
        "fp8": "fp8",  # 8 bits per element too, but not squeeze's int8 grid
        "fp32": "float32",  # unquantized: the dtype it holds, not "16-bit"
    }
