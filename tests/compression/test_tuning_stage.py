"""compress with weights.tuning on stories260K: an ordinary artifact with the same codes and better values; a
run killed mid-block resumes to the same bytes; a diverging block is refused and warned; bad recipes fail at
validation; a --max-memory run writes the unbounded run's bytes."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

import squeeze.compression.tuning_stage as tuning_stage
import squeeze.quant.tuning as tuning_math
from squeeze import api
from squeeze.compression.workarea import WORK_NAME
from squeeze.config import load_recipe
from squeeze.errors import ConfigError, Interrupted
from squeeze.format.manifest import MANIFEST_NAME
from squeeze.quant.tuning import TuningDivergedWarning

CALIB = {"num_samples": 4, "seq_len": 64}
TUNING = {"steps": 16, "lr": 1e-3, "tokens": 4 * 64, "seed": 0}


def compress(stories_dir: Path, text: Path, out: Path, tuned: bool = True, **kwargs: Any) -> Path:
    recipe = load_recipe("w3", **({"weights.tuning": TUNING} if tuned else {}))
    api.compress(str(stories_dir), out, recipe, str(text), calibration_overrides=CALIB, **kwargs)
    return out


def files(directory: Path) -> dict[str, bytes]:
    return {
        p.relative_to(directory).as_posix(): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != MANIFEST_NAME
    }


def tensors(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(directory.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as handle:
            out.update({name: handle.get_tensor(name) for name in handle.keys()})  # noqa: SIM118
    return out


@pytest.fixture(scope="module")
def plain(tmp_path_factory, stories_dir, tinystories_file) -> Path:
    return compress(stories_dir, tinystories_file, tmp_path_factory.mktemp("plain") / "w3", tuned=False)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory, stories_dir, tinystories_file) -> Path:
    return compress(stories_dir, tinystories_file, tmp_path_factory.mktemp("tuned") / "w3-tuned")


def _same_partition(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether codes ``a`` and ``b`` (R, N) group every row's weights the same way (a relabelling per row)."""
    for row_a, row_b in zip(a.tolist(), b.tolist(), strict=True):
        pairs = set(zip(row_a, row_b, strict=True))
        if not len(pairs) == len({x for x, _ in pairs}) == len({y for _, y in pairs}):
            return False
    return True


def test_tuned_artifact_keeps_codes_and_format_and_is_closer_to_the_original(plain, tuned, tinystories_file):
    from squeeze.quant.packing import unpack_codes

    assert api.verify_model_integrity(tuned).ok
    got, base = tensors(tuned), tensors(plain)
    assert {k: (v.dtype, v.shape) for k, v in got.items()} == {k: (v.dtype, v.shape) for k, v in base.items()}
    config = json.loads((tuned / "config.json").read_text())["quantization_config"]
    assert config["modules"] == json.loads((plain / "config.json").read_text())["quantization_config"]["modules"]
    luts = [name for name in got if name.endswith(".weight_lut")]
    assert any(not torch.equal(got[name], base[name]) for name in luts)  # the levels moved
    for name in luts:
        module = name.removesuffix(".weight_lut")
        in_features = config["modules"][module]["in_features"]
        codes = [unpack_codes(t[f"{module}.weight_packed"], 3, in_features) for t in (got, base)]
        assert _same_partition(*codes), module  # the same weights share a level as before
    norms = [name for name in got if "layernorm" in name]
    assert norms and any(not torch.equal(got[name], base[name]) for name in norms)  # the gains moved too
    for name in got:  # everything else is untouched
        if name not in luts and name not in norms and not name.endswith(".weight_packed"):
            assert torch.equal(got[name], base[name]), name
    text = str(tinystories_file)
    scores = {
        key: api.evaluate(str(path), text, seq_len=64, max_windows=8).result.perplexity
        for key, path in (("tuned", tuned), ("plain", plain))
    }
    assert scores["tuned"] < scores["plain"], scores


def test_a_run_killed_mid_block_resumes_to_identical_bytes(tuned, tmp_path, stories_dir, tinystories_file, monkeypatch):
    out = tmp_path / "out"
    real = tuning_stage.tune_block
    calls = {"blocks": 0}

    def interrupted_in_block_three(*args: Any, **kwargs: Any) -> Any:
        calls["blocks"] += 1
        if calls["blocks"] == 3:
            inputs, reads = kwargs["inputs"], {"n": 0}

            def reader(w: int) -> torch.Tensor:
                reads["n"] += 1
                if reads["n"] == 10:  # a few Adam steps into block 3
                    os.kill(os.getpid(), signal.SIGTERM)
                return inputs(w)

            kwargs["inputs"] = reader
        return real(*args, **kwargs)

    monkeypatch.setattr(tuning_stage, "tune_block", interrupted_in_block_three)
    with pytest.raises(Interrupted):
        compress(stories_dir, tinystories_file, out)
    committed = sorted(p.name for p in (out / WORK_NAME / "tuned").glob("*.safetensors"))
    assert committed == ["00000.safetensors", "00001.safetensors"]
    monkeypatch.setattr(tuning_stage, "tune_block", real)
    compress(stories_dir, tinystories_file, out)
    assert not (out / WORK_NAME).exists()
    assert files(out) == files(tuned)


