"""The artifact as the vLLM plugin reads it (vLLM not needed): the quantization config checked per module, the
roles each module stores read from verified headers, tensors served from the hashed bytes."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from squeeze import api
from squeeze.errors import FormatError, IntegrityError
from squeeze.format.manifest import MANIFEST_NAME
from squeeze.format.quant_config import QuantizationConfig
from squeeze.integrations.vllm.artifact import (
    check_quant_config,
    checkpoint_modules,
    checkpoint_renames,
    fp8_kv_scales,
    module_specs,
    renamed,
    verified_tensors,
    verify,
)
from squeeze.quant.kv_file import KV_FILE

GOOD = {
    "quant_method": "squeeze",
    "format_version": 1,
    "modules": {"m.q_proj": {"method": "squeeze", "bits": 4, "in_features": 8, "out_features": 8}},
}


@pytest.fixture(scope="module")
def tiny_w3(
    tmp_path_factory: pytest.TempPathFactory, compress_tiny: Callable[..., Path], tinystories_file: Path
) -> Path:
    """The tiny Llama at 3 bits with a sparse part, its KV cache calibrated (int8)."""
    out = compress_tiny(tmp_path_factory.mktemp("vllm-artifact") / "w3", recipe="w3-s045")
    api.calibrate_kv(out, tinystories_file, bits=8, calibration_overrides={"num_samples": 2, "seq_len": 64})
    return out


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"format_version": 9}, "format_version is 9; this squeeze reads 1"),
        ({"quant_method": "gptq"}, "quant_method is 'gptq', not 'squeeze'"),
        ({"modules": []}, "modules must map module names to objects"),
        (
            {"modules": {"m.o_proj": {"method": "squeeze-v9", "bits": 4, "in_features": 8, "out_features": 8}}},
            r"modules\['m.o_proj'\].method is 'squeeze-v9', which this squeeze cannot run",
        ),
        (
            {"modules": {"m.o_proj": {"method": "squeeze", "bits": 5, "in_features": 8, "out_features": 8}}},
            r"modules\['m.o_proj'\].bits",
        ),
        (
            {"modules": {"m.o_proj": {"method": "squeeze", "bits": 4, "in_features": "8", "out_features": 8}}},
            r"modules\['m.o_proj'\].in_features must be an integer >= 1, found '8'",  # ModuleEntry's check
        ),
        (  # an expert parameter's layout, checked from the config alone
            {
                "modules": {
                    "m.experts.gate_up_proj": {
                        **{"method": "squeeze", "bits": 4, "in_features": 8, "out_features": 32},
                        **{"experts": 0, "transposed": False},
                    }
                }
            },
            r"modules\['m.experts.gate_up_proj'\].experts must be an integer >= 1, found 0",
        ),
        (
            {"embeddings": {"bits": 4, "modules": ["m.embed_tokens"], "tied": ["lm_head"]}},
            "quantization_config.embeddings.tied must map module names to module names",
        ),
        (
            {"embeddings": {"bits": 4, "modules": "m.embed_tokens", "tied": {}}},
            "quantization_config.embeddings.modules must be a list of module names",
        ),
    ],
)
def test_bad_quantization_configs_name_what_is_wrong(change: dict, message: str) -> None:
    with pytest.raises(FormatError, match=message):
        check_quant_config({**GOOD, **change})


def test_a_good_config_gives_its_modules() -> None:
    assert check_quant_config(GOOD) == GOOD["modules"]
    # MoE experts and quantized embeddings are served (tests/integrations/vllm/test_vllm_moe.py)
    experts = {"method": "squeeze", "bits": 4, "in_features": 8, "out_features": 32, "experts": 4}
    embeddings = {"bits": 4, "modules": ["m.embed"], "tied": {"lm_head": "m.embed"}}
    moe = {**GOOD, "modules": {"m.experts.down_proj": experts}, "embeddings": embeddings}
    assert check_quant_config(moe) == moe["modules"]


def test_transformers_renamed_modules_get_vllms_names_back() -> None:
    # transformers 5 loads Mixtral's block_sparse_moe as mlp; vLLM's Mixtral reads the checkpoint's names
    renames = checkpoint_renames("mixtral")
    assert renames == ((".mlp.", ".block_sparse_moe."),)
    name = "model.layers.3.mlp.experts.gate_up_proj.weight_packed"
    assert renamed(name, renames) == "model.layers.3.block_sparse_moe.experts.gate_up_proj.weight_packed"
    assert checkpoint_renames("qwen3_moe") == checkpoint_renames("llama") == checkpoint_renames(None) == ()


def test_fused_layers_expand_by_the_models_mapping() -> None:
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    assert checkpoint_modules("model.layers.3.self_attn.qkv_proj", packed) == (
        "model.layers.3.self_attn.q_proj",
        "model.layers.3.self_attn.k_proj",
        "model.layers.3.self_attn.v_proj",
    )
    assert checkpoint_modules("model.layers.3.mlp.down_proj", packed) == ("model.layers.3.mlp.down_proj",)
    assert checkpoint_modules("gate_up_proj", packed) == ("gate_proj", "up_proj")


def test_module_roles_come_from_the_verified_headers(tiny_w3: Path) -> None:
    report = verify(tiny_w3)
    quant = QuantizationConfig.from_model_config(json.loads((tiny_w3 / "config.json").read_text()))
    assert quant is not None
    modules = dict(quant.modules)
    specs = module_specs(
        report, check_quant_config(json.loads((tiny_w3 / "config.json").read_text())["quantization_config"])
    )
    assert set(specs.roles) == set(modules)
    roles = specs.roles["model.layers.0.mlp.down_proj"]
    assert roles["weight_packed"] == "U8" and roles["weight_lut"] == "F16"
    assert {"weight_sparse_rowptr", "weight_sparse_cols", "weight_sparse_vals"} <= roles.keys()
    with pytest.raises(FormatError, match="names module 'model.layers.9.mlp.up_proj', but the artifact has no tensors"):
        module_specs(report, {**modules, "model.layers.9.mlp.up_proj": {}})


def test_tensors_are_the_hashed_bytes_without_the_kv_file(tiny_w3: Path) -> None:
    report = verify(tiny_w3, capture=True)
    tensors = dict(verified_tensors(report))
    assert KV_FILE in report.headers and not any(name in tensors for name in report.headers[KV_FILE].tensors)
    loaded = api.load(tiny_w3)
    packed = tensors["model.layers.1.self_attn.o_proj.weight_packed"]
    assert torch.equal(packed, loaded.model.model.layers[1].self_attn.o_proj.weight_packed)
    # views into the captured bytes: no second read of the file
    data = next(h.data for p, h in report.captured.items() if p.endswith(".safetensors") and p != KV_FILE)
    assert packed.untyped_storage().data_ptr() == data.untyped_storage().data_ptr()


def test_a_tampered_artifact_is_refused_before_any_tensor(tiny_w3: Path, tmp_path: Path) -> None:
    copy = shutil.copytree(tiny_w3, tmp_path / "copy")
    shard = next(p for p in copy.glob("model-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="failed verification"):
        verify(copy, capture=True)
    (copy / MANIFEST_NAME).unlink()
    with pytest.raises((IntegrityError, FormatError)):
        verify(copy)


def test_fp8_kv_scales_come_from_the_verified_kv_file(tiny_w3: Path, tmp_path: Path, tinystories_file: Path) -> None:
    section = json.loads((tiny_w3 / "config.json").read_text())["quantization_config"]["kv_cache"]
    assert fp8_kv_scales(verify(tiny_w3), section) == {}  # int8 grids: not vLLM's to use
    copy = shutil.copytree(tiny_w3, tmp_path / "fp8")
    api.calibrate_kv(copy, tinystories_file, bits="fp8", calibration_overrides={"num_samples": 2, "seq_len": 64})
    section = json.loads((copy / "config.json").read_text())["quantization_config"]["kv_cache"]
    report = verify(copy)
    assert set(report.captured) == {KV_FILE}  # only the small KV file is kept, as hashed
    scales = fp8_kv_scales(report, section)
    stored = load_file(copy / KV_FILE)
    assert scales == {
        f"model.layers.{i}.self_attn": (
            float(stored[f"model.layers.{i}.self_attn.k_scale"]),
            float(stored[f"model.layers.{i}.self_attn.v_scale"]),
        )
        for i in range(2)
    }
    assert all(k > 0 and v > 0 for k, v in scales.values())
