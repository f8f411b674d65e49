"""End to end on stories260K: compress -> verify -> load -> eval, determinism, and every bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from log_lines import without_progress
from squeeze import api
from squeeze.cli.app import app
from squeeze.compression import preflight
from squeeze.models import load_model, resolve_model
from squeeze.models.targets import find_target_linears
from squeeze.quant.schemes.lut import quantize_lut
from squeeze.runtime.linear import SqueezeLinear

runner = CliRunner()
CALIB = {"num_samples": 4, "seq_len": 64}


def compress_cli(stories_dir, output, *extra, calibration=None):
    args = ["compress", str(stories_dir), "-o", str(output), "--num-samples", "4", "--seq-len", "64", "--json"]
    if calibration is not None:
        args += ["--calibration", str(calibration)]
    return runner.invoke(app, args + list(extra))


def shard_bytes(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.glob("*.safetensors"))}


@pytest.fixture(scope="module")
def w3_artifact(tmp_path_factory, stories_dir, tinystories_file):
    out = tmp_path_factory.mktemp("w3") / "stories-w3-s045"
    result = compress_cli(stories_dir, out, "--recipe", "w3-s045", calibration=tinystories_file)
    assert result.exit_code == 0, result.output
    return out, json.loads(result.stdout)


def test_compress_summary_and_artifact_contents(w3_artifact):
    out, summary = w3_artifact
    assert {"output", "bits_per_weight", "seconds"} <= set(summary)
    assert summary["output"] == str(out)
    # dim 64: the fp16 LUT alone costs 8 * 16 / 64 = 2 bits per weight on top of the 3-bit codes
    assert 5.0 < summary["bits_per_weight"] < 6.0
    names = {p.name for p in out.iterdir()}
    assert {
        "config.json",
        "recipe.yaml",
        "squeeze.manifest.json",
        "model.safetensors.index.json",
        "generation_config.json",
        "tokenizer.json",
    } <= names
    config = json.loads((out / "config.json").read_text())
    quant = config["quantization_config"]
    assert quant["quant_method"] == "squeeze" and quant["bits"] == 3 and quant["format_version"] == 1
    assert len(quant["modules"]) == 5 * 7
    assert quant["bits_per_weight"] == summary["bits_per_weight"]
    manifest = json.loads((out / "squeeze.manifest.json").read_text())
    assert manifest["provenance"]["source_model"] and manifest["provenance"]["calibration_hash"]


def test_fresh_artifact_verifies(w3_artifact):
    out, _ = w3_artifact
    result = runner.invoke(app, ["verify", str(out), "--json"])
    assert result.exit_code == 0 and json.loads(result.stdout)["ok"] is True


def test_inspect_reports_the_same_bits_per_weight(w3_artifact):
    out, summary = w3_artifact
    info = json.loads(runner.invoke(app, ["inspect", str(out), "--json"]).stdout)
    assert info["bits_per_weight"] == pytest.approx(summary["bits_per_weight"], abs=1e-3)
    assert {"weight_packed", "weight_lut", "weight_sparse_vals"} <= {r["role"] for r in info["roles"]}


def test_eval_of_the_artifact_against_the_original(w3_artifact, stories_dir, tinystories_file):
    out, _ = w3_artifact
    result = runner.invoke(
        app,
        [
            "eval",
            str(out),
            "--text",
            str(tinystories_file),
            "--baseline",
            str(stories_dir),
            "--seq-len",
            "128",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    # stories260K is tiny (dim 64): 3 bits costs it real quality, but it must stay a language model
    assert report["baseline_perplexity"] < report["perplexity"] < 2.0 * report["baseline_perplexity"]


def test_quantize_save_load_dequantize_is_exact(tmp_path, stories_dir):
    out = tmp_path / "uniform"
    result = compress_cli(stories_dir, out, "--recipe", "w4-s045", "--sensitivity", "uniform")
    assert result.exit_code == 0, result.output
    original, _ = load_model(resolve_model(str(stories_dir)))
    loaded = api.load(out).model
    targets = find_target_linears(original, ("down_proj", "q_proj"), ())
    for name, linear in targets.items():
        expected = quantize_lut(linear.weight.detach(), None, 4, 0.0005, 0.004).dequantize()
        module = loaded.get_submodule(name)
        assert isinstance(module, SqueezeLinear)
        assert torch.equal(module.dequantize(), expected), name


def test_int8_lut_artifact_round_trips_and_estimate_matches(tmp_path, stories_dir):
    from squeeze.config import load_recipe

    out = tmp_path / "lut8"
    result = compress_cli(stories_dir, out, "--recipe", "w3-s045", "--sensitivity", "uniform", "--lut-dtype", "int8")
    assert result.exit_code == 0, result.output
    assert runner.invoke(app, ["verify", str(out)]).exit_code == 0
    original, _ = load_model(resolve_model(str(stories_dir)))
    loaded = api.load(out).model
    linear = find_target_linears(original, ("down_proj",), ())["model.layers.0.mlp.down_proj"]
    expected = quantize_lut(linear.weight.detach(), None, 3, 0.0005, 0.004, lut_dtype="int8").dequantize()
    assert torch.equal(loaded.get_submodule("model.layers.0.mlp.down_proj").dequantize(), expected)
    recipe = load_recipe("w3-s045", **{"weights.lut_dtype": "int8"})
    estimate = preflight.estimate_size(preflight.meta_model(resolve_model(str(stories_dir))), recipe)
    shards = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    assert estimate.total_bytes <= shards <= estimate.total_bytes * 1.05 + 64 * 1024


def test_same_inputs_and_seed_give_byte_identical_shards(tmp_path, stories_dir, tinystories_file):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    for out, seed in ((a, "0"), (b, "0"), (c, "1")):
        assert (
            compress_cli(stories_dir, out, "--recipe", "w3", "--seed", seed, calibration=tinystories_file).exit_code
            == 0
        )
    assert shard_bytes(a) == shard_bytes(b)
    assert shard_bytes(a) != shard_bytes(c)


def test_rtn_recipe_end_to_end(tmp_path, stories_dir, tinystories_file):
    out = tmp_path / "rtn"
    result = compress_cli(stories_dir, out, "--recipe", "rtn-w4", "--group-size", "32")
    assert result.exit_code == 0, result.output
    assert runner.invoke(app, ["verify", str(out)]).exit_code == 0
    quant = json.loads((out / "config.json").read_text())["quantization_config"]
    assert quant["method"] == "rtn" and quant["group_size"] == 32
    loaded = api.load(out).model
    ids = torch.tensor([[1, 20, 30, 40, 50]])
    assert torch.isfinite(loaded(ids).logits).all()


# ------------------------------------------------------------------------------------------------------
# Bad input: one line, exit 2, nothing written


def assert_clean_refusal(result, output: Path, message: str):
    assert result.exit_code == 2, result.output
    stderr = without_progress(result.stderr)  # a refusal met once the stages run follows their log lines
    assert stderr.startswith("Error: ") and message in stderr, result.stderr
    assert "Traceback" not in result.output
    assert not output.exists() or not any(output.iterdir())
    assert not [p for p in output.parent.iterdir() if p.name.endswith(".partial")]


def test_unknown_model_path(tmp_path):
    out = tmp_path / "out"
    result = runner.invoke(app, ["compress", str(tmp_path / "nope"), "-o", str(out), "--recipe", "rtn-w4"])
    assert_clean_refusal(result, out, "does not exist")


def test_id_not_in_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    out = tmp_path / "out"
    result = runner.invoke(app, ["compress", "someone/not-cached", "-o", str(out), "--recipe", "rtn-w4"])
    assert_clean_refusal(result, out, "not-cached")


def test_no_target_linears(tmp_path, stories_dir, tinystories_file):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("version: 1\nweights:\n  targets: [nonexistent_proj]\n")
    out = tmp_path / "out"
    result = compress_cli(stories_dir, out, "--recipe", str(recipe), calibration=tinystories_file)
    assert_clean_refusal(result, out, "no nn.Linear in")


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--bits", "5"], "weights.bits must be one of"),
        (["--outlier-fraction", "0.2"], "outlier_fraction must be in [0, 0.1]"),
        (["--sensitive-fraction", "-0.1"], "sensitive_fraction must be in [0, 0.1]"),
        (["--recipe", "w9"], "unknown recipe 'w9'"),
    ],
)
def test_bad_recipe_values(tmp_path, stories_dir, tinystories_file, flags, message):
    out = tmp_path / "out"
    assert_clean_refusal(compress_cli(stories_dir, out, *flags, calibration=tinystories_file), out, message)


def test_recipe_with_unknown_keys(tmp_path, stories_dir, tinystories_file):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("version: 1\nweights:\n  bitz: 4\n")
    out = tmp_path / "out"
    assert_clean_refusal(
        compress_cli(stories_dir, out, "--recipe", str(recipe), calibration=tinystories_file), out, "'bitz'"
    )


def test_calibration_text_shorter_than_one_window(tmp_path, stories_dir):
    short = tmp_path / "short.txt"
    short.write_text("Once upon a time.")
    out = tmp_path / "out"
    assert_clean_refusal(compress_cli(stories_dir, out, calibration=short), out, "too short")


def test_missing_calibration_is_explained(tmp_path, stories_dir):
    out = tmp_path / "out"
    assert_clean_refusal(compress_cli(stories_dir, out), out, "no calibration text")


def test_non_empty_output_is_refused_unless_overwrite(tmp_path, stories_dir, tinystories_file):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    result = compress_cli(stories_dir, out, calibration=tinystories_file)
    assert result.exit_code == 2 and "not empty" in result.stderr and "--overwrite" in result.stderr
    assert (out / "keep.txt").read_text() == "precious"


def test_failed_overwrite_keeps_the_old_artifact(tmp_path, stories_dir, tinystories_file, w3_artifact):
    out = tmp_path / "out"
    assert compress_cli(stories_dir, out, "--recipe", "rtn-w4").exit_code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    short = tmp_path / "short.txt"
    short.write_text("tiny")
    result = compress_cli(stories_dir, out, "--overwrite", calibration=short)
    assert result.exit_code == 2
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    ok = compress_cli(stories_dir, out, "--overwrite", "--recipe", "rtn-w3")
    assert ok.exit_code == 0 and api.verify_model_integrity(out).ok
    assert json.loads((out / "config.json").read_text())["quantization_config"]["bits"] == 3
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_not_enough_disk_is_checked_before_any_work(tmp_path, stories_dir, tinystories_file, monkeypatch):
    monkeypatch.setattr(preflight, "free_disk_bytes", lambda path: 1000)
    calls = []
    import squeeze.compression.pipelines.plain as plain

    monkeypatch.setattr(plain, "load_model", lambda *a, **k: calls.append(1))
    out = tmp_path / "out"
    assert_clean_refusal(compress_cli(stories_dir, out, calibration=tinystories_file), out, "not enough free disk")
    assert calls == []


def test_size_estimate_matches_the_artifact(tmp_path, stories_dir, w3_artifact):
    from squeeze.config import load_recipe

    out, _ = w3_artifact
    estimate = preflight.estimate_size(preflight.meta_model(resolve_model(str(stories_dir))), load_recipe("w3-s045"))
    shards = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    assert estimate.total_bytes <= shards <= estimate.total_bytes * 1.05 + 64 * 1024  # + headers