def test_a_diverging_block_keeps_its_quantized_values_and_warns(
    plain, tuned, tmp_path, stories_dir, tinystories_file, monkeypatch
):
    real = tuning_math._mse

    def nan_in_block_one(block: Any, x: torch.Tensor, kwargs: Any, target: torch.Tensor) -> torch.Tensor:
        loss = real(block, x, kwargs, target)
        return loss * float("nan") if "layers.1." in getattr(block, "_tune_name", "") else loss

    real_levels_block = tuning_stage._levels_block

    def named(job: Any, block: Any, weights: Any, **kwargs: Any) -> Any:
        candidate, levels = real_levels_block(job, block, weights, **kwargs)
        candidate._tune_name = next(iter(weights))
        return candidate, levels

    monkeypatch.setattr(tuning_math, "_mse", nan_in_block_one)
    monkeypatch.setattr(tuning_stage, "_levels_block", named)
    with pytest.warns(TuningDivergedWarning, match="layer groups \\[1\\]"):
        out = compress(stories_dir, tinystories_file, tmp_path / "nan")
    got, base, good = tensors(out), tensors(plain), tensors(tuned)
    for name in got:
        if ".layers.1." in name:
            assert torch.equal(got[name], base[name]), name  # block 1 as quantized
    assert torch.equal(
        got["model.layers.0.self_attn.q_proj.weight_lut"], good["model.layers.0.self_attn.q_proj.weight_lut"]
    )
    assert any(not torch.equal(got[n], base[n]) for n in got if ".layers.2." in n)  # the others are tuned


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"weights.sensitivity": "uniform"}, "needs calibration windows"),
        ({"weights.method": "rtn", "weights.sensitive_fraction": None}, "method rtn has none"),
        ({"weights.tuning": {"steps": 0}}, "steps"),
        ({"weights.tuning": {"lr": float("nan")}}, "lr"),
        ({"weights.tuning": {"lr": 2.0}}, "lr"),
        ({"weights.tuning": {"tokens": 0}}, "tokens"),
        ({"weights.tuning": {"epochs": 3}}, "unknown key"),
        ({"weights.tuning": {"code_moves": -0.01}}, r"code_moves must be a share in \[0, 0.05\]"),
        ({"weights.tuning": {"code_moves": 0.5}}, "code_moves"),
        ({"weights.tuning": {"code_moves": True}}, "code_moves"),
        ({"weights.tuning": {"lr_schedule": "linear"}}, "lr_schedule"),
    ],
)
def test_bad_tuning_recipes_fail_at_validation(overrides: dict[str, Any], match: str) -> None:
    base = "rtn-w3" if overrides.get("weights.method") == "rtn" else "w3-tuned"
    overrides = {k: v for k, v in overrides.items() if k != "weights.method" and v is not None}
    if base == "rtn-w3":
        overrides["weights.tuning"] = {"steps": 8}
    with pytest.raises(ConfigError, match=match) as info:
        load_recipe(base, **overrides)
    assert "\n" not in info.value.message


def test_code_moves_write_moved_codes_that_verify_and_evaluate(plain, tuned, tmp_path, stories_dir, tinystories_file):
    """weights.tuning.code_moves: the artifact's codes are no longer a relabelling of the quantized ones in
    some linear, the format and layout are the same, and the runtime reads it."""
    from squeeze.quant.packing import unpack_codes

    recipe = load_recipe("w3", **{"weights.tuning": {**TUNING, "code_moves": 0.01, "lr_schedule": "cosine"}})
    out = tmp_path / "moved"
    api.compress(str(stories_dir), out, recipe, str(tinystories_file), calibration_overrides=CALIB)
    assert api.verify_model_integrity(out).ok
    assert "code_moves: 0.01" in (out / "recipe.yaml").read_text()
    got, base = tensors(out), tensors(plain)
    assert {k: (v.dtype, v.shape) for k, v in got.items()} == {k: (v.dtype, v.shape) for k, v in base.items()}
    modules = json.loads((out / "config.json").read_text())["quantization_config"]["modules"]
    moved = []
    for module, spec in modules.items():
        codes = [unpack_codes(t[f"{module}.weight_packed"], 3, spec["in_features"]) for t in (got, base)]
        if not _same_partition(*codes):
            moved.append(module)
    assert moved  # some codes moved to another level
    score = api.evaluate(str(out), str(tinystories_file), seq_len=64, max_windows=4).result.perplexity
    assert score == score and score < 1e4


def test_untuned_recipes_keep_their_hash() -> None:
    recipe = load_recipe("w3")
    assert "tuning" not in recipe.to_dict()["weights"]
    assert load_recipe("w3-tuned").to_dict()["weights"]["tuning"] == {
        "steps": 32,
        "lr": 0.0002,
        "tokens": 8192,
        "seed": 0,
    }


def test_a_bounded_run_writes_the_unbounded_runs_bytes(tuned, tmp_path, stories_dir, tinystories_file):
    out = compress(stories_dir, tinystories_file, tmp_path / "bounded", max_memory="64GB")
    assert files(out) == files(tuned)
