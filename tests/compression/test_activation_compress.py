"""compress with ``weights.sensitivity: activation``: plain, --max-memory and resumed runs give the same bytes."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from squeeze.compression import quantize
from squeeze.compression.job import RecipeNeeds
from squeeze.config import load_recipe
from squeeze.errors import ConfigError, ResumeError
from squeeze.format.manifest import MANIFEST_NAME

ACTIVATION = {"weights.sensitivity": "activation"}
BUDGET = "64GB"  # above any estimate here: the run streams


def _files(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _same_artifact(got: Path, want: Path) -> bool:
    files, expected = _files(got), _files(want)
    manifests = [json.loads(f[MANIFEST_NAME]) for f in (files, expected)]
    for m in manifests:
        m.pop("created"), m.pop("root_digest")
    plain = {k: v for k, v in files.items() if k != MANIFEST_NAME}
    return plain == {k: v for k, v in expected.items() if k != MANIFEST_NAME} and manifests[0] == manifests[1]


def _shards(directory: Path) -> dict[str, bytes]:
    return {k: v for k, v in _files(directory).items() if k.endswith(".safetensors")}


def test_the_recipe_takes_activation_and_refuses_an_unknown_sensitivity() -> None:
    needs = RecipeNeeds.of(load_recipe("w4", **ACTIVATION))
    assert needs.fisher and needs.activation and needs.calibration
    assert not RecipeNeeds.of(load_recipe("w4")).activation
    with pytest.raises(ConfigError, match=r"weights.sensitivity must be one of \['fisher', 'activation', 'uniform'\]"):
        load_recipe("w4", **{"weights.sensitivity": "hessian"})


@pytest.mark.parametrize(
    "overrides", [{}, {"weights.embedding_bits": 4}, {"weights.sensitive_fraction": 0.005}], ids=["w4", "e4", "s05"]
)
def test_plain_and_bounded_runs_give_identical_bytes(
    overrides: dict[str, Any], tmp_path: Path, compress_tiny: Callable[..., Path]
) -> None:
    recipe = {**ACTIVATION, **overrides}
    plain = compress_tiny(tmp_path / "plain", overrides=recipe)
    bounded = compress_tiny(tmp_path / "bounded", overrides=recipe, max_memory=BUDGET)
    assert _same_artifact(bounded, plain)
    # the weighting is used: the codes differ from the Fisher's and from plain k-means
    fisher = compress_tiny(tmp_path / "fisher", overrides=overrides)
    uniform = compress_tiny(tmp_path / "uniform", overrides={**overrides, "weights.sensitivity": "uniform"})
    assert _shards(plain) != _shards(fisher) and _shards(plain) != _shards(uniform)


def test_a_run_makes_no_backward(
    tmp_path: Path, compress_tiny: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_backward(*_args: Any, **_kwargs: Any) -> None:
        raise AssertionError("the activation sensitivity ran a backward")

    monkeypatch.setattr(torch.Tensor, "backward", no_backward)
    monkeypatch.setattr(torch.autograd, "backward", no_backward)
    compress_tiny(tmp_path / "plain", overrides=ACTIVATION)
    compress_tiny(tmp_path / "bounded", overrides=ACTIVATION, max_memory=BUDGET)


@pytest.mark.parametrize("bounded", [False, True], ids=["plain", "bounded"])
def test_an_interrupted_run_resumes_to_identical_bytes_and_refuses_another_sensitivity(
    bounded: bool, tmp_path: Path, compress_tiny: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    memory = {"max_memory": BUDGET} if bounded else {}
    reference = compress_tiny(tmp_path / "ref", overrides=ACTIVATION)
    out = tmp_path / "art"
    real_group = quantize.quantize_group
    calls: list[int] = []

    def die_on_second(job: Any, names: list[str]) -> Any:
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_group(job, names)

    monkeypatch.setattr(quantize, "quantize_group", die_on_second)
    with pytest.raises(KeyboardInterrupt):
        compress_tiny(out, overrides=ACTIVATION, **memory)
    monkeypatch.setattr(quantize, "quantize_group", real_group)
    with pytest.raises(ResumeError, match="sensitivity"):
        compress_tiny(out, overrides={"weights.sensitivity": "fisher"}, **memory)
    compress_tiny(out, overrides=ACTIVATION, **memory)
    assert _same_artifact(out, reference)


def test_a_device_run_gives_the_host_bytes(tmp_path: Path, compress_tiny: Callable[..., Path]) -> None:
    # --device cpu takes the block-by-block path of the plain pipeline and moves nothing: the same bits
    plain = compress_tiny(tmp_path / "plain", overrides=ACTIVATION)
    device = compress_tiny(tmp_path / "device", overrides=ACTIVATION, device="cpu")
    assert _shards(device) == _shards(plain)


def test_expert_parameters_get_uniform_weights_and_stream_to_the_same_bytes(
    tmp_path: Path, tiny_tokenizer: Any, tiny_text_file: Path, compress_tiny: Callable[..., Path]
) -> None:
    import transformers as tf
    from safetensors.torch import load_file

    from squeeze.compression.quantize import quantize_module
    from squeeze.models.expert_params import stack_experts

    dims = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4}
    config = tf.Qwen3MoeConfig(
        **dims,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        vocab_size=len(tiny_tokenizer),
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    source = tmp_path / "moe"
    model.save_pretrained(source)
    tiny_tokenizer.save_pretrained(source)
    plain = compress_tiny(tmp_path / "plain", source=source, overrides=ACTIVATION)
    bounded = compress_tiny(tmp_path / "bounded", source=source, overrides=ACTIVATION, max_memory=BUDGET)
    assert _same_artifact(bounded, plain)
    spec = json.loads((plain / "config.json").read_text())["quantization_config"]["modules"]
    name = "model.layers.1.mlp.experts.down_proj"
    assert spec[name]["experts"] == 4
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(plain.glob("*.safetensors")):
        tensors.update(load_file(shard))
    param = model.model.layers[1].mlp.experts.down_proj.detach().float()
    matrix = stack_experts(param, bool(spec[name].get("transposed", False)))  # (E*out, in), as quantized
    want = quantize_module(matrix, None, load_recipe("w4"))  # plain k-means: the uniform rule
    for key, tensor in want.to_tensors(name).items():
        assert torch.equal(tensors[key], tensor), key


def test_a_torchrun_world_is_refused_in_one_line() -> None:
    from squeeze.compression.distributed import World, check_world_options

    check_world_options(World(rank=0, size=1), error_compensation=False, activation=True)  # one process: fine
    with pytest.raises(ConfigError, match="activation runs in one process, found a torchrun world of 2 ranks"):
        check_world_options(World(rank=1, size=2), error_compensation=False, activation=True)
