"""The hardening tests run the CLI in child processes (about 50 of them, 3-30 s each on 2 cores): too slow for
the default run, which deselects them. They run when asked for by path or with SQUEEZE_HARDENING=1:

    pytest tests/hardening                      # or a file / test id under it
    SQUEEZE_HARDENING=1 bash scripts/test.sh    # the whole suite with them
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _inside(path: Path) -> bool:
    return path == HERE or HERE in path.parents


def _asked_for(config: pytest.Config) -> bool:
    """An argument of this run names this folder or something in it."""
    for arg in config.args:
        path = Path(str(arg).split("::", 1)[0])
        if _inside((Path(config.invocation_params.dir) / path).resolve()):
            return True
    return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("SQUEEZE_HARDENING") == "1" or _asked_for(config):
        return
    ours = [item for item in items if _inside(Path(str(item.fspath)).resolve())]
    if ours:
        config.hook.pytest_deselected(items=ours)
        dropped = {id(item) for item in ours}
        items[:] = [item for item in items if id(item) not in dropped]
