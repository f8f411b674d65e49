"""Typed quantization_config entries (squeeze.format.quant_entries): every field checked once when the config
is read, loaders iterate the typed entries, and an artifact's config.json is the same bytes as before the
entries were typed (golden: tests/data/quant_config_golden.json, written by the untyped code on main)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from squeeze import api
from squeeze.config import load_recipe
from squeeze.errors import FormatError
from squeeze.format.quant_config import KVCacheEntry, ModuleEntry, QuantizationConfig
from squeeze.runtime.loader import quantized_weight_from
from squeeze.version import __version__

GOLDEN = Path(__file__).parents[1] / "data" / "quant_config_golden.json"
LINEAR = {"method": "rtn", "bits": 4, "in_features": 64, "out_features": 32, "group_size": 64}
EXPERT = {"method": "squeeze", "bits": 3, "in_features": 8, "out_features": 64, "experts": 4, "transposed": True}


def _masked(text: str) -> str:
    """config.json's text without what depends on where the test ran: the source directory's path, and the hash
    of the calibration spec (which holds the text file's absolute path)."""
    return re.sub(r'"(_name_or_path|calibration_hash)": "[^"]*"', r'"\1": "-"', text)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path, tiny_text_file: Path) -> dict[str, Path]:
    """The artifacts the golden configs were written from: RTN with int8 embeddings and an int8 KV cache, and
    an int8-LUT w4 without calibration."""
    root = tmp_path_factory.mktemp("golden-configs")
    made = {}
    for key, recipe in {
        "rtn-w4-e8": load_recipe("rtn-w4", **{"weights.embedding_bits": 8}),
        "w4-uniform-lut8": load_recipe("w4-lut8", **{"weights.sensitivity": "uniform"}),
    }.items():
        api.compress(str(tiny_llama_dir), root / key, recipe)
        made[key] = root / key
    api.calibrate_kv(made["rtn-w4-e8"], tiny_text_file, bits=8, calibration_overrides={"num_samples": 2, "seq_len": 32})
    return made


def test_written_config_json_is_unchanged(artifacts: dict[str, Path]) -> None:
    golden = json.loads(GOLDEN.read_text(encoding="utf-8"))
    assert sorted(golden) == sorted(artifacts)
    for key, directory in artifacts.items():
        assert json.loads(golden[key])["quantization_config"]["squeeze_version"] == __version__
        text = (directory / "config.json").read_text(encoding="utf-8")
        assert _masked(text).count('"-"') == _masked(golden[key]).count('"-"') >= 1
        assert _masked(text) == _masked(golden[key]), key  # byte for byte but the two masked values


def test_config_round_trips_through_the_typed_entries(artifacts: dict[str, Path]) -> None:
    for directory in artifacts.values():
        section = json.loads((directory / "config.json").read_text(encoding="utf-8"))["quantization_config"]
        quant = QuantizationConfig.from_dict(section)
        assert json.dumps(quant.to_dict(), sort_keys=True) == json.dumps(section, sort_keys=True)
        assert all(type(entry) is ModuleEntry for entry in quant.modules.values())
    kv = QuantizationConfig.from_dict(
        json.loads((artifacts["rtn-w4-e8"] / "config.json").read_text())["quantization_config"]
    ).kv_cache
    assert isinstance(kv, KVCacheEntry)
    assert (kv.format, kv.bits, kv.calibration, kv.file) == ("int", 8, "tiny_stories.txt", "kv_cache.safetensors")


def test_module_entry_fields_are_typed() -> None:
    linear = ModuleEntry.from_dict("m.q_proj", dict(LINEAR))
    assert (linear.method, linear.bits, linear.in_features, linear.out_features) == ("rtn", 4, 64, 32)
    assert linear.params == {"group_size": 64} and linear.layout is None and linear.n_weights == 64 * 32
    assert linear.to_dict() == LINEAR and list(linear.to_dict()) == list(LINEAR) and dict(linear) == LINEAR
    expert = ModuleEntry.from_dict("m.experts.down_proj", dict(EXPERT))
    assert expert.is_experts and expert.layout == (4, True)
    assert expert.format_spec() == {k: v for k, v in EXPERT.items() if k not in ("experts", "transposed")}


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"bits": 4, "in_features": 8}, r"method must be a string, found None"),
        ({"method": "rtn", "in_features": 8}, r"lacks 'bits'"),
        ({"method": "rtn", "bits": 4}, r"lacks 'in_features'"),
        ({**LINEAR, "bits": True}, r"bits must be an integer >= 1, found True"),
        ({**LINEAR, "out_features": 0}, r"out_features must be an integer >= 1, found 0"),
        ({**EXPERT, "experts": "4"}, r"experts must be an integer >= 1, found '4'"),
        ({**EXPERT, "transposed": 1}, r"transposed must be true or false, found 1"),
        ({**LINEAR, "transposed": False}, r"has 'transposed' but no 'experts'"),
    ],
)
def test_a_bad_module_entry_is_refused_when_the_config_is_read(entry: dict[str, Any], message: str) -> None:
    section = {"quant_method": "squeeze", "format_version": 1, "modules": {"m.x": entry}}
    with pytest.raises(FormatError, match=message) as caught:
        QuantizationConfig.from_dict(section)
    assert "re-create it with squeeze compress" in (caught.value.hint or "")
    assert QuantizationConfig.from_dict(section, strict=False).modules["m.x"] is not None  # summaries never fail


@pytest.mark.parametrize(
    ("kv", "message"),
    [("int8", r"kv_cache must be an object"), ({"bits": 8, "file": 3}, r"kv_cache\.file has the wrong type: 3")],
)
def test_a_bad_kv_entry_is_refused_when_the_config_is_read(kv: object, message: str) -> None:
    with pytest.raises(FormatError, match=message):
        QuantizationConfig.from_dict({"quant_method": "squeeze", "format_version": 1, "modules": {}, "kv_cache": kv})


def test_a_key_the_format_does_not_define_is_refused_by_the_loader() -> None:
    entry = ModuleEntry.from_dict("m.q_proj", {**LINEAR, "lut_bits": 8})
    assert entry.params == {"group_size": 64, "lut_bits": 8}  # the format's own keys: its registry knows them
    with pytest.raises(FormatError, match=r"has keys \['lut_bits'\] that method rtn does not define") as caught:
        quantized_weight_from({}, "m.q_proj", entry.format_spec())
    assert caught.value.hint
