"""SqueezeExperts: a quantized 3-D expert parameter indexed like the parameter, dequantizing only what is indexed.

Artifacts here are written by hand from the format classes (the experts contract of docs/format.md: the
parameter as one (E*out, in) matrix, module entry + "experts" / "transposed"), so the runtime is tested
apart from compress; tests/runtime/test_moe_families.py runs the whole compress -> load matrix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as tf
from torch import nn
from typer.testing import CliRunner

from squeeze import api
from squeeze.cli.app import app
from squeeze.errors import FormatError
from squeeze.format.inspect import inspect_artifact
from squeeze.format.manifest import Provenance
from squeeze.format.quant_config import FORMAT_VERSION, QUANT_METHOD
from squeeze.format.shards import write_shards
from squeeze.format.verify import seal_artifact
from squeeze.quant.schemes.lut import quantize_lut
from squeeze.quant.schemes.rtn import RtnWeight
from squeeze.runtime.config_shapes import check_config_shapes
from squeeze.runtime.experts import (
    SqueezeExperts,
    experts_layout,
    replace_expert_parameter,
)
from squeeze.runtime.experts_forward import experts_implementation, use_squeeze_experts
from squeeze.runtime.memory import SPARSE_ENTRY_BYTES, W8_BITS, W8_ROW_BYTES, estimate_load
from squeeze.runtime.weight_paths import set_activations

E, OUT, IN = 4, 6, 10
IDS = torch.tensor([[1, 17, 42, 99, 7, 250, 3, 64, 128, 5, 77, 300]])
MOE = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}


def _weight(transposed: bool = False, sparse: bool = True) -> tuple[Any, torch.Tensor]:
    """A 4-bit LUT weight of E experts of (OUT, IN) and the parameter it stands for, (E, OUT, IN) or (E, IN, OUT)."""
    torch.manual_seed(0)
    q = quantize_lut(torch.randn(E * OUT, IN), None, 4, 0.0, 0.05 if sparse else 0.0)
    param = q.dequantize().reshape(E, OUT, IN)
    return q, param.transpose(1, 2).contiguous() if transposed else param


@pytest.mark.parametrize("transposed", [False, True])
def test_indexing_returns_the_experts_matrix_in_the_parameters_layout(transposed: bool) -> None:
    q, param = _weight(transposed)
    experts = SqueezeExperts(q, E, transposed=transposed)
    assert experts.shape == param.shape and experts.dtype == torch.float32 and len(experts) == E
    for e in range(E):
        assert torch.equal(experts[e], param[e])
        assert torch.equal(experts[torch.tensor(e)], param[e])  # a 0-d tensor, as the eager forwards index
    assert torch.equal(experts[-1], param[-1])
    index = torch.tensor([3, 0, 3, 1])
    assert torch.equal(experts[index], param[index])  # 1-D: stacked (k, ...), repeats allowed
    assert torch.equal(experts[1:3], param[1:3])
    assert torch.equal(experts.dequantize(), param)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("lut_dtype", ["float16", "int8"])
def test_the_native_path_equals_the_reference_bit_for_bit(bits: int, lut_dtype: str) -> None:
    torch.manual_seed(bits)
    q = quantize_lut(torch.randn(E * OUT, 200), None, bits, 0.0, 0.03, lut_dtype=lut_dtype)  # SIMD blocks + a tail
    experts = SqueezeExperts(q, E, transposed=True)
    if not experts.weight_path.startswith("native-"):
        pytest.skip("the native CPU kernels are not available here (no C++ compiler)")
    index = torch.tensor([3, 0, 3])
    reference = q.dequantize().reshape(E, OUT, 200).transpose(1, 2)[index]
    assert torch.equal(experts[index].view(torch.int32), reference.view(torch.int32))
    experts.compute_dtype = torch.bfloat16
    assert torch.equal(experts[1], q.dequantize(torch.bfloat16).reshape(E, OUT, 200).transpose(1, 2)[1])


def test_only_the_indexed_experts_are_dequantized() -> None:
    q, _ = _weight()
    experts = SqueezeExperts(q, E)
    experts._cpu = None  # the reference path, whose row slices are counted here
    assert experts.weight_path == "reference"
    rows: list[tuple[int, int]] = []
    original = type(q).row_slice

    def spy(self: Any, start: int, stop: int) -> Any:
        rows.append((start, stop))
        return original(self, start, stop)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(q), "row_slice", spy)
        experts[2]
        experts[torch.tensor([3, 3, 1])]
    assert rows == [(2 * OUT, 3 * OUT), (1 * OUT, 2 * OUT), (3 * OUT, 4 * OUT)]  # each distinct expert once
    assert experts.used == 3


def test_rtn_and_half_precision_experts() -> None:
    torch.manual_seed(1)
    q = RtnWeight.quantize(torch.randn(E * OUT, IN), None, _Options())
    experts = SqueezeExperts(q, E, dtype=torch.bfloat16)
    assert experts[1].dtype == torch.bfloat16
    assert torch.equal(experts[1], q.dequantize(torch.bfloat16)[OUT : 2 * OUT])


class _Options:
    bits, group_size, sensitive_fraction, outlier_fraction, lut_dtype = 4, None, 0.0, 0.0, "float16"


@pytest.mark.parametrize("index", [E, -E - 1, torch.tensor([0, E]), torch.tensor([0.0]), "0"])
def test_a_bad_index_is_an_index_error(index: Any) -> None:
    experts = SqueezeExperts(_weight()[0], E)
    with pytest.raises(IndexError):
        experts[index]


def test_moving_and_reloading_keep_the_weight() -> None:
    q, param = _weight()
    experts = SqueezeExperts(q, E)
    state = {k: v.clone() for k, v in experts.state_dict().items()}
    assert set(state) == {
        "weight_packed",
        "weight_lut",
        "weight_sparse_rowptr",
        "weight_sparse_cols",
        "weight_sparse_vals",
    }
    other = SqueezeExperts(quantize_lut(torch.randn(E * OUT, IN), None, 4, 0.0, 0.05), E)
    other.load_state_dict(state)  # copies into the buffers, then rebuilds the weight with every check
    assert torch.equal(other[2], param[2])
    assert torch.equal(other.to("cpu")[0], param[0])
    stored = {k: v.clone() for k, v in other.state_dict().items()}
    other.to(torch.bfloat16)  # the stored tensors keep their dtypes and bytes; experts come out in bfloat16
    assert all(torch.equal(v, stored[k]) and v.dtype == stored[k].dtype for k, v in other.state_dict().items())
    assert other.dtype == torch.bfloat16 and torch.equal(other[2], param[2].to(torch.bfloat16))
    assert other.float()[2].dtype == torch.float32


def test_rows_that_e_does_not_divide_are_refused() -> None:
    with pytest.raises(FormatError, match="not a multiple of its 5 experts"):
        SqueezeExperts(_weight()[0], 5)


class _Experts(nn.Module):
    def __init__(self, transposed: bool = False) -> None:
        super().__init__()
        self.is_transposed = transposed
        shape = (E, IN, OUT) if transposed else (E, OUT, IN)
        self.gate_up_proj = nn.Parameter(torch.zeros(shape))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(E, OUT))


def test_the_swap_replaces_the_parameter_and_keeps_its_bias() -> None:
    holder = nn.Sequential(_Experts(transposed=True))
    module = replace_expert_parameter(holder, "0.gate_up_proj", _weight()[0], E, True)
    assert holder[0].gate_up_proj is module and "gate_up_proj" not in dict(holder[0].named_parameters(recurse=False))
    assert [n for n, _ in holder.named_parameters()] == ["0.gate_up_proj_bias"]
    assert {n for n, _ in holder.named_buffers()} >= {"0.gate_up_proj.weight_packed", "0.gate_up_proj.weight_lut"}


@pytest.mark.parametrize(
    ("name", "experts", "transposed", "message"),
    [
        ("0.missing", E, False, "'0.missing' as an expert parameter, which is not a 3-D parameter"),
        ("0.gate_up_proj_bias", E, False, "not a 3-D parameter"),
        ("0.gate_up_proj", E, True, "the artifact says transposed=True, but this architecture's experts are not"),
        ("0.gate_up_proj", 2, False, r"builds a \(4, 6, 10\) expert parameter, but the artifact's weight is \(2, 12"),
    ],
)
def test_a_swap_that_does_not_fit_is_a_format_error(name: str, experts: int, transposed: bool, message: str) -> None:
    with pytest.raises(FormatError, match=message):
        replace_expert_parameter(nn.Sequential(_Experts()), name, _weight()[0], experts, transposed)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"experts": 0}, "experts must be an integer >= 1, found 0"),
        ({"experts": "4"}, "experts must be an integer >= 1, found '4'"),
        ({"experts": True}, "experts must be an integer >= 1, found True"),
        ({"experts": 4, "transposed": "no"}, "transposed must be true or false, found 'no'"),
    ],
)
def test_malformed_experts_keys_are_format_errors(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(FormatError, match=message):
        experts_layout(spec, "m.experts.gate_up_proj")


def test_an_entry_without_experts_is_a_linear() -> None:
    assert experts_layout({"method": "squeeze", "bits": 4}, "m.q_proj") is None
    assert experts_layout({"experts": 8, "transposed": True}, "m") == (8, True)


# -- a hand-written Qwen3-MoE artifact through both loaders ---------------------------------------------


def _write_moe_artifact(root: Path, tokenizer: Any, family: str = "qwen3_moe") -> tuple[Path, nn.Module]:
    """A tiny random MoE model with every expert parameter quantized (4-bit LUT + sparse) by hand, sealed;
    and the reference: the original model with the dequantized experts put back."""
    if family == "gpt_oss":
        dims = {k: v for k, v in MOE.items() if k not in ("moe_intermediate_size", "num_experts")}
        config: Any = tf.GptOssConfig(**{**dims, "intermediate_size": 32, "num_local_experts": 4})
    else:
        config = tf.Qwen3MoeConfig(**MOE)
    config.vocab_size = len(tokenizer)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    tensors = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    modules: dict[str, Any] = {}
    for name, param in model.named_parameters():
        if param.dim() != 3:
            continue
        transposed = bool(getattr(model.get_submodule(name.rpartition(".")[0]), "is_transposed", False))
        stacked = param.detach().transpose(1, 2) if transposed else param.detach()  # (E, out, in)
        q = quantize_lut(stacked.reshape(-1, stacked.shape[-1]), None, 4, 0.0, 0.02)
        del tensors[name]
        tensors.update(q.to_tensors(name))
        modules[name] = {**q.module_spec(), "experts": int(param.shape[0]), "transposed": transposed}
        back = q.dequantize().reshape(stacked.shape)
        param.data = back.transpose(1, 2).contiguous() if transposed else back
    root.mkdir(parents=True)
    write_shards(root, tensors, 2**30)
    written = config.to_dict()
    written["quantization_config"] = {
        "quant_method": QUANT_METHOD,
        "format_version": FORMAT_VERSION,
        "modules": modules,
    }
    (root / "config.json").write_text(json.dumps(written))
    tokenizer.save_pretrained(root)
    seal_artifact(root, Provenance(source_model="test"))
    return root, model


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer: Any) -> tuple[Path, nn.Module]:
    return _write_moe_artifact(tmp_path_factory.mktemp("moe") / "qwen3", tiny_tokenizer)


def _logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_both_loaders_equal_the_dequantized_reference(
    family: str, tmp_path: Path, tiny_tokenizer: Any, qwen3_moe: tuple[Path, nn.Module]
) -> None:
    import squeeze  # noqa: F401 - registers the quantizer with transformers

    root, reference = (
        qwen3_moe if family == "qwen3_moe" else _write_moe_artifact(tmp_path / "a", tiny_tokenizer, family)
    )
    loaded = api.load(root, activations="float32").model  # the exact path (int8: tests/runtime/test_cpu_w8.py)
    experts = [n for n, m in loaded.named_modules() if isinstance(m, SqueezeExperts)]
    assert len(experts) == 2 * MOE["num_hidden_layers"]
    assert loaded.config._experts_implementation == experts_implementation() == "squeeze"
    assert (_logits(loaded) - _logits(reference)).abs().max().item() <= 1e-5
    hf = tf.AutoModelForCausalLM.from_pretrained(root)
    assert [n for n, m in hf.named_modules() if isinstance(m, SqueezeExperts)] == experts
    assert set_activations(hf, "float32") == len(experts)
    assert hf.config._experts_implementation == "squeeze"
    assert (_logits(hf) - _logits(reference)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("implementation", ["squeeze", "eager"])
def test_one_forward_uses_only_routed_experts(qwen3_moe: tuple[Path, nn.Module], implementation: str) -> None:
    """ "squeeze" runs each routed expert on the packed codes (nothing dequantized on the native path);
    transformers' own "eager" forward indexes the parameter, dequantizing each routed expert."""
    model = api.load(qwen3_moe[0]).model
    model.config._experts_implementation = implementation
    dequantized: list[int] = []
    original = SqueezeExperts.dequantize_experts

    def spy(self: SqueezeExperts, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        dequantized.extend(ids.tolist())
        return original(self, ids, dtype)

    routed: dict[str, set[int]] = {}

    def record(name: str) -> Any:
        def hook(_module: nn.Module, _inputs: Any, output: Any) -> None:
            routed[name] = set(output[2].reshape(-1).tolist())  # (logits, weights, top-k indices)

        return hook

    for name, module in model.named_modules():
        if name.endswith("mlp.gate"):
            module.register_forward_hook(record(name.removesuffix(".gate")))
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(SqueezeExperts, "dequantize_experts", spy)
        model(IDS[:, :3])  # 3 tokens x top-2: at most 6 of the 4 experts, usually fewer
    for mlp, experts in routed.items():
        for proj in ("gate_up_proj", "down_proj"):
            module = model.get_submodule(f"{mlp}.experts.{proj}")
            assert module.used == len(experts)
    assert any(len(e) < MOE["num_experts"] for e in routed.values())  # some expert was skipped
    native = model.get_submodule(f"{next(iter(routed))}.experts.gate_up_proj").weight_path.startswith("native-")
    expected = 0 if implementation == "squeeze" and native else 2 * sum(len(e) for e in routed.values())
    assert len(dequantized) == expected


def test_the_squeeze_forward_equals_the_eager_one(qwen3_moe: tuple[Path, nn.Module]) -> None:
    model = api.load(qwen3_moe[0], activations="float32").model
    ours = _logits(model)
    model.config._experts_implementation = "eager"  # transformers' loop over the dequantized experts
    assert (ours - _logits(model)).abs().max().item() <= 1e-5


def test_an_expert_linear_with_gradients_goes_through_the_dequantized_expert() -> None:
    q, param = _weight()
    experts = SqueezeExperts(q, E, activations="float32")
    x = torch.randn(3, IN)
    assert (experts.linear(2, x) - x @ param[2].T).abs().max().item() <= 1e-5  # the kernels where they run
    x.requires_grad_(True)  # the kernels have no backward
    y = experts.linear(2, x)
    assert torch.equal(y, torch.nn.functional.linear(x, param[2])) and y.requires_grad


def test_the_config_must_hold_the_artifacts_experts(qwen3_moe: tuple[Path, nn.Module]) -> None:
    config = json.loads((qwen3_moe[0] / "config.json").read_text())
    modules = config["quantization_config"]["modules"]
    shapes: dict[str, tuple[int, ...]] = {}
    check_config_shapes(config, shapes, modules)
    with pytest.raises(FormatError, match="num_experts is 8, but .* holds 4 experts"):
        check_config_shapes({**config, "num_experts": 8}, shapes, modules)
    with pytest.raises(FormatError, match="moe_intermediate_size 16 make each of .*gate_up_proj's experts 32 x 64"):
        check_config_shapes({**config, "moe_intermediate_size": 16}, shapes, modules)
    bad = {k: {**v, "out_features": v["out_features"] + 1} for k, v in modules.items()}
    with pytest.raises(FormatError, match="is not a multiple of its 4 experts"):
        check_config_shapes(config, shapes, bad)


def test_inspect_and_the_memory_estimate_count_the_experts(qwen3_moe: tuple[Path, nn.Module]) -> None:
    info = inspect_artifact(qwen3_moe[0]).to_dict()
    assert (info["expert_parameters"], info["experts"], info["quantized_modules"]) == (4, 16, 4)
    estimate = estimate_load(qwen3_moe[0])
    assert estimate is not None
    # one expert's gate_up (64 x 64) and down (64 x 32) in flight at most: twice the larger, float32
    assert estimate.experts_bytes == 2 * 64 * 64 * 4
    assert estimate.dense_cache_bytes == 0  # experts are never cached
    loaded = api.load(qwen3_moe[0]).model
    experts = [m for m in loaded.modules() if isinstance(m, SqueezeExperts)]
    nnz = sum(m.qweight.sparse.nnz for m in experts)
    rows = sum(m.qweight.out_features for m in experts if m.qweight.bits in W8_BITS)  # the int8 form's rows
    assert nnz and estimate.prepared_bytes == SPARSE_ENTRY_BYTES * nnz + W8_ROW_BYTES * rows
    shown = CliRunner().invoke(app, ["inspect", str(qwen3_moe[0])], terminal_width=1000)
    assert "of which expert parameters: 4 (16 expert matrices)" in shown.stdout, shown.output


def test_use_squeeze_experts_switches_a_grouped_model() -> None:
    config = tf.Qwen3MoeConfig(**{**MOE, "vocab_size": 320})
    model = tf.AutoModelForCausalLM.from_config(config)
    model.config._experts_implementation = "grouped_mm"
    use_squeeze_experts(model)  # nothing quantized: nothing changes
    assert model.config._experts_implementation == "grouped_mm"
    experts = model.model.layers[0].mlp.experts
    shape = experts.down_proj.shape
    q = quantize_lut(torch.randn(shape[0] * shape[1], shape[2]), None, 4)
    replace_expert_parameter(model, "model.layers.0.mlp.experts.down_proj", q, shape[0], False, activations="float32")
    use_squeeze_experts(model)
    assert model.config._experts_implementation == "squeeze"
    with torch.no_grad():  # gate_up_proj stays a plain parameter: the forward reads it as transformers does
        ours = model(IDS[:, :5]).logits
        model.config._experts_implementation = "eager"
        assert (ours - model(IDS[:, :5]).logits).abs().max().item() <= 1e-5
