"""compress with error compensation (weights.error_compensation, recipes w3-ec / w4-ec / w3-s045-ec) on
stories260K: the artifact is an ordinary squeeze artifact (existing loader and runtime), better than plain at
equal bits, and resuming from a committed Fisher + Hessian gives identical bytes."""

from __future__ import annotations

import json
import math
import os
import signal
from pathlib import Path

import pytest
import torch

import squeeze.compression.pipelines.plain as plain
import squeeze.compression.sensitivity as sensitivity
from squeeze import api
from squeeze.compression.job import needs_calibration
from squeeze.compression.workarea import WORK_NAME, WorkArea
from squeeze.config import load_recipe
from squeeze.errors import CalibrationError, ConfigError, Interrupted
from squeeze.format.manifest import MANIFEST_NAME

CALIB = {"num_samples": 8, "seq_len": 128}  # error compensation needs enough tokens (4 x 64 makes w3 worse)


def compress(stories_dir: Path, text: Path, out: Path, recipe: str = "w3-ec", **kwargs):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return api.compress(str(stories_dir), out, recipe, str(text), calibration_overrides=CALIB, **kwargs)
    finally:
        torch.set_num_threads(threads)


def files(directory: Path) -> dict[str, bytes]:
    return {
        p.relative_to(directory).as_posix(): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != MANIFEST_NAME
    }


@pytest.fixture(scope="module")
def ec_artifact(tmp_path_factory, stories_dir, tinystories_file) -> Path:
    out = tmp_path_factory.mktemp("ec") / "w3-ec"
    compress(stories_dir, tinystories_file, out)
    return out


