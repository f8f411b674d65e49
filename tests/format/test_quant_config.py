"""config.json's ``quantization_config`` as one type: exact round trips, one strict check per loader, lenient
summaries that never fail on junk, and every loader refusing an unknown ``format_version`` with one message."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from squeeze import api
from squeeze.compression.writer import config_json
from squeeze.errors import FormatError
from squeeze.format import seal_artifact
from squeeze.format.quant_config import (
    FORMAT_VERSION,
    QuantizationConfig,
    check_format_version,
)

#: the one message (and hint) of every loader
VERSION_99 = (
    r"^quantization_config\.format_version is 99; this squeeze reads 1 \(hint: install the squeeze version that "
    r"wrote the artifact, or re-create it with this one\)$"
)

ENTRY = {"method": "squeeze", "bits": 4, "in_features": 8, "out_features": 16}
SECTION: dict[str, Any] = {
    "quant_method": "squeeze",
    "format_version": FORMAT_VERSION,
    "squeeze_version": "0.0.0",
    "method": "squeeze",
    "bits": 4,
    "target_bpw": None,
    "sensitive_fraction": 0.0045,
    "outlier_fraction": 0.0,
    "sensitivity": "fisher",
    "group_size": None,
    "lut_dtype": None,
    "bits_per_weight": 4.25,
    "modules": {
        "model.layers.0.mlp.up_proj": ENTRY,
        "model.layers.0.mlp.experts.down_proj": {**ENTRY, "experts": 4, "transposed": False},
    },
    "unquantized_dtype": "bfloat16",
    "embeddings": {"bits": 4, "modules": ["model.embed_tokens"], "tied": {"lm_head": "model.embed_tokens"}},
    "kv_cache": {"format": "int", "bits": 8, "layers": []},
}


@pytest.fixture(scope="module")
def tiny_w4(tmp_path_factory: pytest.TempPathFactory, compress_tiny: Callable[..., Path]) -> Path:
    return compress_tiny(tmp_path_factory.mktemp("qc") / "w4", "w4", overrides={"weights.sensitivity": "uniform"})


def _with_version(artifact: Path, target: Path, version: object) -> Path:
    """A copy of ``artifact`` whose config.json names ``version``, sealed again (only the version is wrong)."""
    shutil.copytree(artifact, target)
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"]["format_version"] = version
    (target / "config.json").write_text(json.dumps(config))
    seal_artifact(target)
    return target


@pytest.mark.parametrize(
    "section",
    [
        SECTION,
        {**SECTION, "future_key": {"a": [1, 2]}},  # a key this squeeze does not name is kept
        {k: v for k, v in SECTION.items() if k not in ("bits", "embeddings", "kv_cache", "unquantized_dtype")},
        {"quant_method": "squeeze", "format_version": 1, "squeeze_version": "x", "method": "none", "modules": {}},
    ],
)
def test_a_section_round_trips_exactly(section: dict[str, Any]) -> None:
    parsed = QuantizationConfig.from_dict(json.loads(json.dumps(section)))
    assert parsed.to_dict() == section
    assert config_json({"q": parsed.to_dict()}) == config_json({"q": section})  # the same bytes on disk


def test_written_artifact_config_round_trips_byte_for_byte(tiny_w4: Path) -> None:
    text = (tiny_w4 / "config.json").read_text()
    config = json.loads(text)
    parsed = QuantizationConfig.from_model_config(config)
    assert parsed is not None and parsed.summary is not None and parsed.summary.bits == 4
    assert config_json({**config, "quantization_config": parsed.to_dict()}) == text
    entry = parsed.modules["model.layers.0.mlp.up_proj"]
    assert (entry.method, entry.bits) == ("squeeze", 4) and entry.in_features > 0 and entry.out_features > 0
    assert entry.n_weights == entry.in_features * entry.out_features


def test_typed_entries() -> None:
    parsed = QuantizationConfig.from_dict(SECTION)
    experts = parsed.modules["model.layers.0.mlp.experts.down_proj"]
    assert experts.is_experts and experts.experts == 4 and not parsed.modules["model.layers.0.mlp.up_proj"].is_experts
    assert parsed.tied_heads == {"lm_head": "model.embed_tokens"}
    assert parsed.embeddings is not None and parsed.embeddings.modules == ("model.embed_tokens",)
    assert parsed.kv_cache == {"format": "int", "bits": 8, "layers": []}
    assert parsed.with_kv_cache({"bits": 4}).to_dict() == {**SECTION, "kv_cache": {"bits": 4}}
    assert QuantizationConfig.unquantized("9.9").to_dict() == {
        "quant_method": "squeeze",
        "format_version": 1,
        "squeeze_version": "9.9",
        "method": "none",
        "modules": {},
    }


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"format_version": 99}, VERSION_99),
        ({"format_version": None}, r"format_version is missing; this squeeze reads 1"),
        ({"format_version": True}, r"format_version is True; this squeeze reads 1"),
        ({"quant_method": "gptq"}, r"quant_method is 'gptq', not 'squeeze'"),
        ({"modules": [1]}, r"modules must map module names to objects"),
        ({"modules": {"a": 3}}, r"modules must map module names to objects"),
        ({"modules": {"a": {"bits": 4}}}, r"modules\['a'\]\.method must be a string, found None"),
        ({"embeddings": []}, r"embeddings must be an object"),
        ({"embeddings": {"tied": {"h": 1}}}, r"embeddings\.tied must map module names to module names"),
        ({"kv_cache": "int8"}, r"kv_cache must be an object"),
    ],
)
def test_strict_reading_refuses_what_no_loader_can_use(change: dict[str, Any], message: str) -> None:
    with pytest.raises(FormatError, match=message):
        QuantizationConfig.from_dict({**SECTION, **change})


@pytest.mark.parametrize(
    "junk",
    [
        [],
        {"quant_method": "squeeze"},
        {**SECTION, "format_version": 99, "modules": {"a": 1, "b": {"method": 3, "bits": "4"}}},
        {**SECTION, "embeddings": 7, "kv_cache": [], "modules": "x"},
    ],
)
def test_lenient_reading_never_fails(junk: Any) -> None:
    parsed = QuantizationConfig.from_dict(junk, strict=False)
    assert all(entry.bits in (0, 4) and isinstance(entry.method, str) for entry in parsed.modules.values())
    assert parsed.embeddings is None or parsed.embeddings.tied == {"lm_head": "model.embed_tokens"}
    if isinstance(junk, dict) and isinstance(junk.get("modules"), dict):
        assert [entry.method for entry in parsed.modules.values()] == ["", ""]  # junk entries read as empty
        assert [entry.bits for entry in parsed.modules.values()] == [0, 0]


def test_from_model_config_ignores_another_tools_section_and_refuses_a_non_object() -> None:
    assert QuantizationConfig.from_model_config({"model_type": "llama"}) is None
    assert QuantizationConfig.from_model_config({"quantization_config": {"quant_method": "gptq"}}) is None
    with pytest.raises(FormatError, match="quantization_config must be an object"):
        QuantizationConfig.from_model_config({"quantization_config": [1]})
    assert QuantizationConfig.from_model_config({"quantization_config": [1]}, strict=False) is None


def test_one_version_check() -> None:
    check_format_version(FORMAT_VERSION)
    for bad in (0, 2, 99, "1", 1.5, None):
        with pytest.raises(FormatError, match="this squeeze reads 1") as info:
            check_format_version(bad)
        assert info.value.hint == "install the squeeze version that wrote the artifact, or re-create it with this one"


def test_squeeze_load_refuses_version_99(tiny_w4: Path, tmp_path: Path) -> None:
    target = _with_version(tiny_w4, tmp_path / "v99", 99)
    with pytest.raises(FormatError, match=VERSION_99):
        api.load(target)
    with pytest.raises(FormatError, match=VERSION_99):  # unverified loading reads the same config the same way
        api.load(target, verify=False)


def test_generate_evaluate_and_serve_refuse_version_99(tiny_w4: Path, tmp_path: Path, tiny_text_file: Path) -> None:
    target = _with_version(tiny_w4, tmp_path / "v99", 99)
    with pytest.raises(FormatError, match=VERSION_99):
        api.generate(target, "Once upon a time", max_new_tokens=2)
    with pytest.raises(FormatError, match=VERSION_99):
        api.evaluate(target, tiny_text_file, seq_len=32, max_windows=1)
    with pytest.raises(FormatError, match=VERSION_99):
        api.serve_engine(target, config=api.EngineConfig(kv_memory_bytes=1 << 20))


def test_from_pretrained_refuses_version_99(tiny_w4: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    import squeeze.runtime.hf  # noqa: F401 - registers the quantizer now

    target = _with_version(tiny_w4, tmp_path / "v99", 99)
    with pytest.raises(FormatError, match=VERSION_99):
        AutoModelForCausalLM.from_pretrained(target)


def test_vllm_config_refuses_version_99(tiny_w4: Path) -> None:
    from squeeze.integrations.vllm.artifact import parse_quant_config  # no vLLM import

    section = json.loads((tiny_w4 / "config.json").read_text())["quantization_config"]
    assert parse_quant_config(section).modules
    with pytest.raises(FormatError, match=VERSION_99):
        parse_quant_config({**section, "format_version": 99})
