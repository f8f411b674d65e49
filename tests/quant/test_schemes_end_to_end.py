"""A format registered from outside squeeze goes through compress -> verify -> load -> eval, unchanged.

The toy format (tests/toy_format.py) is one class; nothing in squeeze names it. This is the registry's
acceptance test: if any stage still branched on the built-in methods, it would fail here.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from squeeze import api
from squeeze.config import load_recipe
from squeeze.runtime.linear import SqueezeLinear
from toy_format import ToyAbsmaxWeight


def test_a_toy_format_compresses_verifies_loads_and_evaluates(
    toy_registered, tiny_llama, tiny_llama_dir: Path, tiny_text_file: Path, tmp_path: Path
) -> None:
    recipe = load_recipe("w4", **{"weights.method": "toy", "weights.bits": 8})
    out = tmp_path / "toy"
    result = api.compress(str(tiny_llama_dir), out, recipe)  # the toy format uses no Fisher: no calibration
    assert api.verify_model_integrity(out).ok
    loaded = api.load(out)
    linears = {n: m for n, m in loaded.model.named_modules() if isinstance(m, SqueezeLinear)}
    assert linears and all(type(m.qweight) is ToyAbsmaxWeight for m in linears.values())
    assert result.quantized_modules == len(linears) == 14  # 7 target linears in each of 2 layers

    reference, tokenizer = tiny_llama
    reference = _with_weights(reference, {n: m.dequantize() for n, m in linears.items()})
    ids = tokenizer("Once upon a time there was a little cat", return_tensors="pt").input_ids
    with torch.no_grad():
        expected = reference(ids).logits
        got = loaded.model(ids).logits
    assert (got - expected).abs().max() < 1e-4
    info = api.inspect(out)
    n_weights = sum(m.in_features * m.out_features for m in linears.values())
    rows = sum(m.out_features for m in linears.values())
    assert info.bits_per_weight == pytest.approx(8 + 16 * rows / n_weights, abs=1e-4)  # codes + a fp16 scale per row
    evaluated = api.evaluate(out, tiny_text_file, seq_len=32, max_windows=2, baseline=str(tiny_llama_dir))
    assert evaluated.result.n_windows == 2 and math.isfinite(evaluated.result.perplexity)
    assert evaluated.baseline_result is not None  # 8-bit absmax codes: within 2% of the original
    assert abs(evaluated.result.perplexity / evaluated.baseline_result.perplexity - 1) < 0.02


def _with_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    import copy

    clone = copy.deepcopy(model)
    for name, w in weights.items():
        clone.get_submodule(name).weight.data = w.to(clone.get_submodule(name).weight.dtype)
    return clone
