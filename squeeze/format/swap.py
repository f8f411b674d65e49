"""Put a finished directory at a path that may hold an older one, so that the path is never empty.

Linux's ``renameat2(RENAME_EXCHANGE)`` swaps two directories in one step: at every instant the path holds
either the old directory or the new one, and a SIGKILL at any moment leaves a complete one there. Where
the kernel or filesystem lacks it, the fallback renames the old directory aside under a recognisable
name (``.NAME.old-<random>.partial``) and the new one in; a run killed between those two renames leaves
the path empty for a moment, and :func:`restore_aside` (called by the next run) puts the old one back;
meanwhile verify and run name the copy aside and how to restore it (:func:`missing_artifact_error`).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import shlex
import tempfile
from pathlib import Path

from squeeze.errors import FormatError
from squeeze.format.atomic import fsync_directory
from squeeze.format.paths import short_path

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
ASIDE_INFIX = ".old-"
ASIDE_SUFFIX = ".partial"


@functools.cache
def _renameat2() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """libc's renameat2, looked up once, on first use, among the symbols the process already has loaded
    (``find_library`` would run ``ldconfig`` in a subprocess)."""
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # not glibc >= 2.28, or not Linux
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


def exchange(a: Path, b: Path) -> bool:
    """Swap the paths ``a`` and ``b`` atomically; False when this system cannot (nothing was changed)."""
    renameat2 = _renameat2()
    if renameat2 is None:
        return False
    result = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if result == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
        return False  # the kernel or this filesystem does not support the flag
    raise OSError(code, os.strerror(code), str(a))


def aside_pattern(target: Path) -> str:
    """The glob matching the directories the fallback moves ``target`` aside to."""
    return f".{target.name}{ASIDE_INFIX}*{ASIDE_SUFFIX}"


def swap_in(new: Path, target: Path) -> Path | None:
    """Move the directory ``new`` to ``target``; returns where the previous ``target`` now lies (None if none).

    ``new`` and ``target`` must be on one filesystem (siblings). The caller removes the returned directory
    (what it holds is the caller's to judge). An empty ``target`` directory is replaced as well.
    """
    parent = target.parent
    if not os.path.lexists(target):
        os.rename(new, target)
        fsync_directory(parent)
        return None
    if exchange(new, target):
        fsync_directory(parent)
        return new  # the old directory now lies at the staging path
    aside = Path(tempfile.mkdtemp(prefix=f".{target.name}{ASIDE_INFIX}", suffix=ASIDE_SUFFIX, dir=parent))
    os.rename(target, aside)  # replaces the empty placeholder mkdtemp made
    os.rename(new, target)  # a kill between these two renames: restore_aside() undoes the first
    fsync_directory(parent)
    return aside


def aside_copies(target: Path) -> list[Path]:
    """The directories a fallback swap cut short left ``target`` aside as (sorted; usually none or one)."""
    try:
        return sorted(p for p in target.parent.glob(aside_pattern(target)) if p.is_dir() and not p.is_symlink())
    except OSError:
        return []


def missing_artifact_error(target: Path) -> FormatError | None:
    """For a ``target`` that does not exist: a FormatError naming the copy a cut-short fallback swap left aside
    and how to put it back, or None when there is none (then it is simply missing)."""
    if os.path.lexists(target):
        return None
    copies = aside_copies(target)
    if not copies:
        return None
    aside = copies[0]
    more = f" (and {len(copies) - 1} more like it: pick the one you want)" if len(copies) > 1 else ""
    return FormatError(
        f"{short_path(target)} is missing: a calibrate-kv swap was cut short (killed between its two renames) and "
        f"left the artifact aside as {short_path(aside)}{more}",
        hint=f"restore it with: mv {shlex.quote(str(aside))} {shlex.quote(str(target))} (or run squeeze "
        "calibrate-kv on it again, which puts it back first)",
    )


def restore_aside(target: Path) -> Path | None:
    """After a fallback swap cut short (``target`` missing, its old self aside): put it back; returns it."""
    if os.path.lexists(target):
        return None
    candidates = aside_copies(target)
    if len(candidates) != 1:
        return None  # none, or ambiguous: never guess which one the user had
    os.rename(candidates[0], target)
    fsync_directory(target.parent)
    return target


__all__ = ["exchange", "swap_in", "restore_aside", "aside_pattern", "aside_copies", "missing_artifact_error"]
