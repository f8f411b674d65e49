"""Safe handling of artifact-relative paths: validation, and opening files without leaving the artifact.

Manifest paths are relative POSIX paths inside the artifact directory. Anything that could name a file
outside it, or name the same file two ways, is rejected before a single byte is read.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

from squeeze.errors import FormatError

_OPEN_DIR = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
_OPEN_FILE = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)


def check_relative_path(path: object, where: str) -> str:
    """Return ``path`` if it is a clean relative POSIX path, else raise FormatError naming ``where``."""
    if not isinstance(path, str) or not path:
        raise FormatError(f"{where}: path must be a non-empty string, found {path!r}")
    if "\x00" in path:
        raise FormatError(f"{where}: path {path!r} contains a NUL byte")
    if "\\" in path:
        raise FormatError(f"{where}: path {path!r} contains a backslash; manifest paths use '/'")
    if path.startswith("/") or (len(path) > 1 and path[1] == ":"):
        raise FormatError(f"{where}: path {path!r} is absolute; manifest paths are relative to the artifact")
    parts = path.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise FormatError(f"{where}: path {path!r} has an empty, '.' or '..' component")
    return path


def open_inside(root_fd: int, relative: str) -> int:
    """Open ``relative`` under the directory fd ``root_fd`` for reading, refusing symlinks at every step.

    Each component is opened with O_NOFOLLOW relative to its parent's fd, so no symlink (even one swapped
    in after a check) can lead outside the artifact. Returns a file descriptor; the caller closes it.
    Raises OSError (ELOOP for a symlink, ENOENT for a missing file) and FormatError for a non-regular file.
    """
    parts = relative.split("/")
    fd = os.dup(root_fd)
    try:
        for part in parts[:-1]:
            next_fd = os.open(part, _OPEN_DIR, dir_fd=fd)
            os.close(fd)
            fd = next_fd
        file_fd = os.open(parts[-1], _OPEN_FILE, dir_fd=fd)
    finally:
        os.close(fd)
    if not stat.S_ISREG(os.fstat(file_fd).st_mode):
        os.close(file_fd)
        raise FormatError(f"{relative}: not a regular file")
    return file_fd


def walk_artifact(root: Path) -> Iterator[tuple[str, os.stat_result]]:
    """Yield (relative POSIX path, lstat) of every entry below ``root`` without following symlinks.

    Directories are descended (not yielded); symlinks and special files are yielded so callers reject them.
    """
    stack = [("", root)]
    while stack:
        prefix, directory = stack.pop()
        with os.scandir(directory) as entries:
            for entry in sorted(entries, key=lambda e: e.name):
                relative = f"{prefix}{entry.name}"
                info = entry.stat(follow_symlinks=False)
                if stat.S_ISDIR(info.st_mode):
                    stack.append((relative + "/", Path(entry.path)))
                else:
                    yield relative, info
