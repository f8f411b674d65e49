"""Long jobs visible in logs: with stderr not a terminal, squeeze compress writes plain, rate-limited progress
lines there (every stage's start, counted work with done / total, elapsed and an estimate), and --json keeps
stdout exactly the JSON."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from squeeze.cli import progress_lines
from squeeze.cli.app import app
from squeeze.cli.progress_lines import ProgressLines

LINE = re.compile(r"^\[\d+:\d\d:\d\d\] (stage: \w+|.+ \d+/\d+ \(\d+%\), \d+:\d\d:\d\d in this stage, .+)$")


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_lines_are_rate_limited_and_estimate_what_is_left() -> None:
    clock, out = FakeClock(), []
    lines = ProgressLines({"quantize": "Quantizing (layers)"}, out.append, interval=5.0, clock=clock)
    clock.now += 2
    lines("load", 0, 0)
    clock.now += 1
    lines("quantize", 0, 0)  # the stage starts at 0:00:03
    for done in range(1, 11):  # one layer group per 2 s: a line at most every 5 s, the first and the last
        clock.now += 2
        lines("quantize", 7 * done, 70)
    assert out == [
        "[0:00:02] stage: load",
        "[0:00:03] stage: quantize",
        "[0:00:05] Quantizing (layers) 7/70 (10%), 0:00:02 in this stage, about 0:00:18 left",
        "[0:00:11] Quantizing (layers) 28/70 (40%), 0:00:08 in this stage, about 0:00:12 left",
        "[0:00:17] Quantizing (layers) 49/70 (70%), 0:00:14 in this stage, about 0:00:06 left",
        "[0:00:23] Quantizing (layers) 70/70 (100%), 0:00:20 in this stage, done",
    ]


def test_counted_work_inside_a_stage_is_timed_from_that_stage() -> None:
    clock, out = FakeClock(), []
    lines = ProgressLines({}, out.append, interval=0.0, clock=clock)
    lines("sensitivity", 0, 0)
    clock.now += 4
    lines("fisher", 1, 4)  # the first window took the 4 s since "sensitivity" started
    assert out[-1] == "[0:00:04] fisher 1/4 (25%), 0:00:04 in this stage, about 0:00:12 left"
    lines("fisher", 0, 4)
    assert out[-1].endswith("no estimate yet")


def compress_cli(model: Path, text: Path, out: Path, *extra: str) -> tuple[str, list[str]]:
    """stdout and the progress lines on stderr of squeeze compress (w4, Fisher on 4 windows of 32 tokens)."""
    args = ["compress", str(model), "-o", str(out), "-r", "w4", "-c", str(text), "--num-samples", "4"]
    result = CliRunner().invoke(app, [*args, "--seq-len", "32", *extra])  # CliRunner's stderr is not a terminal
    assert result.exit_code == 0, result.output
    logged = [line for line in result.stderr.splitlines() if line.startswith("[")]
    assert logged and all(LINE.match(line) for line in logged), logged
    return result.stdout, logged


def test_compress_logs_every_stage_and_json_stays_alone_on_stdout(
    tiny_llama_dir: Path, tiny_text_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(progress_lines, "LOG_INTERVAL_SECONDS", 0.0)  # every report is a line
    stdout, logged = compress_cli(tiny_llama_dir, tiny_text_file, tmp_path / "a", "--json")
    assert json.loads(stdout)["output"] == str(tmp_path / "a")  # stdout: exactly the JSON, nothing else
    stages = [line.split("stage: ")[1] for line in logged if "stage: " in line]
    expected = [
        "fingerprint",
        "calibrate",
        "load",
        "sensitivity",
        "plan",
        "quantize",
        "tune",
        "distill",
        "write",
        "seal",
    ]
    assert stages == [*expected, "publish"]
    fisher = [line for line in logged if "Fisher sensitivity (windows)" in line]
    assert [line.split()[4] for line in fisher] == ["1/4", "2/4", "3/4", "4/4"] and fisher[-1].endswith("done")
    quantize = [line for line in logged if "Quantizing (layers)" in line]  # one line per layer group
    assert [line.split()[3] for line in quantize] == ["7/14", "14/14"] and "left" in quantize[0]


def test_compress_log_lines_are_rate_limited(
    tiny_llama_dir: Path, tiny_text_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(progress_lines, "LOG_INTERVAL_SECONDS", 3600.0)  # only each count's first and last
    stdout, logged = compress_cli(tiny_llama_dir, tiny_text_file, tmp_path / "a")
    fisher = [line.split()[4] for line in logged if "Fisher sensitivity (windows)" in line]
    quantize = [line.split()[3] for line in logged if "Quantizing (layers)" in line]
    assert fisher == ["1/4", "4/4"] and quantize == ["7/14", "14/14"]
    assert "stage: publish" in logged[-1] and stdout.startswith("wrote ")  # the summary: stdout
