"""End-to-end CPU runtime benchmark: SmolLM2-135M artifacts (native LUT kernels) vs the original in fp32, one run.

    .venv/bin/python scripts/bench/bench_runtime.py [--artifact DIR ...] [--model smollm2-135m] [--quick]
        [--new-tokens 64] [--repeats 3] [--batches 1,4,8,16] [--prefill-tokens 512] [--json OUT]
        [--ppl-text FILE] [--ppl-seq-len 256] [--ppl-windows 4] [--threads N] [--skip-memory] [--cold-start]

Default artifacts: artifacts/smollm2-135m-w4 and artifacts/smollm2-135m-w3-s045 (``--artifact`` repeatable).
The original model (``--model``, default the built-in smollm2-135m: a GGUF dequantized by transformers) is
saved once as an fp32 safetensors checkpoint under ``--work`` and loaded with ``from_pretrained`` from then on.

Every model runs in this process with the same torch thread count; every comparison is interleaved
(A B C A B C ...) so machine noise hits all sides alike, and reported as a ratio of medians.

(a) Decode: greedy, exactly ``--new-tokens`` new tokens (no end-of-sequence stop), batch 1, 4, 8 and 16
    (four different prompts, cycled and left-padded as squeeze's runtime pads them), through squeeze's own
    loop (squeeze.runtime.decode: prefill, then decode_step per token) for every model. The prefill forward
    is timed separately and excluded: tokens/s = (new_tokens - 1) * batch / the decode steps' seconds.
    Models: each artifact through ``squeeze.load`` (native kernels, the default) and
    ``squeeze.load(dense_cache=True)``, and the original fp32 model.
(b) Prefill: one forward of ``--prefill-tokens`` tokens of --ppl-text (batch 1), same models.
(c) Resident memory, each in a FRESH process (RSS is not reliably given back): RSS after load + 8 generated
    tokens minus RSS before the load (imports done, kernels built), for the native path, the dense path and
    the original; divided by the artifact's bytes on disk. Plus the weight bytes each path holds.
(d) Perplexity of the native and the dense path (and the original) on --ppl-windows x --ppl-seq-len tokens.
(e) With --cold-start: fresh-process start and in-process load times of the first artifact vs the original.
Goals (issue 13): decode >= 2x the fp32 original at batch 1 (moonshot 3x); resident <= 1.3x the artifact's
bytes; prefill-512 >= 0.7x the original; native and dense perplexity equal to ~1e-4 relative.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench_common import command_line, revision  # scripts/bench/ is on sys.path when a script runs

REPO = Path(__file__).resolve().parents[2]
DEFAULT_ARTIFACTS = [REPO / "artifacts" / "smollm2-135m-w4", REPO / "artifacts" / "smollm2-135m-w3-s045"]
PROMPTS = [
    "Once upon a time, in a small village at the edge of a great forest, there lived",
    "The capital of France is",
    "Here is a short recipe for a simple tomato soup. First,",
    "In 1905, a young patent clerk published four papers that",
]
RSS_TOKENS = 64  # issue 45 item 6 measures after 64 tokens
ORIGINAL = "original fp32"


# -- run description ---------------------------------------------------------------------------------------


def loadavg() -> str:
    path = Path("/proc/loadavg")
    return " ".join(path.read_text().split()[:3]) if path.exists() else "n/a"


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return platform.processor()
    return next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "?")


def disk_bytes(directory: Path) -> int:
    """Bytes of the regular files under ``directory``, outside hidden folders (a compression's work area)."""
    return sum(
        p.stat().st_size
        for p in directory.rglob("*")
        if p.is_file()
        and not p.is_symlink()
        and not any(part.startswith(".") for part in p.relative_to(directory).parts)
    )


def label(artifact: Path) -> str:
    return artifact.name


# -- the original model, saved once as fp32 safetensors ---------------------------------------------------


def prepare_original(model_spec: str, work: Path) -> Path:
    """The original model as a plain fp32 safetensors checkpoint (built once, reused)."""
    import torch
    from transformers import AutoModelForCausalLM

    from squeeze.models import load_model, resolve_model

    original = work / f"original-{Path(model_spec).name}-fp32"
    if (original / "config.json").is_file():
        return original
    print(f"saving the original {model_spec} as fp32 safetensors -> {original} ...", flush=True)
    model, tokenizer = load_model(resolve_model(model_spec))
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
    return original


def load_models(artifacts: list[Path], original: Path) -> dict[str, tuple[Any, Any]]:
    """name -> (model, tokenizer): each artifact native and dense, then the original fp32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from squeeze import api

    models: dict[str, tuple[Any, Any]] = {}
    for artifact in artifacts:
        native = api.load(artifact)
        dense = api.load(artifact, dense_cache=True)
        models[f"{label(artifact)} native"] = (native.model, native.tokenizer)
        models[f"{label(artifact)} dense"] = (dense.model, dense.tokenizer)
    base = AutoModelForCausalLM.from_pretrained(original, dtype=torch.float32).eval()
    models[ORIGINAL] = (base, AutoTokenizer.from_pretrained(original))
    return models


def weight_paths(model: Any) -> dict[str, int]:
    """How many SqueezeLinear modules take each path (native-avx512, dense, ...)."""
    from squeeze.runtime.linear import SqueezeLinear

    paths: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, SqueezeLinear):
            paths[m.weight_path] = paths.get(m.weight_path, 0) + 1
    return paths


# -- inputs ------------------------------------------------------------------------------------------------


def batch_inputs(tokenizer: Any, batch: int) -> tuple[Any, Any]:
    """(input_ids, attention_mask) (batch, T) int64 of PROMPTS cycled, left-padded as squeeze's runtime pads."""
    texts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
    saved = (tokenizer.padding_side, tokenizer.pad_token)
    try:
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token  # masked out; generate() pads with eos the same way
        tokenizer.padding_side = "left"
        encoded = tokenizer(texts, return_tensors="pt", padding=True)
    finally:
        tokenizer.padding_side, tokenizer.pad_token = saved
    return encoded["input_ids"], encoded["attention_mask"]


def same_inputs(models: dict[str, tuple[Any, Any]], batch: int) -> tuple[Any, Any]:
    """The batch as every model's tokenizer encodes it (SystemExit when they disagree: not the same prompt)."""
    import torch

    encoded = {name: batch_inputs(tok, batch) for name, (_, tok) in models.items()}
    first_name, (ids, mask) = next(iter(encoded.items()))
    for name, (other_ids, other_mask) in encoded.items():
        if not (torch.equal(ids, other_ids) and torch.equal(mask, other_mask)):
            raise SystemExit(f"the tokenizers of {first_name!r} and {name!r} encode the prompts differently")
    return ids, mask


# -- timed runs --------------------------------------------------------------------------------------------


def timed_decode(model: Any, input_ids: Any, mask: Any, new_tokens: int) -> tuple[float, list[float], Any]:
    """Greedy decode through squeeze's loop: (prefill seconds, seconds of each decode step, new tokens (B, n)).

    Exactly ``new_tokens`` tokens per row (no end-of-sequence stop). A decode step = one forward of the
    chosen tokens + choosing the next ones, as squeeze.runtime.decode.decode runs it.
    """
    import torch
    from transformers import DynamicCache

    from squeeze.runtime.decode import DecodeOptions, choose_tokens, decode_step, prefill
    from squeeze.runtime.sampling_params import SamplingParams

    options = DecodeOptions(SamplingParams(max_tokens=new_tokens))  # greedy, no eos ids: no row finishes early
    processors = options.processors()
    steps: list[float] = []
    with torch.inference_mode():
        start = time.perf_counter()
        state = prefill(model, input_ids, mask, DynamicCache(config=model.config))
        prefill_s = time.perf_counter() - start
        chosen = choose_tokens(state, options, processors)
        for _ in range(new_tokens - 1):
            t0 = time.perf_counter()
            decode_step(model, state, chosen)
            chosen = choose_tokens(state, options, processors)
            steps.append(time.perf_counter() - t0)
    return prefill_s, steps, state.tokens[:, input_ids.shape[1] :]


def decode_section(args: argparse.Namespace, models: dict[str, tuple[Any, Any]]) -> dict[str, Any]:
    """(a): decode tokens/s per model and batch, interleaved; round 0 is the warm-up (dense caches built)."""
    rates: dict[int, dict[str, list[float]]] = {b: {name: [] for name in models} for b in args.batches}
    prefills: dict[int, dict[str, list[float]]] = {b: {name: [] for name in models} for b in args.batches}
    tokens: dict[int, dict[str, list[list[int]]]] = {b: {} for b in args.batches}
    inputs = {b: same_inputs(models, b) for b in args.batches}
    for round_ in range(args.repeats + 1):
        for batch in args.batches:
            ids, mask = inputs[batch]
            for name, (model, _) in models.items():
                prefill_s, steps, new = timed_decode(model, ids, mask, args.new_tokens)
                rate = (args.new_tokens - 1) * batch / sum(steps)
                tokens[batch][name] = new.tolist()
                if round_:
                    rates[batch][name].append(rate)
                    prefills[batch][name].append(prefill_s)
                print(
                    f"  round {round_} batch {batch:2d} {name:32s} {rate:8.1f} tok/s  prefill {prefill_s * 1e3:7.1f} ms"
                    f"  load {loadavg()}",
                    flush=True,
                )
    out: dict[str, Any] = {"tokens_per_second": {}, "tokens_per_second_all": {}, "prefill_seconds": {}}
    for batch in args.batches:
        out["tokens_per_second"][batch] = {n: statistics.median(v) for n, v in rates[batch].items()}
        out["tokens_per_second_all"][batch] = rates[batch]
        out["prefill_seconds"][batch] = {n: statistics.median(v) for n, v in prefills[batch].items()}
    # greedy tokens: the native and the dense path of one artifact should agree (same math, other summation order)
    out["greedy_equal_native_vs_dense"] = {
        str(batch): {
            a: tokens[batch][f"{a} native"] == tokens[batch][f"{a} dense"] for a in map(label, args.artifact_paths)
        }
        for batch in args.batches
    }
    return out


def prefill_section(args: argparse.Namespace, models: dict[str, tuple[Any, Any]], ids: Any) -> dict[str, Any]:
    """(b): seconds of one prefill forward of ``ids`` (1, T) per model, interleaved, after a warm-up."""
    import torch
    from transformers import DynamicCache

    from squeeze.runtime.decode import prefill

    mask = torch.ones_like(ids)
    times: dict[str, list[float]] = {name: [] for name in models}
    for round_ in range(args.repeats + 1):
        for name, (model, _) in models.items():
            with torch.inference_mode():
                start = time.perf_counter()
                prefill(model, ids, mask, DynamicCache(config=model.config))
                seconds = time.perf_counter() - start
            if round_:
                times[name].append(seconds)
            print(f"  round {round_} prefill {ids.shape[1]} {name:32s} {seconds * 1e3:8.1f} ms", flush=True)
    return {"tokens": int(ids.shape[1]), "seconds": {n: statistics.median(v) for n, v in times.items()}, "all": times}


# -- memory ------------------------------------------------------------------------------------------------


def proc_status() -> dict[str, int]:
    """VmRSS, RssAnon, RssFile, RssShmem and VmHWM of this process, in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in {"VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"}:
            out[key] = int(value.split()[0]) * 1024
    return out


def rss_child(kind: str, path: str) -> None:
    """Run in a fresh process: load (``native``, ``dense`` artifact, or the ``original``), generate RSS_TOKENS
    greedy tokens, print JSON with /proc/self/status before the load and after."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from squeeze import api
    from squeeze.runtime.generate import generate
    from squeeze.runtime.kernels.cpu_build import cpu_kernels

    # what a user's process has before its first squeeze.generate(artifact): squeeze imported, nothing else.
    # The growth from here is what the user sees (issue 45 item 6: 2.39x the w4 artifact), the growth from
    # "before" below what the model itself takes (1.35x): the difference is the set-up just below, above all
    # transformers' model code, whose masking_utils imports torch._dynamo (148 MB resident without triton,
    # 219 MB with it, measured 2026-12-07), a cost of any transformers model in the process, compressed or not.
    imported = proc_status()
    # what any model of this architecture costs before its weights: the kernels' library, transformers' model
    # code (importing it maps ~200 MB), torch's thread pool; none of it is the model's own memory
    cpu_kernels()
    config = AutoConfig.from_pretrained(path)
    MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]  # imports the architecture's module
    warm = torch.randn(256, 256)
    torch.nn.functional.linear(warm, warm).sum()
    before = proc_status()
    if kind == "original":
        model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        tokenizer: Any = AutoTokenizer.from_pretrained(path)
    else:
        loaded = api.load(path, dense_cache=kind == "dense")
        model, tokenizer = loaded.model, loaded.tokenizer
    loaded_status = proc_status()
    model.generation_config.min_new_tokens = RSS_TOKENS
    result = generate(model, tokenizer, [PROMPTS[0]], max_new_tokens=RSS_TOKENS)
    after = proc_status()
    report = {
        "imported": imported,
        "before": before,
        "after_load": loaded_status,
        "after": after,
        "new_tokens": result.new_tokens[0],
        "paths": weight_paths(model),
        "tensor_bytes": tensor_bytes(model),
    }
    print(json.dumps(report))


