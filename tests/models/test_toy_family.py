"""A model family registered from outside squeeze (tests/toy_family.py, one ModelFamily) is quantized by the
built-in recipes, streams under --max-memory to the in-memory run's bytes (its parts, and its position
embeddings before the blocks), and loads; without it, OPT's own linears are not default targets and
--max-memory / --device refuse its shape. The family registry's acceptance test.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from squeeze import api
from squeeze.config import load_recipe
from squeeze.errors import ConfigError
from squeeze.models import families
from squeeze.runtime.linear import SqueezeLinear
from toy_family import TOY_OPT


@pytest.fixture(scope="module")
def tiny_opt_dir(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer: Any) -> Path:
    """A random (seeded) 2-layer OPTForCausalLM, hidden 64, saved with the tiny tokenizer."""
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    config = OPTConfig(
        vocab_size=len(tiny_tokenizer),
        hidden_size=64,
        word_embed_proj_dim=64,
        num_hidden_layers=2,
        ffn_dim=128,
        num_attention_heads=4,
        max_position_embeddings=128,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    directory = tmp_path_factory.mktemp("tiny-opt") / "opt"
    OPTForCausalLM(config).eval().save_pretrained(directory)
    tiny_tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture()
def toy_family() -> Iterator[families.ModelFamily]:
    """The toy family registered for one test, then removed again."""
    families.register_family(TOY_OPT)
    try:
        yield TOY_OPT
    finally:
        families.unregister_family(TOY_OPT.name)


def _opt(directory: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory).eval()


def test_without_the_family_opt_keeps_its_linears_and_cannot_stream(tiny_opt_dir: Path, tmp_path: Path) -> None:
    assert not {"out_proj", "fc1", "fc2"} & set(load_recipe("w4").weights.targets)
    assert families.family_of(_opt(tiny_opt_dir)) is families.DECODER
    with pytest.raises(ConfigError, match="shaped like Llama") as caught:
        families.model_parts(_opt(tiny_opt_dir))
    assert "A new model family" in (caught.value.hint or "")


def test_the_family_adds_its_projections_to_every_recipe(toy_family: families.ModelFamily) -> None:
    targets = load_recipe("w4").weights.targets
    assert targets[: len(families.DEFAULT_TARGETS)] == families.DEFAULT_TARGETS
    assert targets[len(families.DEFAULT_TARGETS) :] == ("out_proj", "fc1", "fc2")
    assert families.takes_fast_path("opt") is False and families.takes_fast_path("llama") is True
    with pytest.raises(ValueError, match="already"):
        families.register_family(TOY_OPT)


def test_the_family_splits_opt_into_its_parts(toy_family: families.ModelFamily, tiny_opt_dir: Path) -> None:
    model = _opt(tiny_opt_dir)
    embed, blocks, norm, head = families.model_parts(model, "--device")
    decoder = model.get_decoder()
    assert (embed, blocks, norm, head) == (
        decoder.embed_tokens,
        decoder.layers,
        decoder.final_layer_norm,
        model.lm_head,
    )


def test_a_toy_family_compresses_streams_and_loads(
    toy_family: families.ModelFamily,
    tiny_opt_dir: Path,
    tmp_path: Path,
    compress_tiny: Any,
) -> None:
    artifact = compress_tiny(tmp_path / "opt-w4", "w4", source=tiny_opt_dir)  # Fisher-calibrated
    bounded = compress_tiny(tmp_path / "bounded", "w4", source=tiny_opt_dir, max_memory="64GB")  # streamed
    shards = sorted(artifact.glob("*.safetensors"))
    assert shards and all((bounded / p.name).read_bytes() == p.read_bytes() for p in shards)  # block by block
    loaded = api.load(artifact)
    linears = {n: m for n, m in loaded.model.named_modules() if isinstance(m, SqueezeLinear)}
    suffixes = sorted({name.rsplit(".", 1)[-1] for name in linears})
    assert suffixes == ["fc1", "fc2", "k_proj", "out_proj", "q_proj", "v_proj"] and len(linears) == 12

    reference = _opt(tiny_opt_dir)
    for name, module in linears.items():
        reference.get_submodule(name).weight.data = module.dequantize()
    ids = torch.tensor([[1, 40, 41, 42, 43, 44]])
    with torch.no_grad():
        assert (loaded.model(ids).logits - reference(ids).logits).abs().max() < 1e-4


def test_a_family_s_fused_groups_share_one_budget_setting() -> None:
    from squeeze.compression.bit_budget import fused_units

    names = ["l.0.q_proj", "l.0.k_proj", "l.0.v_proj", "l.0.fc1", "l.0.fc2"]
    assert fused_units(names) == [("l.0.q_proj", "l.0.k_proj", "l.0.v_proj"), ("l.0.fc1",), ("l.0.fc2",)]
    families.register_family(families.ModelFamily(name="toy-fused", fused=(("fc1", "fc2"),)))
    try:
        assert fused_units(names) == [("l.0.q_proj", "l.0.k_proj", "l.0.v_proj"), ("l.0.fc1", "l.0.fc2")]
    finally:
        families.unregister_family("toy-fused")
    assert fused_units(names)[-1] == ("l.0.fc2",)
