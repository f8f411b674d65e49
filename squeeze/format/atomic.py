"""Atomic file writes: temp file in the same directory, fsync, rename, fsync of the directory.

A process killed at any moment leaves either the old file or no file under the final name, never a
partial one. Temp files are hidden (``.NAME.<random>.partial``) so they are easy to spot and clean.
Committed files get the mode any tool would give them (0666 less the umask): ``mkstemp`` makes its temp
files 0600, which would leave an artifact unreadable to the service account that serves it.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

PARTIAL_SUFFIX = ".partial"


def fsync_directory(directory: str | os.PathLike[str]) -> None:
    """Make a rename or create inside ``directory`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories; the rename is still atomic there
    finally:
        os.close(fd)


def current_umask() -> int:
    """The process umask, read without changing it (Linux ``/proc``; elsewhere set and restored at once)."""
    try:
        with open("/proc/self/status", "rb") as handle:
            for line in handle:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # racy only against another thread changing the umask, which nothing here does
    os.umask(mask)
    return mask


def file_mode() -> int:
    """Permission bits of a newly written file: 0666 less the umask."""
    return 0o666 & ~current_umask()


def directory_mode() -> int:
    """Permission bits of a newly made directory: 0777 less the umask."""
    return 0o777 & ~current_umask()


def temp_path_for(final: Path) -> Path:
    """A fresh, unique hidden temp path next to ``final`` (same filesystem, so rename is atomic)."""
    fd, name = tempfile.mkstemp(prefix=f".{final.name}.", suffix=PARTIAL_SUFFIX, dir=final.parent)
    os.close(fd)
    return Path(name)


def commit_file(temp: Path, final: Path) -> None:
    """fsync ``temp``, give it the umask's mode, rename it over ``final`` and fsync the directory."""
    with open(temp, "rb+") as handle:
        os.fchmod(handle.fileno(), file_mode())
        os.fsync(handle.fileno())
    os.replace(temp, final)
    fsync_directory(final.parent)


@contextlib.contextmanager
def atomic_writer(final: str | os.PathLike[str]) -> Iterator[BinaryIO]:
    """Open a binary temp file that replaces ``final`` atomically when the block exits without error."""
    final = Path(final)
    temp = temp_path_for(final)
    try:
        with open(temp, "wb") as handle:
            yield handle
            handle.flush()
            os.fchmod(handle.fileno(), file_mode())
            os.fsync(handle.fileno())
        os.replace(temp, final)
        fsync_directory(final.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            temp.unlink()
        raise


def atomic_write_bytes(final: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``final`` atomically."""
    with atomic_writer(final) as handle:
        handle.write(data)


def atomic_write_text(final: str | os.PathLike[str], text: str) -> None:
    """Write UTF-8 ``text`` to ``final`` atomically."""
    atomic_write_bytes(final, text.encode("utf-8"))
