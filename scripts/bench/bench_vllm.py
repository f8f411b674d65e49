"""squeeze artifacts on vLLM, measured side by side in one run (the vLLM environment: scripts/check_vllm.sh).

    .venv-vllm/bin/python scripts/bench/bench_vllm.py [--artifacts A B] [--original DIR]
        [--skip-correctness] [--skip-tp] [--skip-throughput]

1. Correctness: 8 prompts, greedy, 32 new tokens, each artifact through vLLM (float32, tensor parallel 1)
   against ``squeeze run``'s text (squeeze.load + generate, one prompt at a time). Where the texts differ,
   squeeze's model is run teacher-forced on vLLM's tokens to find the first step where squeeze's own choice
   differs, and the log-probability gap between the two choices there (a near-tie when < 1e-3).
2. Tensor parallel 3 against tensor parallel 1, token for token (SmolLM2: 9 heads, 3 KV heads).
3. Throughput: 16 concurrent requests of 64 new tokens (ignore_eos), vLLM serving the artifact vs vLLM
   serving the original, bfloat16 and float32, in the same run (median of --repeats engine starts each).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "The three most important things in life are",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "The best way to learn a new language is",
    "In 1969, the first humans",
    "A recipe for pancakes: first,",
]


def vllm_generate(model: Path, prompts: list[str], max_tokens: int, **options: Any) -> dict[str, Any]:
    """scripts/bench/vllm_generate.py in a process of its own (vLLM spawns workers); its JSON result."""
    cmd = [
        sys.executable,
        str(ROOT / "scripts" / "bench" / "vllm_generate.py"),
        str(model),
        "--prompts-json",
        json.dumps(prompts),
    ]
    cmd += ["--max-tokens", str(max_tokens)]
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        cmd += [flag] if value is True else [flag, str(value)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    for line in proc.stdout.splitlines():
        if line.startswith("VLLM_RESULT "):
            return json.loads(line[len("VLLM_RESULT ") :])
    raise RuntimeError(f"vLLM run failed ({' '.join(cmd[2:4])}...):\n{proc.stderr[-3000:]}")


def squeeze_texts(artifact: Path, prompts: list[str], max_tokens: int) -> tuple[list[str], Any]:
    """``squeeze run``'s greedy text for each prompt (one at a time), and the loaded model."""
    from squeeze import api

    loaded = api.load(artifact)
    texts = [api.generate(loaded, [p], max_new_tokens=max_tokens).texts[0] for p in prompts]
    return texts, loaded


def correctness(artifacts: list[Path], max_tokens: int) -> list[dict[str, Any]]:
    from squeeze.eval.greedy import first_divergence

    rows = []
    for artifact in artifacts:
        vllm = vllm_generate(artifact, PROMPTS, max_tokens, logprobs=2)
        texts, loaded = squeeze_texts(artifact, PROMPTS, max_tokens)
        equal, ties, notes = 0, 0, []
        for i in range(len(PROMPTS)):
            if vllm["texts"][i] == texts[i]:
                equal += 1
                continue
            found = first_divergence(loaded.model, vllm["prompt_tokens"][i], vllm["tokens"][i])
            step, gap = found if found is not None else (-1, 0.0)
            ties += gap < 1e-3
            notes.append(f"prompt {i}: first difference at step {step}, logprob gap {gap:.2e}")
        rows.append(
            {"artifact": artifact.name, "equal": equal, "near_ties": ties, "prompts": len(PROMPTS), "notes": notes}
        )
        print(f"{artifact.name}: {equal}/{len(PROMPTS)} equal to squeeze run; near-ties {ties}; {notes}", flush=True)
    return rows


def tensor_parallel(artifact: Path, max_tokens: int) -> dict[str, Any]:
    one = vllm_generate(artifact, PROMPTS, max_tokens)
    three = vllm_generate(artifact, PROMPTS, max_tokens, tp=3)
    same = sum(a == b for a, b in zip(one["tokens"], three["tokens"], strict=True))
    row = {
        "artifact": artifact.name,
        "same": same,
        "prompts": len(PROMPTS),
        "load_tp1": one["load_seconds"],
        "load_tp3": three["load_seconds"],
    }
    print(f"TP3 vs TP1 ({artifact.name}): {same}/{len(PROMPTS)} token for token", flush=True)
    return row


def throughput(models: dict[str, Path], requests: int, max_tokens: int, repeats: int) -> list[dict[str, Any]]:
    """Output tokens/s of ``requests`` concurrent greedy requests per model and dtype: the median of ``repeats``
    engine starts, the models taking turns (one engine start's speed on this machine varies by up to 1.4x,
    between runs of the same configuration)."""
    import statistics

    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(requests)]
    rows = []
    for dtype in ("bfloat16", "float32"):
        runs: dict[str, list[float]] = {name: [] for name in models}
        for _ in range(repeats):
            for name, model in models.items():
                result = vllm_generate(model, prompts, max_tokens, dtype=dtype, ignore_eos=True)
                tokens = sum(len(t) for t in result["tokens"])
                runs[name].append(tokens / result["generate_seconds"])
        for name, speeds in runs.items():
            rows.append({"model": name, "dtype": dtype, "tokens_per_second": statistics.median(speeds), "runs": speeds})
            print(
                f"{name} {dtype}: {statistics.median(speeds):.1f} output tok/s (runs: "
                + ", ".join(f"{v:.0f}" for v in speeds)
                + ")",
                flush=True,
            )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--artifacts",
        nargs="+",
        type=Path,
        default=[ROOT / "artifacts/smollm2-135m-w4", ROOT / "artifacts/smollm2-135m-w3-s045"],
    )
    parser.add_argument("--original", type=Path, default=ROOT / "artifacts/smollm2-135m-hf")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--skip-correctness", action="store_true")
    parser.add_argument("--skip-tp", action="store_true")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--repeats", type=int, default=3, help="engine starts per throughput cell (median)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench-out/vllm.json")
    args = parser.parse_args()
    report: dict[str, Any] = {}
    if not args.skip_correctness:
        report["correctness"] = correctness(args.artifacts, args.max_tokens)
    if not args.skip_tp:
        report["tensor_parallel"] = [tensor_parallel(a, args.max_tokens) for a in args.artifacts]
    if not args.skip_throughput:
        models = {"original": args.original, **{a.name: a for a in args.artifacts[:1]}}
        report["throughput"] = throughput(models, requests=16, max_tokens=64, repeats=args.repeats)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":  # vLLM's workers spawn: nothing may run on import
    sys.exit(main())
