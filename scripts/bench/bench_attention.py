"""Attention over the paged quantized KV: the native kernel vs today's per-row SDPA, and its share of a decode step.

    .venv/bin/python scripts/bench/bench_attention.py [--artifact DIR] [--rows 16] [--context 512] [--repeats 10]
        [--threads N] [--cpu-time] [--json bench-out/attention.json]

(1) One layer's attention for ``--rows`` decode rows over ``--context`` tokens of history each, in a paged
    pool of blocks of 16 (SmolLM2-135M's geometry: 9 query heads, 3 kv heads, head_dim 64; the artifact's
    with --artifact, and its calibrated KV spec for the int4 pool; else a calibrated-like int4 layout: keys
    normalised per channel with grids of 32, values on a 16-level codebook, 4 sink tokens). Timed: the native
    kernel on the int4 pool and on a float32 pool, and today's path (the pool dequantizes every row's history,
    then transformers' SDPA once per row) on both. Each is called alternately, medians.
(2) With --artifact: one whole decode step of the model (squeeze.serve.engine.runner.ModelRunner) for the same rows,
    the pool filled with random keys / values: int4 KV (native attention), int4 KV with
    SQUEEZE_NATIVE_ATTENTION=0 (today's path) and 16-bit KV (SDPA, as squeeze run attends a DynamicCache).
    Attention's share: the time inside the model's attention function, and with the KV cache's writes/reads.
The CPU model, thread count and the command line are printed with the numbers. ``--cpu-time`` (with
``--threads 1``): time the calling thread's CPU time instead of the wall clock, which other processes on a
shared machine then inflate far less.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from bench_common import command_line, revision  # scripts/bench/ is on sys.path when a script runs

from squeeze.quant.kv_spec import KVSpec, LayerKV
from squeeze.runtime.kernels.cpu_attention import RaggedRows, attend, attention_kernels
from squeeze.serve.engine.blocks import BlockManager
from squeeze.serve.engine.kv_pool import AttentionShape, PagedKVPool, StepSlots
from squeeze.serve.engine.runner import RowSpan, paged_attention

BLOCK = 16
#: what the timings read: the wall clock, or the calling thread's CPU time (--cpu-time)
CLOCK: list[Callable[[], float]] = [time.perf_counter]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _synthetic_spec(layers: int, kv_heads: int, d: int) -> KVSpec:
    gen = torch.Generator().manual_seed(0)
    layer = LayerKV(
        k_scale=torch.rand(kv_heads, d, generator=gen) + 0.5,
        k_zero=torch.randn(kv_heads, d, generator=gen) * 0.1,
        v_clip=torch.ones(kv_heads),
        k_symmetric=True,
        v_symmetric=True,
        k_group=32,
        v_levels=torch.linspace(-1, 1, 16),
    )
    return KVSpec(4, 4, tuple(f"l{i}" for i in range(layers)), tuple(layer for _ in range(layers)))


def _filled_pool(
    spec: KVSpec | None, shape: AttentionShape, rows: int, context: int
) -> tuple[PagedKVPool, BlockManager, StepSlots]:
    """A pool holding ``rows`` sequences of ``context + 1`` tokens (random keys / values in every layer); the
    StepSlots of a decode step of all rows (each feeding its token at position ``context``)."""
    sink = spec.sink_tokens if spec is not None else 0
    blocks_per = -(-(context + 1) // BLOCK)
    pool = PagedKVPool(spec, shape, num_blocks=rows * blocks_per, block_size=BLOCK, sequences=rows, dtype=torch.float32)
    blocks = BlockManager(pool.num_blocks, BLOCK, rows if sink else 0)
    gen = torch.Generator().manual_seed(1)
    for r in range(rows):
        blocks.grow(f"s{r}", context + 1)
    fill = _slots(blocks, rows, 0, context + 1, sink)
    n = rows * (context + 1)
    for layer in range(shape.layers):
        keys = torch.randn(1, shape.kv_heads, n, shape.head_dim, generator=gen) * 2
        values = torch.randn(1, shape.kv_heads, n, shape.head_dim, generator=gen)
        pool.write(layer, keys, values, fill)
    return pool, blocks, _slots(blocks, rows, context, 1, sink)


def _slots(blocks: BlockManager, rows: int, start: int, new: int, sink: int) -> StepSlots:
    lists: list[list[int]] = [[] for _ in range(8)]
    new_slots, sink_tokens, sink_new, reads, sink_pos, sink_entries, new_positions, read_positions = lists
    for r in range(rows):
        seq, end = f"s{r}", start + new
        base = blocks.sinks.get(seq, 0) * sink
        sink_tokens += [len(new_slots) + p - start for p in range(start, min(end, sink))]
        sink_new += [base + p for p in range(start, min(end, sink))]
        kept = min(end, sink)
        sink_pos += range(len(reads), len(reads) + kept)
        sink_entries += range(base, base + kept)
        new_slots += blocks.slots(seq, start, end)
        reads += blocks.slots(seq, 0, end)
        new_positions += range(start, end)
        read_positions += range(end)
    return StepSlots(*(torch.tensor(v, dtype=torch.long) for v in lists))


def _median_ms(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(repeats):
        for name, fn in fns.items():
            start = CLOCK[0]()
            fn()
            times[name].append((CLOCK[0]() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


class _Module(torch.nn.Module):
    def __init__(self, scaling: float):
        super().__init__()
        self.scaling = scaling
        self.layer_idx = 0
        self.is_causal = True
        self.num_key_value_groups = 1
        self.training = False


def layer_bench(
    spec: KVSpec, hq: int, shape: AttentionShape, rows: int, context: int, repeats: int
) -> dict[str, float]:
    """(1): one layer's attention, ms."""
    kernels = attention_kernels()
    if kernels is None:
        raise SystemExit("the native attention kernel did not build")
    one = AttentionShape(1, shape.kv_heads, shape.head_dim)
    spec1 = KVSpec(spec.bits, spec.sink_tokens, spec.names[:1], spec.layers[:1], spec.kind)
    query = torch.randn(rows, hq, shape.head_dim)
    length = context + 1
    module = _Module(shape.head_dim**-0.5)
    module.num_key_value_groups = hq // shape.kv_heads
    spans = tuple(RowSpan(r, r + 1, r * length, (r + 1) * length, None) for r in range(rows))
    fns: dict[str, Callable[[], object]] = {}
    for label, layer_spec in (("int4", spec1), ("fp32", None)):
        pool, _, slots = _filled_pool(layer_spec, one, rows, context)
        sink_of = None
        if pool.sink_tokens:
            sink_of = torch.full((slots.read_slots.numel(),), -1, dtype=torch.long)
            sink_of[slots.sink_positions] = slots.sink_entries
        ragged = RaggedRows(
            torch.arange(rows + 1), torch.arange(rows + 1) * length, slots.read_slots.contiguous(), sink_of
        )
        stores = pool.kernel_stores(0, length)
        assert stores is not None

        def native(stores: Any = stores, ragged: RaggedRows = ragged) -> object:
            return attend(kernels, query, shape.kv_heads, ragged, *stores, module.scaling)

        def today(pool: PagedKVPool = pool, slots: StepSlots = slots) -> object:
            k = pool._keys[0].read(slots, torch.float32)
            v = pool._values[0].read(slots, torch.float32)
            return paged_attention(
                module, query.transpose(0, 1)[None], k, v, None, squeeze_step=spans, scaling=module.scaling
            )

        fns[f"native {label}"] = native
        fns[f"today {label} (dequantize + SDPA per row)"] = today
    return _median_ms(fns, repeats)