def tensor_bytes(model: Any) -> int:
    """Bytes of the distinct storages behind the model's parameters and buffers, plus what the runtime holds
    beside them: the kernels' own copies (a float32 LUT where one is made, the sparse part's kernel form) and
    the dense path's fp32 caches."""
    from squeeze.runtime.linear import SqueezeLinear

    storages = {}
    for t in [*model.parameters(), *model.buffers()]:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()  # artifact tensors are views of one shard buffer
    extra = 0
    for m in model.modules():
        if isinstance(m, SqueezeLinear):
            extra += m._cpu.extra_bytes if m._cpu is not None else 0
            extra += m._dense.numel() * m._dense.element_size() if m._dense is not None else 0
    return sum(storages.values()) + extra


def fresh_rss(kind: str, path: Path) -> dict[str, Any]:
    """rss_child in a fresh interpreter with this process's thread count; its JSON."""
    import torch

    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--rss-child", kind, str(path)]
    cmd += ["--threads", str(torch.get_num_threads())]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    data: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    data["delta"] = {k: data["after"][k] - data["before"][k] for k in data["after"] if k != "VmHWM"}
    data["delta"]["peak"] = data["after"]["VmHWM"] - data["before"]["VmRSS"]  # peak during load + generate
    # what the user's process grows by from `import squeeze` (transformers' model code and the kernels included)
    data["delta_user"] = {k: data["after"][k] - data["imported"][k] for k in data["after"] if k != "VmHWM"}
    return data


