"""``squeeze compress`` hands every option to api.compress, and an interrupted run's hint repeats them all."""

from __future__ import annotations

from typing import Any

import pytest
from typer.testing import CliRunner

from squeeze import api
from squeeze.cli.app import app
from squeeze.compression.job import CompressResult
from squeeze.errors import Interrupted

runner = CliRunner()
ALL_OPTIONS = [
    "my model", "-o", "out dir", "--recipe", "w3", "--calibration", "cal.txt", "--num-samples", "4",
    "--seq-len", "64", "--method", "rtn", "--bits", "3", "--sensitivity", "uniform", "--sensitive-fraction",
    "0.001", "--outlier-fraction", "0.002", "--group-size", "32", "--lut-dtype", "int8", "--max-shard-size",
    "1GB", "--keep-dtype", "bfloat16", "--embedding-bits", "8", "--generated-samples", "12", "--seed", "7",
    "--overwrite", "--force",
]  # fmt: skip


def _interrupted(resumable: bool, calls: list[dict[str, Any]]):
    def fake(*args: Any, **kwargs: Any) -> None:
        calls.append({"args": args, **kwargs})
        raise Interrupted("interrupted", resumable=resumable)

    return fake


@pytest.mark.parametrize("resumable", [True, False])
def test_every_option_reaches_api_and_the_resume_hint(monkeypatch: pytest.MonkeyPatch, resumable: bool) -> None:
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(api, "compress", _interrupted(resumable, calls))
    result = runner.invoke(app, ["compress", *ALL_OPTIONS], terminal_width=1000)
    assert result.exit_code == 130, result.output
    (call,) = calls
    assert [str(a) for a in call["args"]] == ["my model", "out dir", "w3", "cal.txt"]
    assert (call["seed"], call["overwrite"], call["resume"], call["restart"], call["force"]) == (
        7,
        True,
        False,
        False,
        True,
    )
    assert call["overrides"] == {
        "weights.method": "rtn",
        "weights.bits": 3,
        "weights.sensitivity": "uniform",
        "weights.sensitive_fraction": 0.001,
        "weights.outlier_fraction": 0.002,
        "weights.group_size": 32,
        "weights.lut_dtype": "int8",
        "output.max_shard_size": "1GB",
        "output.keep_dtype": "bfloat16",
        "weights.embedding_bits": 8,
        "weights.generated_samples": 12,
        "weights.target_bpw": None,  # not given (it and --bits come from one source: tests/compression)
    }
    assert call["calibration_overrides"] == {"num_samples": 4, "seq_len": 64}
    command = (
        "squeeze compress 'my model' --output 'out dir' --recipe w3 --calibration cal.txt --num-samples 4 "
        "--seq-len 64 --seed 7 --method rtn --bits 3 --sensitivity uniform --sensitive-fraction 0.001 "
        "--outlier-fraction 0.002 --group-size 32 --lut-dtype int8 --max-shard-size 1GB --keep-dtype bfloat16 "
        "--embedding-bits 8 --generated-samples 12 --overwrite"
    )
    hint = f"resume with: {command} --resume" if resumable else f"start again with: {command}"
    assert hint in " ".join(result.stderr.split()), result.stderr


def test_the_default_output_is_spelled_out_in_the_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(api, "compress", _interrupted(True, []))
    result = runner.invoke(app, ["compress", "models/tiny", "--recipe", "rtn-w4"], terminal_width=1000)
    assert "resume with: squeeze compress models/tiny --output tiny-rtn-w4 --recipe rtn-w4 --resume" in " ".join(
        result.stderr.split()
    )


def test_target_bpw_reaches_api_and_the_resume_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(api, "compress", _interrupted(True, calls))
    result = runner.invoke(app, ["compress", "m", "-o", "out", "--target-bpw", "3.5"], terminal_width=1000)
    assert result.exit_code == 130, result.output
    assert calls[0]["overrides"]["weights.target_bpw"] == 3.5
    assert "--target-bpw 3.5 --resume" in " ".join(result.stderr.split()), result.stderr


def test_max_memory_reaches_api_and_the_resume_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(api, "compress", _interrupted(True, calls))
    result = runner.invoke(app, ["compress", "m", "-o", "out", "--max-memory", "1GB"], terminal_width=1000)
    assert result.exit_code == 130, result.output
    assert calls[0]["max_memory"] == "1GB"
    assert "--max-memory 1GB --resume" in " ".join(result.stderr.split()), result.stderr


@pytest.mark.parametrize("rank", [0, 1])
def test_under_torchrun_only_rank_0_prints_the_summary(monkeypatch: pytest.MonkeyPatch, rank: int) -> None:
    done = CompressResult(output="out", model="m", recipe="w4", bits_per_weight=4.0, seconds=1.0)
    monkeypatch.setattr(api, "compress", lambda *args, **kwargs: done)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", str(rank))
    result = runner.invoke(app, ["compress", "m", "-o", "out", "--json"], terminal_width=1000)
    assert result.exit_code == 0, result.output
    assert ('"bits_per_weight"' in result.stdout) is (rank == 0), result.stdout


def test_under_torchrun_the_resume_hint_reruns_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(api, "compress", _interrupted(True, []))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    result = runner.invoke(app, ["compress", "m", "-o", "out"], terminal_width=1000)
    assert result.exit_code == 130
    assert "rerun the same torchrun command" in " ".join(result.stderr.split()), result.stderr
