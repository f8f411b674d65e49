"""What the dense (tests/runtime/test_families.py) and MoE (test_moe_families.py) family matrices share:
saving and compressing a tiny model, and checking `squeeze run` / `squeeze eval` against the reference (the
original model with the artifact's dequantized weights)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from squeeze import api
from squeeze.cli.app import app
from squeeze.eval.perplexity import perplexity

runner = CliRunner()


def compress_tiny_model(
    original: nn.Module,
    tokenizer: Any,
    root: Path,
    recipe: str,
    compress: dict[str, Any],
    text_file: Path,
) -> Path:
    """Save ``original`` with ``tokenizer`` under ``root/model`` and compress it into ``root/artifact`` with
    ``recipe`` and api.compress keywords ``compress`` (calibrated on ``text_file`` when they override the
    calibration); returns the artifact."""
    source = root / "model"
    original.save_pretrained(source)
    tokenizer.save_pretrained(source)
    kwargs = dict(compress)
    if "calibration_overrides" in kwargs:
        kwargs["calibration"] = str(text_file)
    api.compress(str(source), root / "artifact", recipe=recipe, **kwargs)
    return root / "artifact"


def logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def check_squeeze_run(artifact: Path, reference: nn.Module, tokenizer: Any, prompt: str) -> None:
    """`squeeze run --json --activations float32` continues ``prompt`` (6 greedy tokens) exactly as
    ``reference.generate`` does."""
    args = ["run", prompt, "-m", str(artifact), "--max-new-tokens", "6", "--activations", "float32"]
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    text = json.loads(result.stdout)["text"]
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = reference.generate(**inputs, max_new_tokens=6, do_sample=False, pad_token_id=3)
    assert prompt + text == tokenizer.decode(out[0], skip_special_tokens=True)  # the text is read after the prompt


def check_squeeze_eval(
    artifact: Path, reference: nn.Module, tokenizer: Any, text_file: Path, seq_len: int, windows: int
) -> None:
    """`squeeze eval --json --activations float32` scores ``windows`` windows of ``seq_len`` tokens as
    ``reference`` does (1e-4)."""
    args = ["eval", str(artifact), "--text", str(text_file), "--seq-len", str(seq_len), "--activations", "float32"]
    result = runner.invoke(app, [*args, "--max-windows", str(windows), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["windows"] == windows
    text = text_file.read_text(encoding="utf-8")
    expected = perplexity(reference, tokenizer, text, seq_len=seq_len, max_windows=windows).perplexity
    assert report["perplexity"] == pytest.approx(expected, rel=1e-4)
