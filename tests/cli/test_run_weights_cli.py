"""``squeeze run`` and the weights' path: compressed by default (native kernels), ``--dense``, ``--low-memory``,
their conflict, and the path named on the stats line and in ``--json``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from squeeze.cli.app import app
from squeeze.runtime.kernels.cpu_build import cpu_kernels

runner = CliRunner()
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def lut_artifact(tmp_path_factory: pytest.TempPathFactory, compress_tiny) -> Path:
    return compress_tiny(tmp_path_factory.mktemp("weights") / "w4-s045", "w4-s045")


@pytest.fixture(scope="module")
def rtn_artifact(tmp_path_factory: pytest.TempPathFactory, compress_tiny) -> Path:
    return compress_tiny(tmp_path_factory.mktemp("weights") / "rtn-w4", "rtn-w4")


def run(*args: str):
    return runner.invoke(app, ["run", *args])


def _linears(artifact: Path) -> int:
    return len(json.loads((artifact / "config.json").read_text())["quantization_config"]["modules"])


def _native() -> str:
    """The path LUT weights take by default on this machine ("dense" without a C++ compiler)."""
    kernels = cpu_kernels()
    return f"native-{kernels.isa}" if kernels is not None else "dense"


def _json(*args: str) -> dict:
    result = run(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_the_stats_line_names_the_path_the_weights_ran(lut_artifact: Path, rtn_artifact: Path) -> None:
    n = _linears(lut_artifact)
    for artifact, args, expected in (
        (lut_artifact, [], f"weights: {_native()} ({n} linears)"),
        (lut_artifact, ["--dense"], f"weights: dense ({n} linears)"),
        (rtn_artifact, [], f"weights: dense ({n} linears)"),  # no kernel covers RTN: the dense fallback
        (rtn_artifact, ["--low-memory"], f"weights: chunked ({n} linears)"),
    ):
        result = run(PROMPT, "-m", str(artifact), "-n", "4", *args)
        assert result.exit_code == 0, result.output
        last = result.stderr.strip().splitlines()[-1]
        assert last.startswith("load ") and last.endswith(" | " + expected), (args, last)


def test_json_says_which_path_ran_and_dense_agrees_with_the_default(lut_artifact: Path) -> None:
    n = _linears(lut_artifact)
    default = _json(PROMPT, "-m", str(lut_artifact), "-n", "8")
    assert default["weights_path"] == f"{_native()} ({n} linears)"
    assert default["weight_paths"] == {_native(): n}
    assert default["dense"] is False and default["low_memory"] is False
    dense = _json(PROMPT, "-m", str(lut_artifact), "-n", "8", "--dense")
    assert dense["weights_path"] == f"dense ({n} linears)" and dense["weight_paths"] == {"dense": n}
    assert dense["dense"] is True and dense["low_memory"] is False
    assert dense["texts"] == default["texts"]  # the kernels compute the dense reference's product (greedy)
    low = _json(PROMPT, "-m", str(lut_artifact), "-n", "8", "--low-memory")
    assert low["weight_paths"] == default["weight_paths"]  # the kernels cover every LUT weight: nothing to slice
    assert low["low_memory"] is True and low["texts"] == default["texts"]


def test_dense_with_low_memory_is_one_error_before_anything_loads(lut_artifact: Path, tmp_path: Path) -> None:
    for model in (lut_artifact, tmp_path / "none"):  # checked before the artifact is even looked at
        result = run(PROMPT, "-m", str(model), "--dense", "--low-memory", "--json")
        assert result.exit_code == 2, result.output
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 2 and lines[0].startswith("Error: --dense and --low-memory"), lines
        assert lines[1].startswith("Hint: ") and result.stdout == ""


def test_a_dense_run_that_does_not_fit_hints_to_drop_dense(lut_artifact: Path, monkeypatch) -> None:
    import squeeze.runtime.memory as memory

    estimate = memory.estimate_load(lut_artifact, native=memory.native_kernels_expected())
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: estimate.total(dense_cache=True) - 1)
    result = run(PROMPT, "-m", str(lut_artifact), "-n", "2", "--dense")
    assert result.exit_code == 2 and result.stdout == "", result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("Error: not enough memory to load"), lines
    assert lines[1].startswith("Hint: drop --dense"), lines
    assert run(PROMPT, "-m", str(lut_artifact), "-n", "2").exit_code == 0  # the hint is right: it fits


def test_without_a_compiler_one_warning_line_and_the_dense_path(lut_artifact: Path, tmp_path: Path) -> None:
    # the console script (main) formats squeeze's warnings as one line; a fresh process builds nothing
    import os
    import subprocess
    import sys

    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"), "SQUEEZE_KERNEL_CACHE": str(tmp_path / "cache")}
    argv = ["squeeze", "run", PROMPT, "-m", str(lut_artifact), "--max-new-tokens", "2"]
    code = f"import sys; sys.argv = {argv!r}; from squeeze.cli.app import main; main()"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    warned = [ln for ln in lines if "native CPU kernels unavailable" in ln]
    assert len(warned) == 1 and warned[0].startswith("Warning: squeeze: native CPU kernels unavailable (no C++")
    assert not any("warnings.warn" in ln or "KernelWarning" in ln for ln in lines)  # no source line, no class
    assert lines[-1].endswith(f"weights: dense ({_linears(lut_artifact)} linears)")
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())
