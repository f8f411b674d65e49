"""What every benchmark script prints about its own run: the code it measured and the command that ran it."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path


def revision() -> str:
    """Which squeeze this run measures: where it was imported from, and the repository's commit (dirty or not)."""
    import squeeze

    where = Path(squeeze.__file__).resolve().parent
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--", "squeeze"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
    except OSError:
        head, dirty = "?", ""
    state = " with uncommitted changes under squeeze/" if dirty else ""
    return f"squeeze imported from {where}; {root} at {head}{state}"


def command_line() -> str:
    """The command that produced this run, as it would be typed from the current directory."""
    exe = sys.executable
    try:
        exe = os.path.relpath(exe) if not os.path.relpath(exe).startswith("..") else exe
    except ValueError:
        pass
    return shlex.join([exe, *sys.argv])


__all__ = ["revision", "command_line"]