def step_bench(artifact: Path, spec: KVSpec, rows: int, context: int, repeats: int) -> dict[str, Any]:
    """(2): a whole decode step of the model, ms, and attention's share."""
    from transformers import AttentionInterface

    from squeeze import api
    from squeeze.quant.kv_bytes import kv_geometry
    from squeeze.serve.engine import runner as runner_module
    from squeeze.serve.engine.runner import ATTENTION, ModelRunner, PagedStepCache
    from squeeze.serve.engine.scheduler import ScheduledChunk
    from squeeze.serve.engine.sequence import Sequence
    from squeeze.serve.types import SamplingParams

    loaded = api.load(artifact)
    model = loaded.model
    layers, kv_heads, d = kv_geometry(model.config)
    shape = AttentionShape(layers, kv_heads, d)
    results: dict[str, Any] = {}
    spent = {"attention": 0.0, "cache": 0.0}

    def timed_attention(*args: Any, **kwargs: Any) -> Any:
        start = CLOCK[0]()
        out = paged_attention(*args, **kwargs)
        spent["attention"] += CLOCK[0]() - start
        return out

    original_update = PagedStepCache.update

    def timed_update(self: PagedStepCache, *args: Any, **kwargs: Any) -> Any:
        start = CLOCK[0]()
        out = original_update(self, *args, **kwargs)
        spent["cache"] += CLOCK[0]() - start
        return out

    PagedStepCache.update = timed_update  # type: ignore[method-assign]
    variants = (("int4 KV, native attention", spec, "1"), ("int4 KV, today's path", spec, "0"))
    variants += (("16-bit KV (SDPA per row)", None, "1"),)
    for label, spec, native in variants:
        os.environ["SQUEEZE_NATIVE_ATTENTION"] = native
        pool, blocks, _ = _filled_pool(spec, shape, rows, context)
        runner = ModelRunner(model, pool, blocks)
        AttentionInterface.register(ATTENTION, timed_attention)
        plan = []
        for r in range(rows):
            seq = Sequence(f"s{r}", list(range(1, context + 1)), SamplingParams(max_tokens=2), r, output_ids=[7])
            seq.computed = context
            plan.append(ScheduledChunk(seq, 1))
        times, shares, with_cache = [], [], []
        with torch.inference_mode():
            runner.run(plan)  # warm-up
            for _ in range(repeats):
                spent["attention"] = spent["cache"] = 0.0
                start = CLOCK[0]()
                runner.run(plan)
                elapsed = CLOCK[0]() - start
                times.append(elapsed * 1e3)
                shares.append(spent["attention"] / elapsed)
                with_cache.append((spent["attention"] + spent["cache"]) / elapsed)
        runner.close()
        results[label] = {
            "step_ms": statistics.median(times),
            "attention_share": statistics.median(shares),
            "attention_and_cache_share": statistics.median(with_cache),
        }
    PagedStepCache.update = original_update  # type: ignore[method-assign]
    os.environ.pop("SQUEEZE_NATIVE_ATTENTION", None)
    del runner_module
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", type=Path)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--cpu-time", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cpu_time:
        if torch.get_num_threads() != 1:
            parser.error("--cpu-time times the calling thread: pass --threads 1")
        CLOCK[0] = time.thread_time
    kernels = attention_kernels()
    header = {
        "cpu": _cpu_model(),
        "threads": torch.get_num_threads(),
        "isa": kernels.isa if kernels else None,
        "revision": revision(),
        "command": command_line(),
        "rows": args.rows,
        "context": args.context,
        "clock": "thread CPU time" if args.cpu_time else "wall",
    }
    print(json.dumps(header))
    spec, hq, shape = _synthetic_spec(30, 3, 64), 9, AttentionShape(30, 3, 64)
    if args.artifact is not None:
        from squeeze import api
        from squeeze.quant.kv_bytes import kv_geometry

        loaded = api.load(args.artifact)
        layers, kv_heads, d = kv_geometry(loaded.model.config)
        shape, hq = AttentionShape(layers, kv_heads, d), int(loaded.model.config.num_attention_heads)
        spec = _synthetic_spec(layers, kv_heads, d)
        if loaded.kv_spec is not None and loaded.kv_spec.kind == "int" and loaded.kv_spec.bits == 4:
            spec = loaded.kv_spec
        header["kv_spec"] = "the artifact's calibrated int4" if spec is loaded.kv_spec else "calibrated-like int4"
        print(json.dumps({"kv_spec": header["kv_spec"]}))
    layer = layer_bench(spec, hq, shape, args.rows, args.context, args.repeats)
    print("one layer's attention, ms (median):")
    for name, ms in layer.items():
        print(f"  {name:48s} {ms:8.3f}")
    out: dict[str, Any] = {**header, "layer_ms": layer}
    if args.artifact is not None:
        step = step_bench(args.artifact, spec, args.rows, args.context, args.repeats)
        print("decode step, ms (median) and attention's share:")
        for name, row in step.items():
            print(
                f"  {name:32s} {row['step_ms']:8.1f} ms  attention {row['attention_share']:.1%}"
                f"  (with KV writes/reads {row['attention_and_cache_share']:.1%})"
            )
        out["step"] = step
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
