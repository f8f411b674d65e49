"""Perplexity through every runtime path equals `squeeze eval`'s within 1e-3 relative (issue 4).

Paths: `squeeze eval` (squeeze.eval.compare.evaluate), squeeze.load's default (the native CPU kernels for LUT
formats), squeeze.load with the dense cache, the low-memory row-chunked forward (as on a machine without the
native kernels), transformers' from_pretrained after `import squeeze`, and an independent reference
that swaps every SqueezeLinear for a plain nn.Linear holding ``qweight.dequantize()`` (the format's
reference arithmetic, no SqueezeLinear forward at all).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from torch import nn
from transformers import AutoModelForCausalLM

from squeeze import api
from squeeze.eval.compare import evaluate
from squeeze.eval.perplexity import perplexity
from squeeze.runtime.kernels.cpu_build import cpu_kernels
from squeeze.runtime.linear import SqueezeLinear
from squeeze.runtime.weight_paths import set_activations

SEQ_LEN, WINDOWS = 128, 4
RTOL = 1e-3
#: int8 activations and int8 LUT levels (W4A8) against the float32 path, on the tiny model's perplexity
INT8_RTOL = 1e-2


def pinned(model: nn.Module, activations: str) -> nn.Module:
    set_activations(model, activations)  # type: ignore[arg-type]
    return model


@pytest.fixture(scope="module", params=["w3-s045", "rtn-w4"])
def artifact(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, compress_tiny) -> Path:
    out = tmp_path_factory.mktemp("consistency") / request.param
    overrides = {} if request.param.startswith("rtn") else {"weights.sensitivity": "uniform"}
    return compress_tiny(out, request.param, overrides=overrides)


def dequantized_reference(model: nn.Module) -> nn.Module:
    """``model`` with each SqueezeLinear replaced by an nn.Linear of its reference-dequantized weight."""
    for name, module in list(model.named_modules()):
        if isinstance(module, SqueezeLinear):
            linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
            linear.weight = nn.Parameter(module.qweight.dequantize(), requires_grad=False)
            if module.bias is not None:
                linear.bias = module.bias
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, linear)
    return model


def weight_paths(model: nn.Module) -> set[str]:
    return {m.weight_path for m in model.modules() if isinstance(m, SqueezeLinear)}


def test_runtime_perplexity_equals_squeeze_eval(
    artifact: Path, tiny_text_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # every path on float32 activations, the exact LUT values (the int8 default: below, and test_cpu_w8.py)
    exact = "float32"
    reference = evaluate(
        artifact, tiny_text_file, seq_len=SEQ_LEN, max_windows=WINDOWS, activations=exact
    ).result.perplexity
    text = tiny_text_file.read_text(encoding="utf-8")

    def ppl(model: nn.Module, tokenizer) -> float:
        return perplexity(model, tokenizer, text, seq_len=SEQ_LEN, max_windows=WINDOWS).perplexity

    default = api.load(artifact, activations=exact)
    tokenizer = default.tokenizer
    kernels = cpu_kernels()
    lut = not artifact.name.startswith("rtn")  # RTN has no native kernel: its default is the dense path
    assert weight_paths(default.model) == {f"native-{kernels.isa}" if lut and kernels is not None else "dense"}
    dense = api.load(artifact, dense_cache=True)
    assert weight_paths(dense.model) == {"dense"}
    with monkeypatch.context() as m:  # no native kernels: low_memory=True is the chunked path for LUT formats too
        m.setattr("squeeze.runtime.linear.prepare_cpu", lambda qweight, kernels=None, **_: None)
        low = api.load(artifact, low_memory=True)
    assert weight_paths(low.model) == {"chunked"}
    for module in low.model.modules():
        if isinstance(module, SqueezeLinear):
            module.chunk_rows = 50  # several slices per matrix (up to 144 rows here), not one
    paths = {
        "squeeze.load default": ppl(default.model, tokenizer),
        "squeeze.load dense cache": ppl(dense.model, tokenizer),
        "squeeze.load low-memory": ppl(low.model, tokenizer),
        "from_pretrained": ppl(pinned(AutoModelForCausalLM.from_pretrained(artifact), exact), tokenizer),
        "dequantized nn.Linear": ppl(dequantized_reference(api.load(artifact).model), tokenizer),
    }
    assert 1.0 < reference < 1e4
    for name, value in paths.items():
        assert abs(value - reference) <= RTOL * reference, (name, value, reference)
    # int8 activations: squeeze eval and squeeze.load agree exactly, and stay within 1% of the exact path
    fast = evaluate(artifact, tiny_text_file, seq_len=SEQ_LEN, max_windows=WINDOWS, activations="int8")
    assert ppl(api.load(artifact, activations="int8").model, tokenizer) == fast.result.perplexity
    fast = fast.result.perplexity
    assert abs(fast - reference) <= INT8_RTOL * reference, (fast, reference)
