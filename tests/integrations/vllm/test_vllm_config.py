"""The vLLM quantization config on its own (skipped without vLLM): registration, and what it refuses early."""

from __future__ import annotations

import pytest
from torch import nn

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/check_vllm.sh builds an environment with it)")

from squeeze.errors import FormatError  # noqa: E402
from squeeze.integrations.vllm import register  # noqa: E402
from squeeze.integrations.vllm.artifact import ModuleSpecs  # noqa: E402
from squeeze.integrations.vllm.quant_method import SqueezeVllmConfig  # noqa: E402

ENTRY = {"method": "squeeze", "bits": 4, "in_features": 8, "out_features": 8}


def config(modules: dict) -> SqueezeVllmConfig:
    return SqueezeVllmConfig.from_config({"quant_method": "squeeze", "format_version": 1, "modules": modules})


def test_register_makes_squeeze_a_vllm_quantization_method_and_load_format() -> None:
    from vllm.model_executor.layers.quantization import get_quantization_config
    from vllm.model_executor.model_loader import get_model_loader

    register()
    register()  # vLLM loads plugins in every process, sometimes twice: idempotent
    assert get_quantization_config("squeeze") is SqueezeVllmConfig
    load_config = type("LoadConfig", (), {"load_format": "squeeze", "model_loader_extra_config": {}})()
    assert type(get_model_loader(load_config)).__name__ == "SqueezeModelLoader"


def test_the_config_names_itself_and_accepts_every_activation_dtype() -> None:
    import torch

    cfg = config({"m.q_proj": ENTRY})
    assert cfg.get_name() == "squeeze" and cfg.get_config_filenames() == []
    assert set(cfg.get_supported_act_dtypes()) == {torch.bfloat16, torch.float16, torch.float32}


def test_a_future_method_is_refused_from_the_config_alone() -> None:
    with pytest.raises(FormatError, match=r"modules\['m.o_proj'\].method is 'squeeze-v9'"):
        config({"m.o_proj": {**ENTRY, "method": "squeeze-v9"}})


def test_layers_other_than_linears_are_left_to_vllm_unless_the_artifact_quantized_them() -> None:
    cfg = config({"model.layers.0.mlp.experts.0.up_proj": ENTRY})
    cfg.specs = ModuleSpecs(modules=cfg.modules, roles={name: {"weight_packed": "U8"} for name in cfg.modules})
    assert cfg.get_quant_method(nn.Module(), "model.embed_tokens") is None
    with pytest.raises(FormatError, match="vLLM builds into its Module model.layers.0.mlp.experts; the squeeze vLLM"):
        cfg.get_quant_method(nn.Module(), "model.layers.0.mlp.experts")


def test_module_names_follow_the_models_renames() -> None:
    from vllm.model_executor.models.utils import WeightsMapper

    cfg = config({"model.layers.0.mlp.up_proj": ENTRY})
    cfg.apply_vllm_mapper(WeightsMapper(orig_to_new_prefix={"model.": "language_model.model."}))
    assert list(cfg.modules) == ["language_model.model.layers.0.mlp.up_proj"]


def test_without_the_models_path_the_artifact_cannot_be_verified_and_nothing_is_built() -> None:
    with pytest.raises(FormatError, match="needs the model's path to verify the artifact"):
        config({"m.q_proj": ENTRY}).get_quant_method(nn.Module(), "m.q_proj")


def test_a_moe_layers_expert_parameters_are_found_and_odd_layouts_refused() -> None:
    from squeeze.integrations.vllm.moe import expert_modules

    experts = {**ENTRY, "out_features": 32, "experts": 4}
    prefix = "model.layers.0.mlp.experts"
    both = {f"{prefix}.gate_up_proj": experts, f"{prefix}.down_proj": experts}

    def specs(modules: dict) -> ModuleSpecs:
        return ModuleSpecs(modules=modules, roles={name: {"weight_packed": "U8"} for name in modules})

    assert expert_modules(specs(both), prefix) == {
        "gate_up_proj": f"{prefix}.gate_up_proj",
        "down_proj": f"{prefix}.down_proj",
    }
    assert expert_modules(specs(both), "model.layers.1.mlp.experts") == {}  # a layer the artifact keeps: vLLM's own
    with pytest.raises(
        FormatError, match=r"experts of model.layers.0.mlp.experts as one fused layer, but the artifact "
    ):
        expert_modules(specs({f"{prefix}.gate_up_proj": experts}), prefix)
    with pytest.raises(FormatError, match="down_proj: the artifact's experts are transposed"):
        expert_modules(specs({**both, f"{prefix}.down_proj": {**experts, "transposed": True}}), prefix)
    with pytest.raises(FormatError, match="is not an expert parameter"):
        expert_modules(specs({**both, f"{prefix}.down_proj": ENTRY}), prefix)


def test_tied_heads_follow_the_renames() -> None:
    cfg = SqueezeVllmConfig.from_config(
        {
            "quant_method": "squeeze",
            "format_version": 1,
            "modules": {"model.embed_tokens": ENTRY},
            "embeddings": {"bits": 4, "modules": ["model.embed_tokens"], "tied": {"lm_head": "model.embed_tokens"}},
        }
    )
    assert cfg.tied == {"lm_head": "model.embed_tokens"}
    from vllm.model_executor.models.utils import WeightsMapper

    cfg.apply_vllm_mapper(WeightsMapper(orig_to_new_prefix={"model.": "language_model.model."}))
    assert cfg.tied == {"lm_head": "language_model.model.embed_tokens"}
