"""tests/missing_extras.py: in CI a skip for a missing package fails the run; elsewhere, and for vLLM's own
environment or other reasons (no GPU), a skip stays a skip."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from missing_extras import is_missing_package

TESTS = Path(__file__).parent
CONFTEST = (
    "from missing_extras import (  # noqa: F401\n"
    + "".join(
        f"    {hook},\n"
        for hook in (
            "pytest_collectreport",
            "pytest_runtest_logreport",
            "pytest_sessionfinish",
            "pytest_terminal_summary",
        )
    )
    + ")\n"
)
SKIPS = """\
import pytest

@pytest.mark.skipif(True, reason="frob is not installed (pip install frob)")
def test_skipif(): pass
def test_vllm(): pytest.importorskip("squeeze_no_such_vllm", reason="vLLM is not installed (scripts/check_vllm.sh)")
def test_gpu(): pytest.skip("needs a GPU")
def test_ok(): pass
"""


def run(directory: Path, ci: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "SQUEEZE_REQUIRE_EXTRAS")}
    env |= {"CI": ci, "PYTHONPATH": str(TESTS)}
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "--rootdir",
        str(directory),
        str(directory),
    ]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture
def suite(tmp_path: Path) -> Path:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_module_skip.py").write_text('import pytest\npytest.importorskip("squeeze_no_such_mod")\n')
    (tmp_path / "test_skips.py").write_text(SKIPS)
    return tmp_path


def test_in_ci_a_skip_for_a_missing_package_fails_the_run(suite: Path) -> None:
    result = run(suite, "true")
    assert result.returncode == 1, result.stdout
    assert "skipped for a missing package (fails in CI)" in result.stdout
    named = [line for line in result.stdout.splitlines() if line.startswith("test_")]
    assert named == [
        "test_module_skip.py: could not import 'squeeze_no_such_mod': No module named 'squeeze_no_such_mod'",
        "test_skips.py::test_skipif: frob is not installed (pip install frob)",
    ]  # not vLLM's (its own environment), not the GPU's


def test_outside_ci_they_stay_skips(suite: Path) -> None:
    result = run(suite, "")
    assert result.returncode == 0, result.stdout
    assert "1 passed, 4 skipped" in result.stdout and "fails in CI" not in result.stdout
    (suite / "test_module_skip.py").unlink()
    (suite / "test_skips.py").write_text(SKIPS.replace('reason="frob is not installed', 'reason="frob is slow'))
    assert run(suite, "true").returncode == 0  # in CI, skips for other reasons pass


def test_which_reasons_name_a_missing_package() -> None:
    assert is_missing_package("could not import 'lm_eval': No module named 'lm_eval'")
    assert is_missing_package("lm_eval is not installed (pip install 'squeeze[eval]')")
    assert not is_missing_package("vLLM is not installed (scripts/check_vllm.sh builds an environment with it)")
    assert not is_missing_package("stories260K not found at /x (../shared is absent)")
