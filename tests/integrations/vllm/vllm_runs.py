"""What the vLLM engine tests share: one engine per process (scripts/bench/vllm_generate.py; vLLM spawns workers),
and the check that vLLM's greedy text is ``squeeze run``'s."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from squeeze import api
from squeeze.eval.greedy import first_divergence

ROOT = Path(__file__).resolve().parents[3]
PROMPTS = ["Once upon a time", "The little dog", "She looked at the", "One day, a"]
TOKENS = 16


def run_vllm(
    model: Path, prompts: Sequence[str] = PROMPTS, tokens: int = TOKENS, **options: Any
) -> tuple[dict[str, Any] | None, str]:
    """(result, log) of scripts/bench/vllm_generate.py on ``model``; result None when vLLM failed to start."""
    cmd = [sys.executable, str(ROOT / "scripts" / "bench" / "vllm_generate.py"), str(model)]
    cmd += ["--prompts-json", json.dumps(list(prompts)), "--max-tokens", str(tokens), "--max-model-len", "128"]
    for key, value in options.items():  # True: a flag (enable_expert_parallel=True); False: left out
        flag = "--" + key.replace("_", "-")
        cmd += [flag] if value is True else [] if value is False else [flag, str(value)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900)
    log = proc.stderr + proc.stdout  # vLLM logs to stdout
    for line in proc.stdout.splitlines():
        if line.startswith("VLLM_RESULT "):
            return json.loads(line[len("VLLM_RESULT ") :]), log
    return None, log


def assert_squeeze_run_text(artifact: Path, result: dict[str, Any], prompts: Sequence[str] = PROMPTS) -> None:
    """vLLM's greedy texts in ``result`` are those ``squeeze run`` (api.generate) gives for ``prompts``; a
    difference is allowed only where the two choices were a near-tie for squeeze's own model."""
    loaded = api.load(artifact)
    for i, prompt in enumerate(prompts):
        ours = api.generate(loaded, [prompt], max_new_tokens=len(result["tokens"][i]) or TOKENS).texts[0]
        if result["texts"][i] == ours:
            continue
        found = first_divergence(loaded.model, result["prompt_tokens"][i], result["tokens"][i])
        assert found is not None and found[1] < 1e-3, (prompt, ours, result["texts"][i], found)
