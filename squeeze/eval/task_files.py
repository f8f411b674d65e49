"""``--include-path``: the task YAMLs lm-evaluation-harness will read, checked before it reads them.

lm-eval opens every ``**/*.yaml`` under the directory and imports the Python file each ``!function
module.name`` tag names, relative to the YAML. A FIFO named ``x.yaml`` blocks its ``open`` forever; a tag
naming ``../outside.load`` imports a file from outside the directory the user named (or fails deep inside
lm-eval when there is none). :func:`check_include_path` refuses both, and a YAML too large to be a task,
with a ConfigError naming the file, before lm-eval starts.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from squeeze.errors import ConfigError
from squeeze.format.paths import read_user_file, short_path

#: A task YAML is a few KB; lm-eval's largest built-in ones are under 100 KB.
MAX_TASK_YAML_BYTES = 4 * 2**20
#: Task YAMLs read at most (lm-eval's own task folder holds about 12,000).
MAX_TASK_YAMLS = 50_000
_FUNCTION_TAG = re.compile(rb"!function\s+['\"]?([^\s'\"#]+)")
_HINT = "point --include-path at a directory of task YAML files (and the .py files their !function tags name)"


def check_include_path(path: str | os.PathLike[str]) -> Path:
    """``path`` as a directory of task YAMLs lm-eval can read without blocking or leaving it; ConfigError for
    a path that is not a directory, a ``*.yaml`` that is not a regular file (a FIFO, a device, a dangling
    link), one over :data:`MAX_TASK_YAML_BYTES`, or a ``!function`` tag naming a file outside ``path`` or none."""
    root = Path(path)
    if not root.is_dir():
        raise ConfigError(f"--include-path {short_path(root)} is not a directory", hint=_HINT)
    top = root.resolve()
    for count, yaml_path in enumerate(root.glob("**/*.yaml"), start=1):  # the walk lm-eval makes
        if count > MAX_TASK_YAMLS:
            raise ConfigError(
                f"--include-path {short_path(root)} holds more than {MAX_TASK_YAMLS} task YAMLs", hint=_HINT
            )
        _check_yaml(yaml_path, top)
    return root


def _check_yaml(yaml_path: Path, top: Path) -> None:
    try:
        mode = os.stat(yaml_path).st_mode
    except OSError as exc:
        raise ConfigError(
            f"--include-path: cannot read the task YAML {short_path(yaml_path)}: {exc.strerror or exc}",
            hint="remove the broken file or link, or " + _HINT,
        ) from None
    if not stat.S_ISREG(mode):
        raise ConfigError(
            f"--include-path: {short_path(yaml_path)} is not a regular file (a FIFO, a device or a directory "
            "named like a task YAML); lm-eval would block or fail reading it",
            hint="remove it or rename it, or " + _HINT,
        )
    try:
        text = read_user_file(yaml_path, MAX_TASK_YAML_BYTES, "task YAML")
    except OSError as exc:
        raise ConfigError(
            f"--include-path: cannot read the task YAML {short_path(yaml_path)}: {exc.strerror or exc}", hint=_HINT
        ) from None
    for match in _FUNCTION_TAG.finditer(text):
        _check_function(match.group(1).decode("utf-8", "replace"), yaml_path, top)


def _check_function(reference: str, yaml_path: Path, top: Path) -> None:
    """A ``!function module.name`` tag: lm-eval imports ``<the YAML's folder>/module.py``; it must lie inside
    ``top`` and exist as a regular file."""
    module, _, _name = reference.rpartition(".")
    shown = f"--include-path: {short_path(yaml_path)} has !function {reference}"
    if not module:
        raise ConfigError(f"{shown}: expected module.function", hint="e.g. !function utils.process_docs")
    target = (yaml_path.parent / f"{module}.py").resolve()
    if top != target and top not in target.parents:
        raise ConfigError(
            f"{shown}, which names {short_path(target)}, outside the include path {short_path(top)}",
            hint="put the task's Python file next to its YAML, inside --include-path",
        )
    if not target.is_file():
        raise ConfigError(
            f"{shown}, and {short_path(target)} is not a file",
            hint="add the task's Python file next to its YAML, or fix the !function tag",
        )


__all__ = ["MAX_TASK_YAML_BYTES", "check_include_path"]
