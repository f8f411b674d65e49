"""Issue 18: unquantized tensors in the source dtype, and the token embedding / LM head quantized.

Two compressions of the tiny Llama: a tied bfloat16 checkpoint with a 4-bit LUT embedding (quantized once,
stored once, read by the embedding and the LM head alike), and the untied float32 one with int8 embedding
and LM head written with ``keep_dtype: bfloat16``. Both loaders must rebuild them, and agree with a dense
reference built from the artifact's own dequantized weights.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from torch import nn
from typer.testing import CliRunner

from squeeze import api
from squeeze.calibrate.fisher import fisher_information
from squeeze.cli.app import app
from squeeze.compression.embeddings import embedding_names, embedding_recipe
from squeeze.config import load_recipe
from squeeze.errors import ConfigError, ModelError
from squeeze.format.inspect import inspect_artifact
from squeeze.integrations.vllm.artifact import check_quant_config, embedding_modules, parse_quant_config
from squeeze.models.source import ModelSource
from squeeze.models.weight_dtype import source_dtype
from squeeze.runtime.embedding import SqueezeEmbedding
from squeeze.runtime.linear import SqueezeLinear

IDS = torch.tensor([[1, 5, 9, 30, 40, 50, 7, 7]])


def _shard_dtypes(artifact: Path) -> dict[str, str]:
    found: dict[str, str] = {}
    for shard in artifact.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            found.update({k: str(f.get_slice(k).get_dtype()) for k in f.keys()})  # noqa: SIM118
    return found


def _quant(artifact: Path) -> dict[str, Any]:
    return json.loads((artifact / "config.json").read_text())["quantization_config"]


def _dense_reference(source: Path, loaded: nn.Module) -> nn.Module:
    """The source model with every quantized weight replaced by the loaded artifact's exact dequantization
    and every other tensor as the artifact stores it (``loaded``'s, upcast): what both loaders must compute."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32).eval()
    state = {k: v for k, v in loaded.state_dict().items() if not k.rsplit(".", 1)[-1].startswith("weight_")}
    for name, module in loaded.named_modules():
        if isinstance(module, (SqueezeLinear, SqueezeEmbedding)):
            state[f"{name}.weight"] = module.dequantize()
    reference.load_state_dict(state, strict=False)
    return reference


@pytest.fixture(scope="module")
def tied_bf16(tmp_path_factory: pytest.TempPathFactory, resized_tiny_llama: Callable[..., Path]) -> Path:
    """The tiny Llama with a tied embedding / LM head, stored in bfloat16."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    fp32 = resized_tiny_llama(tmp_path_factory.mktemp("tied32") / "m", tie_word_embeddings=True)
    directory = tmp_path_factory.mktemp("tied16") / "m"
    AutoModelForCausalLM.from_pretrained(str(fp32), dtype=torch.bfloat16).save_pretrained(directory)
    AutoTokenizer.from_pretrained(str(fp32)).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def tied_e4(
    tmp_path_factory: pytest.TempPathFactory, tied_bf16: Path, compress_tiny: Callable[..., Path]
) -> tuple[Path, api.CompressResult]:
    out = tmp_path_factory.mktemp("tied-e4") / "art"
    result: list[api.CompressResult] = []
    original = api.compress

    def keep(*args: Any, **kwargs: Any) -> api.CompressResult:
        result.append(original(*args, **kwargs))
        return result[-1]

    with pytest.MonkeyPatch.context() as patch:  # compress_tiny returns the path; the result is wanted too
        patch.setattr(api, "compress", keep)
        compress_tiny(out, source=tied_bf16, overrides={"weights.embedding_bits": 4})
    return out, result[0]


@pytest.fixture(scope="module")
def untied_e8(tmp_path_factory: pytest.TempPathFactory, compress_tiny: Callable[..., Path]) -> Path:
    return compress_tiny(
        tmp_path_factory.mktemp("untied-e8") / "art",
        overrides={"weights.embedding_bits": 8, "output.keep_dtype": "bfloat16"},
    )


def test_tied_embedding_is_quantized_once_and_the_rest_keeps_bfloat16(tied_e4: tuple[Path, Any]) -> None:
    artifact, result = tied_e4
    dtypes = _shard_dtypes(artifact)
    assert not [k for k in dtypes if k.startswith("lm_head.")]  # the head stores nothing of its own
    assert "model.embed_tokens.weight" not in dtypes
    assert dtypes["model.embed_tokens.weight_packed"] == "U8"
    assert dtypes["model.embed_tokens.weight_lut"] == "F16"
    kept = {k: v for k, v in dtypes.items() if k.endswith("norm.weight")}
    assert kept and set(kept.values()) == {"BF16"}
    quant = _quant(artifact)
    assert quant["embeddings"] == {
        "bits": 4,
        "modules": ["model.embed_tokens"],
        "tied": {"lm_head": "model.embed_tokens"},
    }
    assert quant["unquantized_dtype"] == "bfloat16"
    assert quant["modules"]["model.embed_tokens"]["method"] == "squeeze"
    assert result.source_bytes * 2 == result.original_bytes  # bfloat16 source, fp32 in memory
    assert result.to_dict()["source_bytes"] == result.source_bytes and result.artifact_bytes < result.source_bytes
    # the embedding counts among the quantized weights, in the config and in inspect alike
    vocab, hidden = (
        quant["modules"]["model.embed_tokens"]["out_features"],
        quant["modules"]["model.embed_tokens"]["in_features"],
    )
    assert result.quantized_weights > vocab * hidden
    assert inspect_artifact(artifact).bits_per_weight == pytest.approx(quant["bits_per_weight"], abs=1e-3)


def test_both_loaders_run_the_tied_quantized_embedding(tied_e4: tuple[Path, Any], tied_bf16: Path) -> None:
    from transformers import AutoModelForCausalLM

    artifact, _ = tied_e4
    model = api.load(artifact).model
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert isinstance(embed, SqueezeEmbedding) and isinstance(head, SqueezeLinear)
    assert head.weight_packed is embed.weight_packed  # one stored tensor set serves both
    assert all(p.dtype == torch.float32 for p in model.parameters())  # bfloat16 norms upcast for the runtime
    with torch.no_grad():
        logits = model(IDS).logits
        reference = _dense_reference(tied_bf16, model)(IDS).logits
        hf = AutoModelForCausalLM.from_pretrained(str(artifact))
        assert isinstance(hf.get_input_embeddings(), SqueezeEmbedding)
        assert hf.get_output_embeddings().weight_packed is hf.get_input_embeddings().weight_packed
        hf_logits = hf(IDS).logits
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(hf_logits, logits, rtol=1e-4, atol=1e-4)


def test_untied_embedding_and_head_are_int8_rows_and_keep_dtype_overrides(
    untied_e8: Path, tiny_llama_dir: Path
) -> None:
    from transformers import AutoModelForCausalLM

    quant = _quant(untied_e8)
    assert quant["embeddings"] == {"bits": 8, "modules": ["model.embed_tokens", "lm_head"], "tied": {}}
    for name in ("model.embed_tokens", "lm_head"):
        assert quant["modules"][name]["method"] == "rtn" and quant["modules"][name]["bits"] == 8
    assert quant["unquantized_dtype"] == "bfloat16"  # the float32 source, written as asked
    assert {v for k, v in _shard_dtypes(untied_e8).items() if k.endswith("norm.weight")} == {"BF16"}
    model = api.load(untied_e8).model
    assert isinstance(model.get_input_embeddings(), SqueezeEmbedding)
    assert isinstance(model.get_output_embeddings(), SqueezeLinear)
    with torch.no_grad():
        logits = model(IDS).logits
        reference = _dense_reference(tiny_llama_dir, model)(IDS).logits
        hf_logits = AutoModelForCausalLM.from_pretrained(str(untied_e8))(IDS).logits
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(hf_logits, logits, rtol=1e-4, atol=1e-4)


def test_tied_six_bit_rows_load_in_both_loaders_as_the_dense_reference(
    tmp_path: Path, tied_bf16: Path, compress_tiny: Callable[..., Path]
) -> None:
    from transformers import AutoModelForCausalLM

    artifact = compress_tiny(tmp_path / "art", source=tied_bf16, overrides={"weights.embedding_bits": 6})
    quant = _quant(artifact)
    assert quant["embeddings"]["bits"] == 6 and quant["embeddings"]["tied"] == {"lm_head": "model.embed_tokens"}
    spec = quant["modules"]["model.embed_tokens"]
    assert (spec["method"], spec["bits"]) == ("rtn", 6)
    dtypes = _shard_dtypes(artifact)
    assert dtypes["model.embed_tokens.weight_scales"] == "F16" and not [k for k in dtypes if k.startswith("lm_head.")]
    model = api.load(artifact).model
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert isinstance(embed, SqueezeEmbedding) and embed.qweight.bits == 6
    assert isinstance(head, SqueezeLinear) and head.weight_packed is embed.weight_packed
    assert embed.weight_packed.shape[1] == (spec["in_features"] * 6 + 7) // 8
    with torch.no_grad():
        logits = model(IDS).logits
        reference = _dense_reference(tied_bf16, model)(IDS).logits
        hf_logits = AutoModelForCausalLM.from_pretrained(str(artifact))(IDS).logits
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(hf_logits, logits, rtol=1e-4, atol=1e-4)


def test_the_vllm_plugin_reads_a_quantized_embedding_and_head(untied_e8: Path) -> None:
    # vLLM serves them (vocab-parallel, tests/integrations/vllm/test_vllm_moe.py); the config names both
    quant = parse_quant_config(_quant(untied_e8))
    assert sorted(embedding_modules(quant)) == sorted(quant.embeddings.modules) != []
    assert check_quant_config(_quant(untied_e8)) == _quant(untied_e8)["modules"]


def test_the_fisher_covers_a_tied_embedding_from_both_of_its_uses(tiny_llama: tuple[Any, Any]) -> None:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        tiny_llama[0].config.__class__(**{**tiny_llama[0].config.to_dict(), "tie_word_embeddings": True})
    ).eval()
    embed = model.get_input_embeddings()
    assert model.get_output_embeddings().weight is embed.weight
    windows = torch.randint(4, 60, (2, 16), generator=torch.Generator().manual_seed(0))
    fisher = fisher_information(model, windows, {"model.embed_tokens": embed})["model.embed_tokens"]
    assert fisher.shape == embed.weight.shape
    unseen = torch.ones(embed.num_embeddings, dtype=torch.bool)
    unseen[windows.unique()] = False
    # rows of tokens never looked up still get the LM head's gradient (every logit), so none is all zero
    assert bool((fisher[unseen].sum(dim=1) > 0).all()) and bool((fisher.sum(dim=1) > 0).all())


def test_embedding_recipe_is_rows_only() -> None:
    w3 = load_recipe("w3-s045-lut8", **{"weights.embedding_bits": 4})
    weights = embedding_recipe(w3).weights
    assert (weights.method, weights.bits, weights.lut_dtype) == ("squeeze", 4, "int8")
    assert weights.sensitive_fraction == weights.outlier_fraction == 0.0  # rows are gathered: no sparse part
    weights = embedding_recipe(load_recipe("w4", **{"weights.embedding_bits": 8})).weights
    assert (weights.method, weights.bits, weights.group_size) == ("rtn", 8, None)
    # 6 bits: RTN rows whatever the recipe's method, though 6 is no width of weights.bits for linears
    for name in ("w3-s045-e6", "w4-e6"):
        weights = embedding_recipe(load_recipe(name)).weights
        assert (weights.method, weights.bits, weights.group_size, weights.embedding_bits) == ("rtn", 6, None, 6)
        assert weights.sensitive_fraction == weights.outlier_fraction == 0.0
    with pytest.raises(ConfigError, match=r"weights.bits must be one of \[2, 3, 4, 8\], found 6"):
        load_recipe("w4", **{"weights.bits": 6})


def test_e6_recipes_differ_from_their_twins_only_in_the_embedding_width() -> None:
    for name in ("w3-s045", "w4"):
        plain, e6 = load_recipe(name).to_dict(), load_recipe(f"{name}-e6").to_dict()
        assert e6["weights"].pop("embedding_bits") == 6 and plain["weights"].pop("embedding_bits") is None
        assert e6.pop("name") == f"{name}-e6" and plain.pop("name") == name
        assert e6 == plain


def test_an_embedding_option_on_a_model_without_an_embedding_is_refused() -> None:
    class NoEmbedding(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)

    with pytest.raises(ModelError, match="no token embedding") as caught:
        embedding_names(NoEmbedding(), load_recipe("w4", **{"weights.embedding_bits": 4}))
    assert "embedding_bits" in (caught.value.hint or "")
    assert embedding_names(NoEmbedding(), load_recipe("w4")) == ()  # not asked for: nothing looked up


def test_source_dtype_of_gguf_and_of_a_config_only_directory(tmp_path: Path) -> None:
    assert source_dtype(ModelSource(kind="gguf", path=tmp_path / "m.gguf", model_id="m")) == torch.float16
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "bfloat16"}))
    assert source_dtype(ModelSource(kind="hf_dir", path=tmp_path, model_id="m")) == torch.bfloat16
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert source_dtype(ModelSource(kind="hf_dir", path=tmp_path, model_id="m")) == torch.float32


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--keep-dtype", "int8", "source', 'float32', 'bfloat16', 'float16"),
        ("--embedding-bits", "3", "[4, 6, 8, 'auto']"),
    ],
)
def test_cli_refuses_an_unknown_keep_dtype_or_embedding_width(
    tmp_path: Path, option: str, value: str, message: str
) -> None:
    result = CliRunner().invoke(app, ["compress", str(tmp_path / "none"), option, value, "-o", str(tmp_path / "o")])
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())