def memory_section(artifacts: list[Path], original: Path) -> dict[str, Any]:
    """(c): resident bytes of each path in a fresh process, over the artifact's bytes on disk."""
    out: dict[str, Any] = {}
    for artifact in artifacts:
        size = disk_bytes(artifact)
        for kind in ("native", "dense"):
            data = fresh_rss(kind, artifact)
            data["artifact_bytes"] = size
            data["ratio_to_artifact"] = data["delta"]["VmRSS"] / size
            out[f"{label(artifact)} {kind}"] = data
            print(f"  {label(artifact)} {kind}: +{data['delta']['VmRSS'] / 1e6:.1f} MB RSS", flush=True)
    data = fresh_rss("original", original)
    data["artifact_bytes"] = None
    data["original_bytes"] = disk_bytes(original)
    data["ratio_to_artifact"] = {label(a): data["delta"]["VmRSS"] / disk_bytes(a) for a in artifacts}
    out[ORIGINAL] = data
    print(f"  {ORIGINAL}: +{data['delta']['VmRSS'] / 1e6:.1f} MB RSS", flush=True)
    return out


def weight_bytes(native: Any, dense: Any) -> dict[str, int]:
    """What the weights of one artifact occupy: quantized buffers, the kernels' own copies (the sparse part's
    kernel form; a float32 LUT only for LUT dtypes not read in place), the dense fp32 cache the dense path
    built, embeddings / LM head, everything else."""
    from squeeze.runtime.linear import SqueezeLinear

    def nbytes(t: Any) -> int:
        return int(t.numel() * t.element_size())

    squeeze_linears = [m for m in native.modules() if isinstance(m, SqueezeLinear)]
    quantized = sum(nbytes(b) for m in squeeze_linears for b in m.buffers(recurse=False))
    kernel_extra = sum(m._cpu.extra_bytes for m in squeeze_linears if m._cpu is not None)
    dense_cache = sum(
        nbytes(m._dense) for m in dense.modules() if isinstance(m, SqueezeLinear) and m._dense is not None
    )
    dense_would_be = sum(4 * m.in_features * m.out_features for m in squeeze_linears)
    embed = native.get_input_embeddings().weight
    head = native.get_output_embeddings()
    head_w = head.weight if head is not None and not isinstance(head, SqueezeLinear) else None
    tied = head_w is not None and head_w.data_ptr() == embed.data_ptr()
    counted = {id(b) for m in squeeze_linears for b in m.buffers(recurse=False)} | {id(embed)}
    if head_w is not None:
        counted.add(id(head_w))
    seen: set[int] = set()
    other = 0
    for t in [*native.parameters(), *native.buffers()]:
        if id(t) not in counted and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            other += nbytes(t)
    return {
        "quantized_buffers": quantized,
        "kernel_extra": kernel_extra,
        "dense_fp32_cache_built": dense_cache,
        "dense_fp32_cache_would_hold": dense_would_be,
        "embeddings": nbytes(embed),
        "lm_head": 0 if tied or head_w is None else nbytes(head_w),
        "lm_head_tied_to_embeddings": int(tied),
        "lm_head_quantized": int(isinstance(head, SqueezeLinear)),
        "other_params_and_buffers": other,
        "embedding_dtype_bits": embed.element_size() * 8,
    }


