"""Fixtures of the pull tests: a served artifact, the local HTTP server over it, and a private artifact cache."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from pull_server import ArtifactServer, build_artifact


@pytest.fixture
def served(tmp_path: Path) -> Path:
    """The directory the server serves: one sealed artifact (a module may override it)."""
    return build_artifact(tmp_path / "served")


@pytest.fixture
def server(served: Path) -> Iterator[ArtifactServer]:
    with ArtifactServer(served, timeout=5.0) as running:
        yield running


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``$SQUEEZE_CACHE`` pointed at a fresh directory."""
    monkeypatch.setenv("SQUEEZE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"
