"""The vLLM quantization config on its own (skipped without vLLM): registration, and what it refuses early."""

from __future__ import annotations

import pytest
from torch import nn

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/check_vllm.sh builds an environment with it)")

from squeeze.errors import FormatError  # noqa: E402
from squeeze.integrations.vllm import register  # noqa: E402
from squeeze.integrations.vllm.artifact import ModuleSpecs  # noqa: E402
from squeeze.integrations.vllm.config import SqueezeVllmConfig  # noqa: E402

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