# -- perplexity --------------------------------------------------------------------------------------------


def perplexity_section(args: argparse.Namespace, models: dict[str, tuple[Any, Any]]) -> dict[str, Any]:
    """(d): perplexity of every model on the same windows; native vs dense relative difference per artifact."""
    from squeeze.eval.perplexity import perplexity

    text = Path(args.ppl_text).read_text(encoding="utf-8")
    values = {}
    for name, (model, tokenizer) in models.items():
        values[name] = perplexity(
            model, tokenizer, text, seq_len=args.ppl_seq_len, max_windows=args.ppl_windows
        ).perplexity
        print(f"  perplexity {name:32s} {values[name]:.6f}", flush=True)
    rel = {
        label(a): abs(values[f"{label(a)} native"] - values[f"{label(a)} dense"]) / values[f"{label(a)} dense"]
        for a in args.artifact_paths
    }
    return {"seq_len": args.ppl_seq_len, "windows": args.ppl_windows, "perplexity": values, "native_vs_dense": rel}


# -- (e) cold start (opt-in) -------------------------------------------------------------------------------


def read_all(directory: Path) -> int:
    """Read every regular file under ``directory`` once (1 MiB reads); returns the bytes read."""
    total, buffer = 0, bytearray(1 << 20)
    view = memoryview(buffer)
    for path in sorted(directory.rglob("*")):
        if path.is_file() and not path.is_symlink():
            with open(path, "rb", buffering=0) as handle:
                while n := handle.readinto(view):
                    total += n
    return total


