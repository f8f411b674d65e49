"""compress with weights.distill on stories260K (on top of weights.tuning): an ordinary artifact with the same
codes and trained LUT values and norm gains; a run killed mid-distillation resumes to the same bytes; bad
recipes and --max-memory fail before any work."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

import squeeze.compression.distill_stage as distill_stage
from squeeze import api
from squeeze.compression.workarea import WORK_NAME
from squeeze.config import load_recipe
from squeeze.errors import ConfigError, Interrupted
from squeeze.quant.packing import unpack_codes
from tests.compression.test_tuning_stage import CALIB, _same_partition, files, tensors

TUNING = {"steps": 8, "lr": 1e-3, "tokens": 4 * 64, "seed": 0}
DISTILL = {"steps": 12, "lr": 5e-4, "tokens": 4 * 64, "generated_samples": 2, "eval_every": 4, "patience": 3}


def compress(stories_dir: Path, text: Path, out: Path, distilled: bool = True, **kwargs: Any) -> api.CompressResult:
    overrides: dict[str, Any] = {"weights.tuning": TUNING}
    if distilled:
        overrides["weights.distill"] = DISTILL
    recipe = load_recipe("w3", **overrides)
    return api.compress(str(stories_dir), out, recipe, str(text), calibration_overrides=CALIB, **kwargs)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory, stories_dir, tinystories_file) -> Path:
    out = tmp_path_factory.mktemp("tuned") / "w3-tuned"
    compress(stories_dir, tinystories_file, out, distilled=False)
    return out


@pytest.fixture(scope="module")
def distilled(tmp_path_factory, stories_dir, tinystories_file) -> tuple[Path, api.CompressResult]:
    out = tmp_path_factory.mktemp("distilled") / "w3-tuned-distilled"
    return out, compress(stories_dir, tinystories_file, out)


def test_distilled_artifact_keeps_codes_and_format_and_trains_luts_and_norm_gains(tuned, distilled, tinystories_file):
    out, result = distilled
    assert api.verify_model_integrity(out).ok
    record = result.to_dict()["distill"]
    assert record["status"] == "distilled" and record["best_loss"] < record["initial_loss"]
    assert record["windows"] == 4 and record["generated"] == 2 and record["held_out"] == 2
    got, base = tensors(out), tensors(tuned)
    assert {k: (v.dtype, v.shape) for k, v in got.items()} == {k: (v.dtype, v.shape) for k, v in base.items()}
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["modules"] == json.loads((tuned / "config.json").read_text())["quantization_config"]["modules"]
    luts = [name for name in got if name.endswith(".weight_lut")]
    norms = [name for name in got if "norm" in name]
    assert any(not torch.equal(got[name], base[name]) for name in luts)
    assert not torch.equal(got["model.norm.weight"], base["model.norm.weight"])  # the final norm, outside blocks
    for name in luts:  # the same weights share a level (levels are stored sorted, so codes may be relabelled)
        module = name.removesuffix(".weight_lut")
        in_features = config["modules"][module]["in_features"]
        codes = [unpack_codes(t[f"{module}.weight_packed"], 3, in_features) for t in (got, base)]
        assert _same_partition(*codes), module
    for name in got:  # the embedding and everything else as the tuned run wrote them
        if name not in luts and name not in norms and not name.endswith(".weight_packed"):
            assert torch.equal(got[name], base[name]), name
    assert "distill:" in (out / "recipe.yaml").read_text()
    text = str(tinystories_file)
    scores = {
        key: api.evaluate(str(path), text, seq_len=64, max_windows=8).result.perplexity
        for key, path in (("distilled", out), ("tuned", tuned))
    }
    assert scores["distilled"] < scores["tuned"], scores


def test_a_run_killed_mid_distillation_resumes_to_identical_bytes(
    distilled, tmp_path, stories_dir, tinystories_file, monkeypatch
):
    out = tmp_path / "out"
    real = distill_stage._save_state
    saves = {"n": 0}

    def killed_after_second_score(*args: Any) -> None:
        real(*args)
        saves["n"] += 1
        if saves["n"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(distill_stage, "_save_state", killed_after_second_score)
    with pytest.raises(Interrupted):
        compress(stories_dir, tinystories_file, out)
    work = out / WORK_NAME / "distill"
    assert sorted(p.name for p in work.glob("*.safetensors")) == ["generated.safetensors", "state.safetensors"]
    monkeypatch.setattr(distill_stage, "_save_state", real)
    compress(stories_dir, tinystories_file, out)
    assert not (out / WORK_NAME).exists()
    assert files(out) == files(distilled[0])


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"weights.sensitivity": "uniform"}, "Fisher sensitivity pass only"),
        ({"weights.distill": {"steps": 0}}, "steps"),
        ({"weights.distill": {"lr": float("nan")}}, "lr"),
        ({"weights.distill": {"lr": 2.0}}, "lr"),
        ({"weights.distill": {"tokens": 0}}, "tokens"),
        ({"weights.distill": {"generated_samples": -1}}, "generated_samples"),
        ({"weights.distill": {"generated_samples": 5000}}, "generated_samples must be at most"),
        ({"weights.distill": {"eval_every": 0}}, "eval_every"),
        ({"weights.distill": {"patience": 0}}, "patience"),
        ({"weights.distill": {"lr_schedule": "linear"}}, "lr_schedule"),
        ({"weights.distill": {"epochs": 3}}, "unknown key"),
    ],
)
def test_bad_distill_recipes_fail_at_validation(overrides: dict[str, Any], match: str) -> None:
    if "weights.sensitivity" in overrides:
        overrides = {**overrides, "weights.distill": {}}
    with pytest.raises(ConfigError, match=match) as info:
        load_recipe("w3", **overrides)
    assert "\n" not in info.value.message


def test_a_format_without_levels_cannot_be_distilled() -> None:
    with pytest.raises(ConfigError, match="method rtn has none to train"):
        load_recipe("rtn-w3", **{"weights.distill": {}})


def test_recipes_without_distill_keep_their_hash_and_the_defaults_are_written_in_full() -> None:
    assert "distill" not in load_recipe("w3-ec").to_dict()["weights"]
    written = load_recipe("w3", **{"weights.distill": {}}).to_dict()["weights"]["distill"]
    assert written == {
        "steps": 128,
        "lr": 1e-4,
        "tokens": 16384,
        "generated_samples": 8,
        "lr_schedule": "cosine",
        "eval_every": 16,
        "patience": 3,
        "seed": 0,
    }


def test_max_memory_refuses_distillation_before_any_work(tmp_path, stories_dir, tinystories_file) -> None:
    with pytest.raises(ConfigError, match="does not stream weights.distill"):
        compress(stories_dir, tinystories_file, tmp_path / "bounded", max_memory="64GB")
    assert not (tmp_path / "bounded" / WORK_NAME / "groups").exists()


def test_the_peak_estimate_counts_the_student_and_every_held_out_target(tiny_llama_dir) -> None:
    """preflight's plain estimate with weights.distill: the codes and gathered weights (12 bytes a quantized
    weight), two windows' activations and one (seq_len, vocab) float32 target per held-out window, the count
    split as the stage splits it (calibration windows and sampled sequences apart)."""
    from squeeze.compression.preflight import estimate_peak_memory, meta_model
    from squeeze.models.source import resolve_model

    skeleton = meta_model(resolve_model(str(tiny_llama_dir)))
    vocab = skeleton.config.vocab_size
    seq_len = 512
    one = load_recipe("w3", **{"weights.distill": {"tokens": 8 * seq_len, "generated_samples": 0}})
    two = load_recipe("w3", **{"weights.distill": {"tokens": 16 * seq_len, "generated_samples": 8}})
    four = load_recipe("w3", **{"weights.distill": {"tokens": 32 * seq_len, "generated_samples": 16}})
    plain = estimate_peak_memory(skeleton, load_recipe("w3"), seq_len)
    peaks = [estimate_peak_memory(skeleton, recipe, seq_len) for recipe in (one, two, four)]
    assert plain < peaks[0]
    per_window = seq_len * vocab * 4
    # held out: 8 windows -> 1; 16 windows -> 2 and 8 sequences -> 1; 32 windows -> 4 and 16 sequences -> 2
    assert peaks[1] - peaks[0] == 2 * per_window
    assert peaks[2] - peaks[1] == 3 * per_window
