"""Runtime benchmark on SmolLM2-135M: cold start and CPU decode speed of an artifact vs the original, one run.

    .venv/bin/python scripts/bench_runtime.py [--model smollm2-135m] [--artifact DIR] [--new-tokens 64]
        [--repeats 3] [--cold-repeats 2] [--low-memory-repeats 1] [--out bench-out/runtime.json]
        [--ppl-text FILE] [--ppl-seq-len 256] [--ppl-windows 4] [--skip-decode]

Set-up (once, reused when the directories exist): the artifact is compressed with
``squeeze compress MODEL --recipe w4 --sensitivity uniform`` (no Fisher, ~2 min), and the original model
(dequantized from its GGUF by transformers) is saved as an fp32 safetensors checkpoint, so that its load is
a plain ``from_pretrained`` of the same kind of files.

(a) Cold start, page cache warm (every file read once, untimed, before timing):
    - in a fresh process (imports included): ``squeeze.load`` (verification included) vs ``from_pretrained``
      (+ tokenizer) of the original;
    - in this process (imports warm): the same two, ``squeeze.load(verify=False)``, ``squeeze.load`` plus
      a one-token forward (the dense caches are built on first use), ``from_pretrained`` of the artifact
      (after ``import squeeze``), the page-cache read floor: reading every byte of the artifact once
      (and of the original checkpoint), and the hashing floor: SHA-256 of every artifact file, which a
      verified load cannot beat.
(b) CPU decode, greedy, the same prompt, exactly ``--new-tokens`` new tokens (EOS suppressed by
    min_new_tokens): tokens/s of the decode phase for the dense-cache artifact, the low-memory artifact and
    the original fp32 model, interleaved (A B C A B C ...) so machine noise hits all three alike; medians
    (the low-memory path, seconds per token, runs --low-memory-repeats times without a warm-up).
(c) Perplexity of the artifact through `squeeze eval`'s path, squeeze.load (dense cache and low-memory) and
    ``from_pretrained`` after ``import squeeze``, on --ppl-windows x --ppl-seq-len tokens of --ppl-text:
    all must agree within 1e-3 relative.
Prints a table of ratios and writes JSON. Goals: dense-cache decode / original >= 0.9; verified load /
page-cache read floor <= 2.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PROMPT = "Once upon a time, in a small village at the edge of a great forest, there lived"


def read_all(directory: Path) -> int:
    """Read every regular file under ``directory`` once (1 MiB reads); returns the bytes read."""
    total = 0
    buffer = bytearray(1 << 20)
    view = memoryview(buffer)
    for path in sorted(directory.rglob("*")):
        if path.is_file() and not path.is_symlink():
            with open(path, "rb", buffering=0) as handle:
                while n := handle.readinto(view):
                    total += n
    return total


def hash_all(directory: Path) -> int:
    """SHA-256 of every regular file under ``directory``, one thread per file as verification does."""
    import hashlib
    from concurrent.futures import ThreadPoolExecutor

    def one(path: Path) -> int:
        digest, buffer = hashlib.sha256(), bytearray(8 << 20)
        view = memoryview(buffer)
        with open(path, "rb", buffering=0) as handle:
            while n := handle.readinto(view):
                digest.update(view[:n])
        return path.stat().st_size

    files = [p for p in sorted(directory.rglob("*")) if p.is_file() and not p.is_symlink()]
    with ThreadPoolExecutor(max_workers=max(1, min(len(files), 8))) as pool:
        return sum(pool.map(one, files))


def timed(fn: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def median_time(fn: Any, repeats: int) -> float:
    fn()  # warm-up: page cache, lazy imports, allocator
    return statistics.median(timed(fn)[0] for _ in range(repeats))


COLD_SNIPPETS = {
    "artifact": "import squeeze; squeeze.load({path!r})",
    "original": (
        "from transformers import AutoModelForCausalLM, AutoTokenizer; import torch; "
        "AutoModelForCausalLM.from_pretrained({path!r}, dtype=torch.float32).eval(); "
        "AutoTokenizer.from_pretrained({path!r})"
    ),
}


def cold_start(kind: str, path: Path, repeats: int) -> float:
    """Median seconds, in a fresh interpreter, from before the first import to the loaded model."""
    code = (
        "import time; _t = time.perf_counter(); "
        + COLD_SNIPPETS[kind].format(path=str(path))
        + "; print(time.perf_counter() - _t)"
    )
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    times = []
    for _ in range(repeats):
        out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, env=env)
        times.append(float(out.stdout.strip().splitlines()[-1]))
    return statistics.median(times)


def prepare(args: argparse.Namespace, work: Path) -> tuple[Path, Path]:
    """The artifact and the original fp32 checkpoint, built once and reused."""
    import torch
    from transformers import AutoModelForCausalLM

    from squeeze import api
    from squeeze.models import load_model, resolve_model

    artifact = Path(args.artifact) if args.artifact else work / "artifact-w4-uniform"
    if not (artifact / "squeeze.manifest.json").is_file():
        print(f"compressing {args.model} -> {artifact} (w4, uniform sensitivity) ...", flush=True)
        seconds, _ = timed(
            lambda: api.compress(
                args.model, artifact, recipe="w4", overwrite=True, overrides={"weights.sensitivity": "uniform"}
            )
        )
        print(f"  done in {seconds:.0f} s", flush=True)
    original = work / "original-fp32"
    if not (original / "config.json").is_file():
        print(f"saving the original {args.model} as fp32 safetensors -> {original} ...", flush=True)
        model, tokenizer = load_model(resolve_model(args.model))
        # a GGUF-loaded model refuses save_pretrained ("quantized with gguf"): copy its (already dequantized)
        # fp32 weights into a plain model of the same config and save that
        config = copy.deepcopy(model.config)
        if hasattr(config, "quantization_config"):
            delattr(config, "quantization_config")
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(model.state_dict())
        plain.generation_config = model.generation_config
        plain.save_pretrained(original, safe_serialization=True)
        tokenizer.save_pretrained(original)
        del model, plain
    return artifact, original


def decode_rates(args: argparse.Namespace, artifact: Path, original: Path) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from squeeze import api
    from squeeze.runtime.generate import generate
    from squeeze.runtime.linear import SqueezeLinear

    dense = api.load(artifact)
    low = api.load(artifact, dense_cache=False)
    base = AutoModelForCausalLM.from_pretrained(original, dtype=torch.float32).eval()
    base_tok = AutoTokenizer.from_pretrained(original)
    runs = {
        "artifact dense-cache": (dense.model, dense.tokenizer),
        "artifact low-memory": (low.model, low.tokenizer),
        "original fp32": (base, base_tok),
    }
    for model, _ in runs.values():
        # exactly new_tokens steps for everyone: an early EOS would make the runs incomparable
        model.generation_config.min_new_tokens = args.new_tokens
    rates: dict[str, list[float]] = {name: [] for name in runs}
    ttfts: dict[str, list[float]] = {name: [] for name in runs}
    texts: dict[str, str] = {}
    for round_ in range(args.repeats + 1):  # round 0 is the warm-up (builds the dense caches)
        for name, (model, tokenizer) in runs.items():
            # the low-memory path has no cache to warm and takes seconds per token: fewer runs
            if name == "artifact low-memory" and not 1 <= round_ <= args.low_memory_repeats:
                continue
            result = generate(model, tokenizer, [PROMPT], max_new_tokens=args.new_tokens)
            if result.new_tokens[0] != args.new_tokens:
                raise SystemExit(f"{name}: generated {result.new_tokens[0]} tokens, wanted {args.new_tokens}")
            texts[name] = result.text
            if round_:
                rates[name].append(result.tokens_per_second or 0.0)
                ttfts[name].append(result.ttft_seconds)
            print(f"  round {round_} {name:22s} {result.tokens_per_second:8.1f} tok/s", flush=True)
    cached = sum(
        m._dense.numel() * m._dense.element_size()
        for m in dense.model.modules()
        if isinstance(m, SqueezeLinear) and m._dense is not None
    )
    packed = sum(
        b.numel() * b.element_size()
        for m in dense.model.modules()
        if isinstance(m, SqueezeLinear)
        for b in m.buffers(recurse=False)
    )
    linear = sum(
        m.weight.numel() * m.weight.element_size()
        for name, m in base.named_modules()
        if isinstance(m, torch.nn.Linear)
        and name in {n for n, s in dense.model.named_modules() if isinstance(s, SqueezeLinear)}
    )
    return {
        "tokens_per_second": {k: statistics.median(v) for k, v in rates.items()},
        "tokens_per_second_all": rates,
        "ttft_seconds": {k: statistics.median(v) for k, v in ttfts.items()},
        "greedy_text_equal_dense_vs_low_memory": texts["artifact dense-cache"] == texts["artifact low-memory"],
        "greedy_text_equal_artifact_vs_original": texts["artifact dense-cache"] == texts["original fp32"],
        "weight_bytes": {"quantized_buffers": packed, "dense_cache": cached, "original_fp32_linears": linear},
    }


def perplexity_paths(args: argparse.Namespace, artifact: Path) -> dict[str, Any]:
    """Perplexity of the artifact through `squeeze eval`'s path and every runtime path (goal: 1e-3 relative)."""
    from transformers import AutoModelForCausalLM

    from squeeze import api
    from squeeze.eval.compare import evaluate
    from squeeze.eval.perplexity import perplexity

    text = Path(args.ppl_text).read_text(encoding="utf-8")
    reference = evaluate(artifact, args.ppl_text, seq_len=args.ppl_seq_len, max_windows=args.ppl_windows).result
    dense = api.load(artifact)
    tokenizer = dense.tokenizer

    def ppl(model: Any) -> float:
        return perplexity(model, tokenizer, text, seq_len=args.ppl_seq_len, max_windows=args.ppl_windows).perplexity

    values = {"squeeze eval": reference.perplexity, "squeeze.load dense cache": ppl(dense.model)}
    del dense
    values["squeeze.load low-memory"] = ppl(api.load(artifact, dense_cache=False).model)
    values["from_pretrained (import squeeze)"] = ppl(AutoModelForCausalLM.from_pretrained(artifact))
    worst = max(abs(v - reference.perplexity) / reference.perplexity for v in values.values())
    return {
        "text": args.ppl_text,
        "seq_len": args.ppl_seq_len,
        "windows": reference.n_windows,
        "perplexity": values,
        "max_relative_difference": worst,
        "within_1e-3": worst <= 1e-3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--artifact", default=None, help="an existing artifact (default: compress one into --work)")
    parser.add_argument("--work", default="bench-out/runtime-work", help="where the artifact and fp32 copy live")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cold-repeats", type=int, default=2)
    parser.add_argument("--low-memory-repeats", type=int, default=1, help="decode runs of the low-memory path")
    parser.add_argument("--out", default="bench-out/runtime.json")
    parser.add_argument(
        "--ppl-text",
        default=str(REPO.parent / "shared" / "corpora" / "wikitext2_raw_test.txt"),
        help="text for the perplexity consistency check ('' to skip it)",
    )
    parser.add_argument("--ppl-seq-len", type=int, default=256)
    parser.add_argument("--ppl-windows", type=int, default=4)
    parser.add_argument("--skip-decode", action="store_true", help="skip (b), the decode-speed comparison")
    args = parser.parse_args()
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    artifact, original = prepare(args, work)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from squeeze import api

    hf_logging.disable_progress_bar()  # "Loading weights" bars on every from_pretrained
    # (a) cold start, page cache warm
    artifact_bytes, original_bytes = read_all(artifact), read_all(original)  # warm the page cache
    print("cold start (fresh process, page cache warm) ...", flush=True)
    cold = {
        "artifact squeeze.load": cold_start("artifact", artifact, args.cold_repeats),
        "original from_pretrained": cold_start("original", original, args.cold_repeats),
    }
    print("load (this process, imports warm) ...", flush=True)
    one_token = torch.tensor([[1]])

    def load_and_forward() -> None:  # the dense caches are built on first use: count them here
        with torch.inference_mode():
            api.load(artifact).model(one_token)

    warm = {
        "artifact squeeze.load (verified)": median_time(lambda: api.load(artifact), args.repeats),
        "artifact squeeze.load (no verify)": median_time(lambda: api.load(artifact, verify=False), args.repeats),
        "artifact squeeze.load + first forward (dense caches built)": median_time(load_and_forward, args.repeats),
        "artifact from_pretrained (import squeeze; verify, then load)": median_time(
            lambda: AutoModelForCausalLM.from_pretrained(artifact), args.repeats
        ),
        "original from_pretrained": median_time(
            lambda: (
                AutoModelForCausalLM.from_pretrained(original, dtype=torch.float32).eval(),
                AutoTokenizer.from_pretrained(original),
            ),
            args.repeats,
        ),
        "artifact read floor (page cache)": median_time(lambda: read_all(artifact), args.repeats),
        "original read floor (page cache)": median_time(lambda: read_all(original), args.repeats),
        "artifact SHA-256 floor (page cache, one thread per file)": median_time(
            lambda: hash_all(artifact), args.repeats
        ),
    }
    floor = warm["artifact read floor (page cache)"]
    ratios = {
        "cold start: artifact / original (fresh process)": cold["artifact squeeze.load"]
        / cold["original from_pretrained"],
        "load: artifact verified / original": warm["artifact squeeze.load (verified)"]
        / warm["original from_pretrained"],
        "load: artifact verified / artifact read floor (goal <= 2)": warm["artifact squeeze.load (verified)"] / floor,
        "load + first forward / artifact read floor": warm["artifact squeeze.load + first forward (dense caches built)"]
        / floor,
        "load: artifact verified / artifact SHA-256 floor": warm["artifact squeeze.load (verified)"]
        / warm["artifact SHA-256 floor (page cache, one thread per file)"],
    }

    # (b) decode
    decode: dict[str, Any] = {}
    if not args.skip_decode:
        print(f"decode: {args.new_tokens} new tokens, greedy, {torch.get_num_threads()} threads ...", flush=True)
        decode = decode_rates(args, artifact, original)
        tps = decode["tokens_per_second"]
        ratios["decode: dense-cache / original (goal >= 0.9)"] = tps["artifact dense-cache"] / tps["original fp32"]
        ratios["decode: low-memory / original"] = tps["artifact low-memory"] / tps["original fp32"]

    # (c) perplexity: every runtime path against `squeeze eval`'s
    consistency: dict[str, Any] = {}
    if args.ppl_text:
        print(f"perplexity consistency ({args.ppl_windows} x {args.ppl_seq_len} tokens) ...", flush=True)
        consistency = perplexity_paths(args, artifact)

    print(
        f"\nartifact {artifact}: {artifact_bytes / 1e6:.1f} MB; original fp32 {original}: {original_bytes / 1e6:.1f} MB"
    )
    print(f"{'seconds':>10s}  what")
    for name, seconds in {**{f"cold {k}": v for k, v in cold.items()}, **warm}.items():
        print(f"{seconds:10.3f}  {name}")
    if decode:
        print(
            f"\n{'tok/s':>10s}  {'ttft s':>8s}  decode ({args.new_tokens} tokens, median of {args.repeats}; "
            f"low-memory: {args.low_memory_repeats})"
        )
        for name, rate in decode["tokens_per_second"].items():
            print(f"{rate:10.1f}  {decode['ttft_seconds'][name]:8.3f}  {name}")
    if consistency:
        print(
            f"\n{'perplexity':>10s}  path ({consistency['windows']} x {consistency['seq_len']} tokens of "
            f"{Path(consistency['text']).name})"
        )
        for name, value in consistency["perplexity"].items():
            print(f"{value:10.4f}  {name}")
        print(
            f"max relative difference to squeeze eval: {consistency['max_relative_difference']:.2e} "
            f"({'within' if consistency['within_1e-3'] else 'NOT within'} 1e-3)"
        )
    print(f"\n{'ratio':>10s}  what")
    for name, ratio in ratios.items():
        print(f"{ratio:10.3f}  {name}")

    report = {
        "model": args.model,
        "artifact": str(artifact),
        "artifact_bytes": artifact_bytes,
        "original_fp32_bytes": original_bytes,
        "new_tokens": args.new_tokens,
        "prompt": PROMPT,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cold_start_seconds": cold,
        "load_seconds": warm,
        "decode": decode,
        "perplexity_consistency": consistency,
        "ratios": ratios,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
