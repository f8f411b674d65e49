"""``squeeze calibrate-kv`` on stories260K: scales into the artifact, run/eval/inspect through them, bad input."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from squeeze import api
from squeeze.cli.app import app
from squeeze.compression import calibrate_kv as calibrate_kv_module
from squeeze.config import DEFAULT_SINK_TOKENS
from squeeze.quant.kv_file import KV_FILE
from squeeze.quant.kv_spec import LayerFP8
from squeeze.runtime.quantized_cache import SqueezeKVCache

runner = CliRunner()
CALIB = ["--num-samples", "4", "--seq-len", "64"]


def tree_digest(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def rtn_artifact(tmp_path_factory: pytest.TempPathFactory, stories_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("kv") / "stories-rtn-w4"
    api.compress(str(stories_dir), out, recipe="rtn-w4")
    return out


def calibrated_copy(
    tmp_path_factory: pytest.TempPathFactory, rtn_artifact: Path, tinystories_file: Path, bits: str
) -> tuple[Path, dict]:
    """(a copy of the RTN artifact calibrated by `squeeze calibrate-kv --bits BITS --json`, its JSON summary)."""
    out = tmp_path_factory.mktemp(f"kv{bits}") / f"stories-rtn-w4-kv{bits}"
    shutil.copytree(rtn_artifact, out)
    result = runner.invoke(
        app, ["calibrate-kv", str(out), "--bits", bits, "-c", str(tinystories_file), *CALIB, "--json"]
    )
    assert result.exit_code == 0, result.output
    return out, json.loads(result.stdout)


@pytest.fixture(scope="module")
def kv4_artifact(
    tmp_path_factory: pytest.TempPathFactory, rtn_artifact: Path, tinystories_file: Path
) -> tuple[Path, dict]:
    return calibrated_copy(tmp_path_factory, rtn_artifact, tinystories_file, "4")


def test_calibrate_kv_adds_scales_and_keeps_the_shards(kv4_artifact, rtn_artifact: Path) -> None:
    out, summary = kv4_artifact
    assert summary["bits"] == 4 and summary["output"] == str(out)
    assert summary["calibration"]["key_error"] < summary["calibration"]["dynamic_key_error"]
    before, after = tree_digest(rtn_artifact), tree_digest(out)
    changed = {p for p in before if before[p] != after.get(p)}
    assert changed == {"config.json", "squeeze.manifest.json"}  # the model shards are untouched
    assert set(after) - set(before) == {KV_FILE}
    config = json.loads((out / "config.json").read_text())
    kv = config["quantization_config"]["kv_cache"]
    assert kv["bits"] == 4 and kv["sink_tokens"] == DEFAULT_SINK_TOKENS and len(kv["layers"]) == 5
    assert all(layer["v_codebook"] and layer["v_symmetric"] for layer in kv["layers"])  # int4 values: codebook
    assert api.verify_model_integrity(out).ok


def test_loaded_artifact_runs_with_its_calibrated_cache(kv4_artifact) -> None:
    out, summary = kv4_artifact
    loaded = api.load(out)
    assert loaded.kv_spec is not None and loaded.kv_spec.bits == 4 and loaded.kv_spec.calibrated
    result = api.generate(loaded, "Once upon a time", max_new_tokens=8)
    assert result.kv_cache == "int4"
    assert result.kv_bytes_per_token == summary["kv_bytes_per_token"]
    tokens = result.prompt_tokens[0] + sum(result.new_tokens) - 1  # the last token is never fed back
    per_token = result.kv_bytes_per_token["int4"]
    sink = DEFAULT_SINK_TOKENS * 2 * 5 * 4 * 8 * 4  # K and V of fp32 tokens, 5 layers x 4 heads x 8 channels
    assert result.kv_cache_bytes == (tokens - DEFAULT_SINK_TOKENS) * per_token + sink
    fp = api.generate(loaded, "Once upon a time", max_new_tokens=8, kv_bits=16)
    assert fp.kv_cache == "float32" and fp.kv_cache_bytes == tokens * result.kv_bytes_per_token["fp16"] * 2


def test_run_cli_shows_kv_bytes_and_uses_the_calibrated_cache(kv4_artifact) -> None:
    out, _ = kv4_artifact
    result = runner.invoke(app, ["run", "Once upon a time", "-m", str(out), "-n", "6"])
    assert result.exit_code == 0, result.output
    lines = result.stderr.strip().splitlines()
    assert "KV bytes/token" in lines[-2] and "int4" in lines[-2]
    assert "KV cache int4" in lines[-1]
    as_json = json.loads(runner.invoke(app, ["run", "Once upon a time", "-m", str(out), "-n", "4", "--json"]).stdout)
    assert (
        as_json["kv_cache"] == "int4" and as_json["kv_bytes_per_token"]["int4"] < as_json["kv_bytes_per_token"]["fp16"]
    )


def test_eval_through_the_cache(kv4_artifact, rtn_artifact: Path, tinystories_file: Path) -> None:
    out, _ = kv4_artifact
    args = ["eval", str(out), "--text", str(tinystories_file), "--seq-len", "128", "--json"]
    calibrated = json.loads(runner.invoke(app, args).stdout)
    full = json.loads(runner.invoke(app, [*args, "--kv-bits", "16"]).stdout)
    dynamic = json.loads(runner.invoke(app, [*args, "--kv-bits", "4", "--kv-dynamic"]).stdout)
    assert (calibrated["kv_bits"], full["kv_bits"], dynamic["kv_bits"]) == (4, 16, 4)
    assert full["perplexity"] < calibrated["perplexity"] < full["perplexity"] * 1.5
    assert calibrated["perplexity"] != dynamic["perplexity"]
    # the plain artifact with dynamic scales works without any calibration
    plain = runner.invoke(
        app,
        [
            "eval",
            str(rtn_artifact),
            "--text",
            str(tinystories_file),
            "--seq-len",
            "128",
            "--kv-bits",
            "8",
            "--kv-dynamic",
            "--json",
        ],
    )
    assert plain.exit_code == 0, plain.output


def test_inspect_shows_kv_bytes_per_token(kv4_artifact, rtn_artifact: Path) -> None:
    out, summary = kv4_artifact
    info = api.inspect(out)
    assert info.kv_bytes_per_token == summary["kv_bytes_per_token"]
    kv = json.loads((out / "config.json").read_text())["quantization_config"]["kv_cache"]
    asymmetric = sum(not layer["v_symmetric"] for layer in kv["layers"])
    # 5 layers x 4 heads x 8 channels: codes for K and V, fp16 scales (int4: two key grids of 4 channels per
    # head, 8-channel heads being small; int8: one), one value scale per head, an offset for asymmetric V
    # layers; int4 as calibrated, int8 (not calibrated) with the default symmetric layout
    assert {layer["k_group"] for layer in kv["layers"]} == {4}
    assert info.kv_bytes_per_token == {
        "fp16": 2 * 5 * 4 * 8 * 2,
        "fp8": 2 * 5 * 4 * 8,  # one byte per element, its scales per layer
        "int8": 5 * (2 * 4 * 8 + 2 * 4 * 2),
        "int4": 5 * (2 * 4 * 4 + 4 * 2 * 2 + 4 * 2) + asymmetric * 4 * 2,
    }
    assert api.inspect(rtn_artifact).kv_bytes_per_token["fp16"] == 640
    text = runner.invoke(app, ["inspect", str(out)]).stdout
    assert "KV cache: calibrated for int4" in text and "KV bytes/token" in text
    assert "not calibrated" in runner.invoke(app, ["inspect", str(rtn_artifact)]).stdout


def test_a_plain_model_becomes_an_artifact_with_calibrated_kv(
    tmp_path: Path, stories_dir: Path, tinystories_file: Path, stories
) -> None:
    out = tmp_path / "stories-kv8"
    result = runner.invoke(
        app,
        [
            "calibrate-kv",
            str(stories_dir),
            "--bits",
            "8",
            "-c",
            str(tinystories_file),
            *CALIB,
            "-o",
            str(out),
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    assert api.verify_model_integrity(out).ok
    loaded = api.load(out)
    assert loaded.kv_spec is not None and loaded.kv_spec.bits == 8
    model, _ = stories
    ids = torch.tensor([[1, 200, 300, 400, 55]])
    original = model.state_dict()
    assert all(torch.equal(t, original[k]) for k, t in loaded.model.state_dict().items())  # the original weights
    # The LM head runs squeeze's row-stable kernel: the same logits up to float32 rounding of 64-term dot products
    # summed in another order (oneDNN's order depends on the CPU's vector width: 1e-4 apart on an AVX-512 Xeon).
    with torch.inference_mode():
        assert torch.allclose(loaded.model(ids).logits, model(ids).logits, atol=2e-4, rtol=1e-5)
        quantized = loaded.model(ids, use_cache=True, cache=SqueezeKVCache(loaded.kv_spec)).logits
        difference = float((quantized - model(ids).logits).abs().max())
    assert 0 < difference < 0.2  # int8 KV: a real but small change of the logits (which span ~25)


def test_calibrated_default_is_the_artifacts_own_builtin_spec(rtn_artifact: Path) -> None:
    result = runner.invoke(app, ["calibrate-kv", str(rtn_artifact), "--bits", "8"])
    assert result.exit_code == 2
    assert "no calibration text given" in result.stderr and "--calibration" in result.stderr


def _refused(args: list[str], message: str, artifact: Path | None = None) -> None:
    before = tree_digest(artifact) if artifact is not None else None
    result = runner.invoke(app, args)
    assert result.exit_code != 0, result.output
    assert result.stderr.startswith("Error: ") and message in result.stderr, result.stderr
    assert result.stdout == ""
    if artifact is not None:
        assert tree_digest(artifact) == before  # exactly as it was
        assert api.verify_model_integrity(artifact).ok


@pytest.mark.parametrize("bits", ["2", "16", "3", "fp16", "int8"])
def test_bits_not_8_4_or_fp8(rtn_artifact: Path, tinystories_file: Path, bits: str) -> None:
    _refused(
        ["calibrate-kv", str(rtn_artifact), "--bits", bits, "-c", str(tinystories_file)],
        "--bits must be one of 8, 4, fp8",
        rtn_artifact,
    )


def test_windows_not_longer_than_the_sink(rtn_artifact: Path, tinystories_file: Path) -> None:
    _refused(
        ["calibrate-kv", str(rtn_artifact), "-c", str(tinystories_file), "--seq-len", "4", "--sink-tokens", "4"],
        "sink",
        rtn_artifact,
    )


def test_model_without_output(stories_dir: Path, tinystories_file: Path) -> None:
    _refused(["calibrate-kv", str(stories_dir), "-c", str(tinystories_file)], "--output")


def test_kv_bits_on_an_artifact_without_scales(rtn_artifact: Path, tinystories_file: Path) -> None:
    result = runner.invoke(app, ["run", "Once", "-m", str(rtn_artifact), "--kv-bits", "4"])
    assert result.exit_code == 2 and "needs calibrated KV scales" in result.stderr
    assert "calibrate-kv" in result.stderr and "--kv-dynamic" in result.stderr and result.stdout == ""
    result = runner.invoke(app, ["eval", str(rtn_artifact), "--text", str(tinystories_file), "--kv-bits", "4"])
    assert result.exit_code == 2 and "needs calibrated KV scales" in result.stderr


def test_kv_width_mismatch_and_bad_kv_bits(kv4_artifact) -> None:
    out, _ = kv4_artifact
    result = runner.invoke(app, ["run", "Once", "-m", str(out), "--kv-bits", "8"])
    assert result.exit_code == 2 and "calibrated for int4" in result.stderr
    result = runner.invoke(app, ["run", "Once", "-m", str(out), "--kv-bits", "5"])
    assert result.exit_code == 2 and "4, 8 or 16" in result.stderr


def test_tampered_artifact_is_refused_before_any_work(
    rtn_artifact: Path, tmp_path: Path, tinystories_file: Path
) -> None:
    copy = tmp_path / "tampered"
    shutil.copytree(rtn_artifact, copy)
    shard = next(copy.glob("model*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    result = runner.invoke(app, ["calibrate-kv", str(copy), "-c", str(tinystories_file), *CALIB])
    assert result.exit_code == 1 and "failed verification" in result.stderr
    assert not (copy / KV_FILE).exists()


def test_a_failure_while_writing_leaves_the_artifact_as_it_was(
    rtn_artifact: Path, tmp_path: Path, tinystories_file: Path, monkeypatch
) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(rtn_artifact, copy)
    before = tree_digest(copy)

    def boom(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(calibrate_kv_module, "seal", boom)
    with pytest.raises(OSError):
        api.calibrate_kv(copy, tinystories_file, bits=8, calibration_overrides={"num_samples": 2, "seq_len": 64})
    assert tree_digest(copy) == before
    assert api.verify_model_integrity(copy).ok
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging dir left behind


@pytest.mark.parametrize("option", ["--value-group-size", "--key-group-size"])
@pytest.mark.parametrize("size", ["3", "6", "0"])
def test_group_sizes_must_be_even_divisors_of_the_head(
    rtn_artifact: Path, tinystories_file: Path, option: str, size: str
) -> None:
    _refused(
        ["calibrate-kv", str(rtn_artifact), "--bits", "4", "-c", str(tinystories_file), *CALIB, option, size],
        f"{option.split('-')[2]} grids must span an even divisor",
        rtn_artifact,
    )


@pytest.fixture(scope="module")
def fp8_artifact(
    tmp_path_factory: pytest.TempPathFactory, rtn_artifact: Path, tinystories_file: Path
) -> tuple[Path, dict]:
    return calibrated_copy(tmp_path_factory, rtn_artifact, tinystories_file, "fp8")


def test_fp8_writes_vllms_per_layer_scalars(fp8_artifact, rtn_artifact: Path) -> None:
    out, summary = fp8_artifact
    assert summary["bits"] == "fp8" and summary["sink_tokens"] == 0
    assert summary["calibration"]["baseline"].startswith("scale 1.0") and summary["calibration"]["key_error"] > 0
    before, after = tree_digest(rtn_artifact), tree_digest(out)
    assert {p for p in before if before[p] != after.get(p)} == {"config.json", "squeeze.manifest.json"}
    assert set(after) - set(before) == {KV_FILE}
    assert api.verify_model_integrity(out).ok  # re-sealed
    config = json.loads((out / "config.json").read_text())
    kv = config["quantization_config"]["kv_cache"]
    names = [f"model.layers.{i}.self_attn" for i in range(5)]
    assert {k: v for k, v in kv.items() if k not in ("keys", "values", "calibration_hash")} == {
        "format": "fp8_e4m3",
        "version": 1,
        "layers": [{"module": name} for name in names],
        "file": KV_FILE,
        "calibration": kv["calibration"],
    }
    tensors = load_file(out / KV_FILE)
    assert sorted(tensors) == sorted(f"{name}.{role}" for name in names for role in ("k_scale", "v_scale"))
    assert all(t.dtype == torch.float32 and t.shape == () and float(t) > 0 for t in tensors.values())
    # calibrate -> artifact -> KVSpec: the same scales
    loaded = api.load(out)
    assert loaded.kv_spec is not None and loaded.kv_spec.label == "fp8" and loaded.kv_spec.names == tuple(names)
    for name, layer in zip(names, loaded.kv_spec.layers, strict=True):
        assert isinstance(layer, LayerFP8)
        assert torch.equal(layer.k_scale, tensors[f"{name}.k_scale"])
        assert torch.equal(layer.v_scale, tensors[f"{name}.v_scale"])
    provenance = json.loads((out / "squeeze.manifest.json").read_text())["provenance"]["extra"]["kv_cache"]
    assert provenance["bits"] == "fp8"


def test_fp8_scales_are_those_of_a_direct_calibration(fp8_artifact, tinystories_file: Path) -> None:
    from squeeze.calibrate.kv_capture import calibrate_fp8
    from squeeze.calibrate.windows import calibration_windows
    from squeeze.config import load_calibration_spec
    from squeeze.runtime.loader import load_artifact
    from squeeze.runtime.options import LoadOptions

    out, _ = fp8_artifact
    loaded = load_artifact(out, LoadOptions(dense_cache=True))  # the model calibrate-kv ran
    windows = calibration_windows(
        load_calibration_spec(str(tinystories_file), num_samples=4, seq_len=64), loaded.tokenizer
    )
    direct = calibrate_fp8(loaded.model, windows).spec
    assert loaded.kv_spec is not None
    for got, want in zip(loaded.kv_spec.layers, direct.layers, strict=True):
        assert isinstance(got, LayerFP8) and isinstance(want, LayerFP8)
        assert torch.equal(got.k_scale, want.k_scale) and torch.equal(got.v_scale, want.v_scale)


def test_fp8_artifact_runs_evaluates_and_inspects_as_fp8(fp8_artifact, tinystories_file: Path) -> None:
    out, summary = fp8_artifact
    loaded = api.load(out)
    result = api.generate(loaded, "Once upon a time", max_new_tokens=8)
    assert result.kv_cache == "fp8" and result.kv_bytes_per_token == summary["kv_bytes_per_token"]
    tokens = result.prompt_tokens[0] + sum(result.new_tokens) - 1
    assert result.kv_cache_bytes == tokens * result.kv_bytes_per_token["fp8"]  # no sink, no per-token scales
    assert summary["kv_bytes_per_token"]["fp8"] == 2 * 5 * 4 * 8
    run = runner.invoke(app, ["run", "Once upon a time", "-m", str(out), "-n", "4"])
    assert run.exit_code == 0 and "KV cache fp8" in run.stderr.strip().splitlines()[-1]
    args = ["eval", str(out), "--text", str(tinystories_file), "--seq-len", "128", "--max-windows", "2"]
    fp8 = json.loads(runner.invoke(app, [*args, "--json"]).stdout)
    full = json.loads(runner.invoke(app, [*args, "--json", "--kv-bits", "16"]).stdout)
    assert (fp8["kv_cache"], fp8["kv_bits"], full["kv_bits"]) == ("fp8", 8, 16)
    assert fp8["perplexity"] != full["perplexity"] and fp8["perplexity"] == pytest.approx(full["perplexity"], rel=0.05)
    assert "(fp8 KV)" in runner.invoke(app, args).stdout
    assert "KV cache: calibrated for fp8" in runner.invoke(app, ["inspect", str(out)]).stdout
    mismatch = runner.invoke(app, ["run", "Once", "-m", str(out), "--kv-bits", "8"])
    assert mismatch.exit_code == 2 and "calibrated for fp8" in mismatch.stderr


@pytest.mark.parametrize(
    ("options", "flag"),
    [
        (["--key-group-size", "4"], "--key-group-size"),
        (["--value-group-size", "8"], "--value-group-size"),
        (["--sink-tokens", "4"], "--sink-tokens"),
    ],
)
def test_fp8_with_int_grid_options_is_refused(
    rtn_artifact: Path, tinystories_file: Path, options: list[str], flag: str
) -> None:
    _refused(
        ["calibrate-kv", str(rtn_artifact), "--bits", "fp8", "-c", str(tinystories_file), *CALIB, *options],
        f"{flag} applies to the int8 / int4 grids only, not to --bits fp8",
        rtn_artifact,
    )


def test_fp8_replaces_int_scales_and_back(kv4_artifact, tmp_path: Path, tinystories_file: Path) -> None:
    source, _ = kv4_artifact
    out = tmp_path / "kv4-then-fp8"
    shutil.copytree(source, out)
    assert (
        runner.invoke(app, ["calibrate-kv", str(out), "--bits", "fp8", "-c", str(tinystories_file), *CALIB]).exit_code
        == 0
    )
    assert sorted(load_file(out / KV_FILE)) == sorted(
        f"model.layers.{i}.self_attn.{r}" for i in range(5) for r in ("k_scale", "v_scale")
    )  # no int tensor left behind
    assert api.verify_model_integrity(out).ok
    assert (
        runner.invoke(app, ["calibrate-kv", str(out), "--bits", "8", "-c", str(tinystories_file), *CALIB]).exit_code
        == 0
    )
    spec = api.load(out).kv_spec
    assert spec is not None and spec.label == "int8" and spec.sink_tokens == DEFAULT_SINK_TOKENS
