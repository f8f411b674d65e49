"""Issue 41 item 14: a fallback swap (no renameat2) killed between its two renames leaves the artifact path
empty; verify and run then name the copy aside and how to put it back, instead of "no manifest"."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from squeeze import api
from squeeze.cli.app import app
from squeeze.errors import FormatError
from squeeze.format import swap

runner = CliRunner()


def killed_fallback_swap(artifact: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Swap a copy in at ``artifact`` with the fallback, "killed" after the first rename; the aside path."""
    new = artifact.parent / ".new"
    shutil.copytree(artifact, new)
    monkeypatch.setattr(swap, "exchange", lambda a, b: False)
    real_rename = os.rename
    calls = []

    def rename(src, dst):
        calls.append(src)
        if len(calls) == 2:
            raise KeyboardInterrupt  # SIGKILL's stand-in: nothing after this runs
        real_rename(src, dst)

    monkeypatch.setattr(swap.os, "rename", rename)
    with pytest.raises(KeyboardInterrupt):
        swap.swap_in(new, artifact)
    monkeypatch.setattr(swap.os, "rename", real_rename)
    assert not artifact.exists()
    (aside,) = swap.aside_copies(artifact)
    return aside


def test_verify_and_run_name_the_copy_aside(artifact: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    aside = killed_fallback_swap(artifact, monkeypatch)
    with pytest.raises(FormatError, match="swap was cut short") as info:
        api.verify_model_integrity(artifact)
    assert str(aside) in info.value.message and f"mv {aside} {artifact}" in (info.value.hint or "")
    for args in (["verify", str(artifact)], ["run", "hi", "-m", str(artifact)]):
        result = runner.invoke(app, args)
        assert result.exit_code == 2, result.output
        assert "swap was cut short" in result.stderr and aside.name in result.stderr
    os.rename(aside, artifact)  # the hint's command restores it
    assert api.verify_model_integrity(artifact).ok


def test_a_plainly_missing_artifact_is_still_no_manifest(tmp_path: Path) -> None:
    with pytest.raises(FormatError, match="no manifest"):
        api.verify_model_integrity(tmp_path / "never-there")