def median_time(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: page cache, lazy imports, allocator
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


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


def cold_start_section(artifact: Path, original: Path, repeats: int) -> dict[str, float]:
    """(e): load times, page cache warm: fresh process (imports included) and in-process, plus the read floor."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from squeeze import api

    read_all(artifact), read_all(original)  # warm the page cache
    return {
        "fresh process: artifact squeeze.load": cold_start("artifact", artifact, repeats),
        "fresh process: original from_pretrained": cold_start("original", original, repeats),
        "artifact squeeze.load (verified)": median_time(lambda: api.load(artifact), repeats),
        "artifact squeeze.load (no verify)": median_time(lambda: api.load(artifact, verify=False), repeats),
        "original from_pretrained": median_time(
            lambda: (
                AutoModelForCausalLM.from_pretrained(original, dtype=torch.float32).eval(),
                AutoTokenizer.from_pretrained(original),
            ),
            repeats,
        ),
        "artifact read floor (page cache)": median_time(lambda: read_all(artifact), repeats),
    }


# -- report ------------------------------------------------------------------------------------------------


def verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def print_report(args: argparse.Namespace, report: dict[str, Any]) -> None:
    decode, prefill_r, memory = report["decode"], report["prefill"], report["memory"]
    names = [n for n in decode["tokens_per_second"][args.batches[0]] if n != ORIGINAL]
    print(
        f"\ndecode tokens/s (greedy, {args.new_tokens} new tokens, prefill excluded, median of {args.repeats}; "
        f"ratio = / {ORIGINAL})"
    )
    header = f"{'model':32s}" + "".join(f" {'batch ' + str(b):>17s}" for b in args.batches)
    print(header)
    for name in [*names, ORIGINAL]:
        cells = []
        for b in args.batches:
            tps = decode["tokens_per_second"][b]
            cells.append(f" {tps[name]:8.1f} ({tps[name] / tps[ORIGINAL]:5.2f}x)")
        print(f"{name:32s}" + "".join(cells))
    same = decode["greedy_equal_native_vs_dense"]
    print(
        "greedy tokens, native == dense path: "
        + "; ".join(f"batch {b}: " + ", ".join(f"{a} {v}" for a, v in row.items()) for b, row in same.items())
    )
    secs = prefill_r["seconds"]
    print(
        f"\nprefill of {prefill_r['tokens']} tokens (batch 1, median of {args.repeats}; ratio = original s / model s)"
    )
    for name in [*names, ORIGINAL]:
        rate = prefill_r["tokens"] / secs[name]
        print(f"{name:32s} {secs[name] * 1e3:9.1f} ms {rate:8.1f} tok/s  {secs[ORIGINAL] / secs[name]:5.2f}x")
    print(f"\nresident memory: RSS after load + {RSS_TOKENS} tokens - RSS before load, fresh process each")
    print("(tensors: the model's tensor storages + the kernels' own copies or the dense caches; rest: RSS - tensors)")
    print(
        f"{'path':32s} {'+RSS MB':>8s} {'anon':>7s} {'file':>7s} {'peak':>7s} {'tensors':>7s} {'rest':>7s} "
        f"{'artifact MB':>11s} {'RSS/artifact':>12s}"
    )
    for name, data in memory.items():
        d = data["delta"]
        line = (
            f"{name:32s} {d['VmRSS'] / 1e6:8.1f} {d['RssAnon'] / 1e6:7.1f} {d['RssFile'] / 1e6:7.1f} "
            f"{d['peak'] / 1e6:7.1f} {data['tensor_bytes'] / 1e6:7.1f} {(d['VmRSS'] - data['tensor_bytes']) / 1e6:7.1f}"
        )
        if name == ORIGINAL:
            ratios = ", ".join(f"{v:.2f}x {k}" for k, v in data["ratio_to_artifact"].items())
            print(f"{line} {data['original_bytes'] / 1e6:11.1f}  (its own checkpoint; / artifacts: {ratios})")
        else:
            print(f"{line} {data['artifact_bytes'] / 1e6:11.1f} {data['ratio_to_artifact']:11.2f}x")
    print("\nweight bytes (MB) per artifact")
    for name, wb in report["weight_bytes"].items():
        head = "tied to the embeddings" if wb["lm_head_tied_to_embeddings"] else f"{wb['lm_head'] / 1e6:.1f} MB"
        print(
            f"  {name}: quantized linears {wb['quantized_buffers'] / 1e6:.1f} + the kernels' own copies "
            f"{wb['kernel_extra'] / 1e6:.1f} (the sparse part's kernel form; LUTs are read in place); "
            "a dense fp32 cache holds "
            f"{wb['dense_fp32_cache_would_hold'] / 1e6:.1f} (built by the dense path: "
            f"{wb['dense_fp32_cache_built'] / 1e6:.1f}); embeddings {wb['embeddings'] / 1e6:.1f} "
            f"({wb['embedding_dtype_bits']}-bit), LM head {head}; other {wb['other_params_and_buffers'] / 1e6:.1f}"
        )
    if report.get("perplexity"):
        ppl = report["perplexity"]
        print(f"\nperplexity ({ppl['windows']} x {ppl['seq_len']} tokens of {Path(args.ppl_text).name})")
        for name, value in ppl["perplexity"].items():
            print(f"{name:32s} {value:.6f}")
        for name, rel in ppl["native_vs_dense"].items():
            print(f"{name}: native vs dense relative difference {rel:.2e} (goal ~1e-4: {verdict(rel <= 1e-4)})")
    print("\ngoals")
    for line in report["goals"]:
        print(f"  {line}")
    if report.get("cold_start"):
        print("\ncold start (seconds, page cache warm)")
        for name, seconds in report["cold_start"].items():
            print(f"{seconds:8.3f}  {name}")


def goals(args: argparse.Namespace, report: dict[str, Any]) -> list[str]:
    """One line per goal of issue 13 with the measured ratio and whether it is met."""
    lines = []
    tps1 = report["decode"]["tokens_per_second"].get(1)
    for artifact in map(label, args.artifact_paths):
        if tps1:
            r = tps1[f"{artifact} native"] / tps1[ORIGINAL]
            lines.append(
                f"decode batch 1, {artifact} native / fp32 = {r:.2f}x (goal >= 2x: {verdict(r >= 2)}; "
                f"moonshot 3x: {verdict(r >= 3)})"
            )
        secs = report["prefill"]["seconds"]
        r = secs[ORIGINAL] / secs[f"{artifact} native"]
        lines.append(
            f"prefill {report['prefill']['tokens']}, {artifact} native / fp32 = {r:.2f}x "
            f"(goal >= 0.7x: {verdict(r >= 0.7)})"
        )
        if f"{artifact} native" not in report["memory"]:
            continue
        m = report["memory"][f"{artifact} native"]["ratio_to_artifact"]
        lines.append(f"resident, {artifact} native / artifact bytes = {m:.2f}x (goal <= 1.3x: {verdict(m <= 1.3)})")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", action="append", default=None, help="an artifact (repeatable)")
    parser.add_argument("--model", default="smollm2-135m", help="the original model the artifacts come from")
    parser.add_argument("--work", default="bench-out/runtime-work", help="where the original's fp32 copy is kept")
    parser.add_argument("--quick", action="store_true", help="1 repeat, batches 1 and 8, 32 tokens (~3 min)")
    parser.add_argument("--new-tokens", type=int, default=None, help="decode tokens per run (default 64; quick 32)")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds (default 3; quick 1)")
    parser.add_argument("--batches", default=None, help="decode batch sizes (default 1,4,8,16; quick 1,8)")
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument(
        "--ppl-text",
        default=str(REPO.parent / "shared" / "corpora" / "wikitext2_raw_test.txt"),
        help="text for the prefill input and the perplexity check",
    )
    parser.add_argument("--ppl-seq-len", type=int, default=256)
    parser.add_argument("--ppl-windows", type=int, default=None, help="perplexity windows (default 4; quick 2)")
    parser.add_argument("--skip-memory", action="store_true", help="skip (c), the fresh-process RSS measurements")
    parser.add_argument("--cold-start", action="store_true", help="also (e), load times of the first artifact")
    parser.add_argument("--threads", type=int, default=None, help="torch (and kernel) threads (default: torch's)")
    parser.add_argument("--json", default=None, help="write every measurement to this JSON file")
    parser.add_argument("--rss-child", nargs=2, metavar=("KIND", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)  # the native kernels run torch.get_num_threads() threads too
    if args.rss_child:
        rss_child(*args.rss_child)
        return
    args.new_tokens = args.new_tokens or (32 if args.quick else 64)
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.batches = [int(b) for b in (args.batches or ("1,8" if args.quick else "1,4,8,16")).split(",")]
    args.ppl_windows = args.ppl_windows or (2 if args.quick else 4)
    args.artifact_paths = [Path(a) for a in args.artifact] if args.artifact else DEFAULT_ARTIFACTS
    for artifact in args.artifact_paths:
        if not (artifact / "squeeze.manifest.json").is_file():
            raise SystemExit(f"{artifact} is not an artifact (no squeeze.manifest.json); compress it first")
    started = time.perf_counter()

    import torch
    from transformers.utils import logging as hf_logging

    from squeeze.runtime.kernels.cpu_build import cpu_kernels

    hf_logging.disable_progress_bar()
    kernels = cpu_kernels()
    machine: dict[str, Any] = {
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "kernels": kernels.isa if kernels else None,
        "loadavg_start": loadavg(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    machine["revision"] = revision()
    print(f"command: {command_line()}")
    print(f"code: {machine['revision']}")
    print(
        f"machine: {machine['cpu']}, {machine['cpus']} CPUs, torch {machine['torch']}, {machine['torch_threads']} "
        f"threads, kernels {machine['kernels']}; load average {machine['loadavg_start']}; {machine['date']}"
    )
    original = prepare_original(args.model, Path(args.work))
    models = load_models(args.artifact_paths, original)
    for name, (model, _) in models.items():
        if name != ORIGINAL:
            print(f"  {name}: linears by path {weight_paths(model)}", flush=True)

    print(f"(a) decode: batches {args.batches}, {args.new_tokens} new tokens, {args.repeats} rounds + warm-up")
    report: dict[str, Any] = {"command": command_line(), "machine": machine, "artifacts": {}}
    report["decode"] = decode_section(args, models)
    print(f"(b) prefill: {args.prefill_tokens} tokens")
    tokenizer = models[ORIGINAL][1]
    text = Path(args.ppl_text).read_text(encoding="utf-8")
    ids = tokenizer(text[: args.prefill_tokens * 16], return_tensors="pt")["input_ids"][:, : args.prefill_tokens]
    if ids.shape[1] < args.prefill_tokens:
        raise SystemExit(f"{args.ppl_text} gives only {ids.shape[1]} tokens, wanted {args.prefill_tokens}")
    report["prefill"] = prefill_section(args, models, ids)
    report["weight_bytes"] = {
        label(a): weight_bytes(models[f"{label(a)} native"][0], models[f"{label(a)} dense"][0])
        for a in args.artifact_paths
    }
    report["artifacts"] = {label(a): {"path": str(a), "bytes": disk_bytes(a)} for a in args.artifact_paths}
    print(f"(d) perplexity: {args.ppl_windows} x {args.ppl_seq_len} tokens")
    report["perplexity"] = perplexity_section(args, models)
    del models, tokenizer
    print("(c) resident memory, a fresh process per path")
    report["memory"] = {} if args.skip_memory else memory_section(args.artifact_paths, original)
    if args.cold_start:
        print("(e) cold start")
        report["cold_start"] = cold_start_section(args.artifact_paths[0], original, max(args.repeats, 2))
    report["goals"] = goals(args, report)
    machine["loadavg_end"] = loadavg()
    machine["seconds"] = time.perf_counter() - started
    print_report(args, report)
    print(f"\nload average at the end {machine['loadavg_end']}; {machine['seconds']:.0f} s")
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
