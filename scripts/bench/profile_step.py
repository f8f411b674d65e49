"""Per-op profile of one serving decode step (squeeze.serve.engine.runner.ModelRunner) and the time outside the kernels.

    .venv/bin/python scripts/bench/profile_step.py --artifact DIR [--rows 1,16] [--context 256] [--repeats 20]
        [--kv-dynamic 4] [--threads N] [--cpu-time] [--top 25]

For each row count: a paged pool holding ``--rows`` sequences of ``--context`` tokens (random keys / values,
the artifact's calibrated KV spec, or ``--kv-dynamic BITS``'s uncalibrated per-token one, or ``--kv-bits 16``),
then one decode step of all rows (each feeding one token), repeated. Printed:

- the step's wall time, and the time spent inside the kernels (every ``sq_*`` function of the LUT / int8 /
  dense library and of the attention library, timed around each ctypes call, and torch's ``F.linear`` for
  linears no native kernel covers), and the difference:
  **the time outside the kernels** (Python, transformers' module tree, torch ops between the kernels);
- torch.profiler's table of one step's ops (self CPU time; kernel calls appear as ``kernel::sq_*``, ``kernel::linear``).

The machine is shared and noisy: every number is the MINIMUM over ``--repeats`` steps (the least-disturbed
one), not a mean; compare ratios taken in one run, not absolute times across runs. ``--cpu-time`` (with
``--threads 1``) reads the calling thread's CPU time instead of the wall clock, which other processes inflate
far less. ``SQUEEZE_FAST_PATH=0`` gives transformers' forward (the "before" of issue 45 item 2).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from bench_attention import _filled_pool  # scripts/bench/ is on sys.path when a script runs
from bench_common import command_line, revision

from squeeze.quant.kv_spec import KVSpec

#: time spent inside native calls since the last reset, seconds
SPENT = [0.0]
#: what the timings read: the wall clock, or the calling thread's CPU time (--cpu-time)
CLOCK: list[Callable[[], float]] = [time.perf_counter]


def _wrap_library(lib: Any, names: list[str]) -> None:
    """Time every ``sq_*`` function of a loaded ctypes library (and name it for torch.profiler)."""
    for name in names:
        try:
            original = getattr(lib, name)
        except AttributeError:
            continue
        if getattr(original, "_profiled", False):
            continue

        def timed(*args: Any, _original: Callable[..., Any] = original, _name: str = name) -> Any:
            with torch.profiler.record_function(f"kernel::{_name}"):
                start = CLOCK[0]()
                out = _original(*args)
                SPENT[0] += CLOCK[0]() - start
            return out

        timed._profiled = True  # type: ignore[attr-defined]
        setattr(lib, name, timed)


def instrument() -> None:
    """Wrap the native libraries' entry points (LUT / int8 / dense linears, attention, KV write), and torch's
    ``F.linear`` (the GEMM of linears no native kernel covers, e.g. an RTN artifact's dense path)."""
    functional: Any = torch.nn.functional
    if not getattr(functional.linear, "_profiled", False):
        _wrap_library(functional, ["linear"])
    from squeeze.runtime.kernels.cpu_attention import attention_kernels
    from squeeze.runtime.kernels.cpu_build import cpu_kernels

    for kernels in (cpu_kernels(), attention_kernels()):
        if kernels is None:
            continue
        names = sorted({line.split()[0] for line in _exported(kernels.path)})
        _wrap_library(kernels.lib, [n for n in names if n.startswith("sq_") and n != "sq_isa_supported"])


def _exported(path: Path) -> list[str]:
    """The library's exported ``sq_*`` symbols (nm -D), one per line."""
    import subprocess

    out = subprocess.run(["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True, check=False)
    return [line.split()[-1] for line in out.stdout.splitlines() if line.split() and line.split()[-1].startswith("sq_")]


def decode_plan(rows: int, context: int) -> list[Any]:
    """One decode step of ``rows`` sequences, each at position ``context``."""
    from squeeze.serve.engine.scheduler import ScheduledChunk
    from squeeze.serve.engine.sequence import Sequence
    from squeeze.serve.types import SamplingParams

    plan = []
    for r in range(rows):
        seq = Sequence(f"s{r}", list(range(1, context + 1)), SamplingParams(max_tokens=2), r, output_ids=[7])
        seq.computed = context
        plan.append(ScheduledChunk(seq, 1))
    return plan


def profile_rows(model: Any, spec: KVSpec | None, rows: int, context: int, repeats: int, top: int) -> dict[str, Any]:
    """Min step time, min time in native kernels, min time outside them (ms), and the profiler's table."""
    from squeeze.quant.kv_bytes import kv_geometry
    from squeeze.serve.engine.kv_pool import AttentionShape
    from squeeze.serve.engine.runner import ModelRunner

    layers, kv_heads, d = kv_geometry(model.config)
    pool, blocks, _ = _filled_pool(spec, AttentionShape(layers, kv_heads, d), rows, context)
    runner = ModelRunner(model, pool, blocks)
    plan = decode_plan(rows, context)
    steps, inside, outside = [], [], []
    try:
        with torch.inference_mode():
            for _ in range(3):
                runner.run(plan)  # warm-up (kernel builds, first-call allocations)
            for _ in range(repeats):
                SPENT[0] = 0.0
                start = CLOCK[0]()
                runner.run(plan)
                elapsed = CLOCK[0]() - start
                steps.append(elapsed * 1e3)
                inside.append(SPENT[0] * 1e3)
                outside.append((elapsed - SPENT[0]) * 1e3)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for _ in range(5):
                    runner.run(plan)
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=48)
    finally:
        runner.close()
    return {
        "rows": rows,
        "step_ms_min": min(steps),
        "kernels_ms_min": min(inside),
        "outside_kernels_ms_min": min(outside),
        "native_attention": runner._kernels is not None,
        "table (5 steps)": table,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", type=Path, required=True)
    parser.add_argument("--rows", default="1,16")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--kv-dynamic", type=int, choices=(4, 8), help="uncalibrated per-token int KV of this width")
    parser.add_argument("--kv-bits", type=int, choices=(4, 8, 16), help="16: the full-precision pool")
    parser.add_argument("--threads", type=int)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--cpu-time", action="store_true", help="time the thread's CPU time (needs --threads 1)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cpu_time:
        if torch.get_num_threads() != 1:
            parser.error("--cpu-time times the calling thread: pass --threads 1")
        CLOCK[0] = time.thread_time
    from squeeze import api
    from squeeze.models.targets import attention_modules

    loaded = api.load(args.artifact)
    model = loaded.model
    spec: KVSpec | None = loaded.kv_spec
    if args.kv_dynamic:
        spec = KVSpec.dynamic(args.kv_dynamic, attention_modules(model), 4)
    if args.kv_bits == 16:
        spec = None
    instrument()
    header = {
        "revision": revision(),
        "command": command_line(),
        "threads": torch.get_num_threads(),
        "kv": spec.label if spec is not None else "full precision",
        "context": args.context,
        "native_attention_env": os.environ.get("SQUEEZE_NATIVE_ATTENTION", "1"),
        "statistic": f"min over {args.repeats} steps (shared machine)",
        "clock": "thread CPU time" if args.cpu_time else "wall",
    }
    print(json.dumps(header))
    for rows in (int(r) for r in args.rows.split(",")):
        result = profile_rows(model, spec, rows, args.context, args.repeats, args.top)
        table = result.pop("table (5 steps)")
        print(json.dumps(result))
        print(f"--- torch.profiler, {rows} row(s), 5 steps, sorted by self CPU time ---")
        print(table)


if __name__ == "__main__":
    main()
