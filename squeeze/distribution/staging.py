"""The staging directory of a pull: a hidden sibling of the output where files are written while they download.

``<parent>/.<name>.squeeze-pull/`` holds partial files under their artifact paths. It is locked (flock on
its directory fd) while a pull writes, every file is opened relative to its fd with O_NOFOLLOW at each
component (nothing can be written outside it, whatever links appear), and when every file verified it is
renamed to the output in one step: the output name never holds a partial artifact.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from pathlib import Path

from squeeze.errors import ConfigError, LockError
from squeeze.format.atomic import file_mode, fsync_directory
from squeeze.format.paths import open_root, short_path, walk_artifact

_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
STAGING_SUFFIX = ".squeeze-pull"


def staging_path(output: Path) -> Path:
    """The staging directory of a pull into ``output``."""
    return output.parent / f".{output.name}{STAGING_SUFFIX}"


class Staging:
    """An open, locked staging directory (a context manager; closing releases the lock)."""

    def __init__(self, output: Path) -> None:
        self.output = output
        self.path = staging_path(output)
        self.fd = -1

    def __enter__(self) -> Staging:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileExistsError):
                os.mkdir(self.path)
        except OSError as exc:
            raise ConfigError(
                f"cannot create {short_path(self.path)}: {exc.strerror}",
                hint="check the permissions of the output's parent directory, or pass another --output",
            ) from None
        if stat.S_ISLNK(os.lstat(self.path).st_mode):
            raise ConfigError(
                f"{short_path(self.path)} is a symbolic link; a pull's staging directory must not be",
                hint="remove the link (it holds nothing squeeze wrote) and rerun",
            )
        self.fd = open_root(self.path)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self.fd)
            self.fd = -1
            raise LockError(
                f"another squeeze pull is writing {short_path(self.output)} (its staging directory is locked)",
                hint="wait for it to finish, or pull into another --output",
            ) from None
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def _parent_fd(self, relative: str, *, create: bool) -> tuple[int, str]:
        """(an fd of ``relative``'s directory, the file name); directories made as needed, never followed."""
        parts = relative.split("/")
        fd = os.dup(self.fd)
        try:
            for part in parts[:-1]:
                if create:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, dir_fd=fd)
                next_fd = os.open(part, _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = next_fd
        except BaseException:
            os.close(fd)
            raise
        return fd, parts[-1]

    def open_file(self, relative: str, *, create: bool = False) -> int:
        """A read-write fd of the partial file ``relative`` (made when ``create``); OSError on a link."""
        parent, name = self._parent_fd(relative, create=create)
        try:
            fd = os.open(name, _FILE_FLAGS | (os.O_CREAT if create else 0), file_mode(), dir_fd=parent)
        finally:
            os.close(parent)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError(errno.EINVAL, f"{relative} is not a regular file")
        return fd

    def remove(self, relative: str) -> None:
        """Delete the partial file ``relative`` (a bad download), if there."""
        with contextlib.suppress(OSError):
            parent, name = self._parent_fd(relative, create=False)
            try:
                os.unlink(name, dir_fd=parent)
            finally:
                os.close(parent)

    def write_small(self, relative: str, data: bytes) -> None:
        """Write ``data`` as ``relative`` (the manifest, the signature), replacing what was there."""
        fd = self.open_file(relative, create=True)
        try:
            os.ftruncate(fd, 0)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)

    def prune(self, keep: set[str]) -> list[str]:
        """Delete every file in the staging directory that is not in ``keep`` (left by a pull of another
        version into the same output); returns their paths."""
        removed = [relative for relative, _ in walk_artifact(self.fd) if relative not in keep]
        for relative in removed:
            self.remove(relative)
        return removed

    def commit(self, sizes: dict[str, int]) -> None:
        """Check every file's size, make them durable, and rename the staging directory to the output.

        The output must not exist, or be an empty directory (rename replaces it atomically).
        """
        for relative, size in sizes.items():
            fd = self.open_file(relative)
            try:
                found = os.fstat(fd).st_size
                if found != size:  # the downloader checked each file: this is a bug, never the server's doing
                    raise RuntimeError(f"staged {relative} has {found} bytes, expected {size}")
                os.fsync(fd)
            finally:
                os.close(fd)
        os.fsync(self.fd)
        try:
            os.rename(self.path, self.output)
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                raise ConfigError(
                    f"{short_path(self.output)} appeared while pulling and is not empty",
                    hint="pull into a new or empty directory",
                ) from None
            raise
        fsync_directory(self.output.parent)