def test_ec_artifact_is_an_ordinary_squeeze_artifact_and_beats_plain(
    ec_artifact, tmp_path, stories_dir, tinystories_file
):
    plain = tmp_path / "w3"
    compress(stories_dir, tinystories_file, plain, recipe="w3")
    config = json.loads((ec_artifact / "config.json").read_text())["quantization_config"]
    plain_config = json.loads((plain / "config.json").read_text())["quantization_config"]
    assert config["modules"] == plain_config["modules"]  # same format, same module entries
    assert api.verify_model_integrity(ec_artifact).ok
    # same tensor names, dtypes and shapes; different codes
    from safetensors import safe_open

    def layout(directory: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
        out = {}
        for shard in sorted(directory.glob("*.safetensors")):
            with safe_open(str(shard), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118
                    t = handle.get_tensor(name)
                    out[name] = (str(t.dtype), tuple(t.shape))
        return out

    assert layout(ec_artifact) == layout(plain)
    assert files(ec_artifact) != files(plain)
    # the existing loader and runtime run it, and it is closer to the original on the calibration text
    text = str(tinystories_file)
    scores = {
        name: api.evaluate(str(path), text, seq_len=64, max_windows=8).result.perplexity
        for name, path in (("ec", ec_artifact), ("plain", plain))
    }
    reference = api.evaluate(str(stories_dir), text, seq_len=64, max_windows=8).result.perplexity
    assert abs(scores["ec"] - reference) < abs(scores["plain"] - reference), (scores, reference)


def test_refit_rounds_write_an_ordinary_artifact_whose_layers_fit_no_worse(
    ec_artifact, tmp_path, stories_dir, tinystories_file
):
    refit = tmp_path / "w3-ec-refit"
    compress(stories_dir, tinystories_file, refit, overrides={"weights.refit_rounds": 3})
    assert api.verify_model_integrity(refit).ok
    assert "refit_rounds: 3" in (refit / "recipe.yaml").read_text()
    ec_files, refit_files = files(ec_artifact), files(refit)
    assert sorted(ec_files) == sorted(refit_files) and ec_files != refit_files
    # same codes width and tensor layout; the runtime reads it as any LUT artifact
    text = str(tinystories_file)
    score = api.evaluate(str(refit), text, seq_len=64, max_windows=8).result.perplexity
    assert (
        math.isfinite(score)
        and score < 2 * api.evaluate(str(ec_artifact), text, seq_len=64, max_windows=8).result.perplexity
    )


def test_lnq_rounds_write_an_ordinary_artifact_and_report_each_layers_held_out_objective(
    ec_artifact, tmp_path, stories_dir, tinystories_file
):
    out = tmp_path / "w3-ec-lnq"
    overrides = {"weights.lnq_rounds": 2, "weights.lnq_held_out": 2}
    result = compress(stories_dir, tinystories_file, out, overrides=overrides)
    assert api.verify_model_integrity(out).ok
    recipe_text = (out / "recipe.yaml").read_text()
    assert "lnq_rounds: 2" in recipe_text and "lnq_held_out: 2" in recipe_text and "lnq_ridge" not in recipe_text
    assert sorted(files(out)) == sorted(files(ec_artifact))  # same tensors and files
    layers = result.to_dict()["lnq_layers"]
    assert len(layers) == result.quantized_modules
    for report in layers.values():  # never worse on the held-out windows, and the refit changed something
        assert report["held_out_after"] <= report["held_out_before"]
    assert sum(r["held_out_after"] for r in layers.values()) < sum(r["held_out_before"] for r in layers.values())
    assert any(r["rows_changed"] > 0 for r in layers.values())
    text = str(tinystories_file)
    score = api.evaluate(str(out), text, seq_len=64, max_windows=8).result.perplexity
    assert math.isfinite(score)
    assert "lnq_layers" not in compress_result_keys(ec_artifact)


def compress_result_keys(artifact: Path) -> set[str]:
    """Keys of the plain w3-ec run's result, rebuilt from its recipe (no lnq: no lnq_layers)."""
    from squeeze.compression.job import CompressResult

    return set(CompressResult(output=str(artifact), model="m", recipe="w3-ec", bits_per_weight=3, seconds=1).to_dict())


def test_lnq_with_no_window_left_to_fit_is_refused_before_the_model_loads(tmp_path, stories_dir, tinystories_file):
    with pytest.raises(CalibrationError, match="holds out the last 8 calibration windows") as info:
        compress(
            stories_dir,
            tinystories_file,
            tmp_path / "x",
            overrides={"weights.lnq_rounds": 1, "weights.lnq_held_out": 8},
        )
    assert "--num-samples 32" in (info.value.hint or "")


def test_resume_with_a_committed_hessian_gives_identical_bytes(
    ec_artifact, tmp_path, stories_dir, tinystories_file, monkeypatch
):
    out = tmp_path / "out"

    def stop(stage, done, total):
        if stage == "quantize" and done == 14:
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(Interrupted):
        compress(stories_dir, tinystories_file, out, progress=stop)
    work = WorkArea(out)
    assert work.has_fisher() and work.has_hessians() and work.committed_groups() == 2
    assert work.load_hessians(["model.layers.0.self_attn.q_proj"]) is None  # must cover exactly the targets

    def no_second_pass(*_args, **_kwargs):
        raise AssertionError("the committed Fisher and Hessians must be reused")

    monkeypatch.setattr(sensitivity, "fisher_information", no_second_pass)
    compress(stories_dir, tinystories_file, out)
    assert not (out / WORK_NAME).exists()
    assert files(out) == files(ec_artifact)


def test_a_missing_hessian_checkpoint_is_recomputed(ec_artifact, tmp_path, stories_dir, tinystories_file):
    out = tmp_path / "out"

    def stop(stage, done, total):
        if stage == "quantize" and done == 7:
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(Interrupted):
        compress(stories_dir, tinystories_file, out, progress=stop)
    (out / WORK_NAME / "hessian.safetensors").write_bytes(b"not a safetensors file")
    compress(stories_dir, tinystories_file, out)
    assert files(out) == files(ec_artifact)


def test_recipe_validation():
    assert load_recipe("w3-ec").weights.error_compensation is True
    assert load_recipe("w3-s045-ec").weights.sensitive_fraction == 0.0005
    with pytest.raises(ConfigError, match="error_compensation applies to method squeeze"):
        load_recipe("rtn-w3", **{"weights.error_compensation": True})
    with pytest.raises(ConfigError, match="damp"):
        load_recipe("w3-ec", **{"weights.damp": 0.0})
    with pytest.raises(ConfigError, match="damp"):
        load_recipe("w3-ec", **{"weights.damp": 1.5})
    with pytest.raises(ConfigError, match="only with weights.error_compensation"):
        load_recipe("w3", **{"weights.refit_lut": True})
    with pytest.raises(ConfigError, match="only with weights.error_compensation"):
        load_recipe("w3", **{"weights.act_order": True})
    assert load_recipe("w3-ec", **{"weights.act_order": True}).weights.act_order is True
    with pytest.raises(ConfigError, match="bool"):
        load_recipe("w3", **{"weights.error_compensation": "yes"})


def test_ec_needs_calibration_even_with_uniform_sensitivity(tmp_path, stories_dir):
    recipe = load_recipe("w3-ec", **{"weights.sensitivity": "uniform"})
    assert needs_calibration(recipe)
    assert not needs_calibration(load_recipe("w3", **{"weights.sensitivity": "uniform"}))
    with pytest.raises(ConfigError, match="no calibration text"):
        api.compress(str(stories_dir), tmp_path / "x", recipe, None)


def test_generated_samples_join_the_hessians(ec_artifact, tmp_path, stories_dir, tinystories_file, monkeypatch):
    """weights.generated_samples: the model samples that many sequences (the calibration's seq_len) inside the
    Hessians' hooks; the artifact is an ordinary one, other than without them, and the same seed repeats it."""
    import squeeze.calibrate.generated as generated

    calls: list[tuple[int, int, int]] = []
    sample = generated.sample_windows_from_model

    def spy(model, num_samples, seq_len, **kwargs):
        calls.append((num_samples, seq_len, kwargs["seed"]))
        return sample(model, num_samples, seq_len, **kwargs)

    monkeypatch.setattr(sensitivity, "sample_windows_from_model", spy)
    steps: list[tuple[int, int]] = []

    def progress(stage, done, total):
        if stage == "generate":
            steps.append((done, total))

    overrides = {"weights.generated_samples": 3}
    first = compress(stories_dir, tinystories_file, tmp_path / "a", overrides=overrides, progress=progress)
    assert calls == [(3, CALIB["seq_len"], 0)]
    assert steps[-1] == (CALIB["seq_len"], CALIB["seq_len"])  # one batch of 3, 128 steps
    assert "generate" in first.timings
    assert api.verify_model_integrity(tmp_path / "a").ok
    assert files(tmp_path / "a") != files(ec_artifact)
    compress(stories_dir, tinystories_file, tmp_path / "b", overrides=overrides)
    assert files(tmp_path / "a") == files(tmp_path / "b")
    text = str(tinystories_file)
    ppl = api.evaluate(str(tmp_path / "a"), text, seq_len=64, max_windows=8).result.perplexity
    assert math.isfinite(ppl)


def test_generated_samples_need_error_compensation():
    with pytest.raises(ConfigError, match="only with weights.error_compensation"):
        load_recipe("w3", **{"weights.generated_samples": 8})
    with pytest.raises(ConfigError, match="generated_samples must be >= 0"):
        load_recipe("w3-ec", **{"weights.generated_samples": -1})
    with pytest.raises(ConfigError, match="applies to method squeeze"):
        load_recipe("rtn-w3", **{"weights.generated_samples": 8})


def test_a_tokenizer_with_no_start_token_is_refused_before_the_model_loads(
    tmp_path, stories_dir, tinystories_file, monkeypatch
):
    real = sensitivity.load_tokenizer

    def no_bos_or_eos(source):
        tokenizer = real(source)
        tokenizer.bos_token, tokenizer.eos_token = None, None
        return tokenizer

    def must_not_load(*_args, **_kwargs):
        raise AssertionError("the model must not load before the start token is checked")

    monkeypatch.setattr(sensitivity, "load_tokenizer", no_bos_or_eos)
    monkeypatch.setattr(plain, "load_model", must_not_load)
    with pytest.raises(ConfigError, match="no BOS or EOS token"):
        compress(stories_dir, tinystories_file, tmp_path / "x", overrides={"weights.generated_samples": 2})
    assert not (tmp_path / "x" / MANIFEST_NAME).exists()
