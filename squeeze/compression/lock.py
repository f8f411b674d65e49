"""An exclusive, non-blocking lock on an output directory's work area (fcntl.flock on a lock file).

The kernel drops a flock when its holder dies, SIGKILL included, so a crashed run never leaves a stale
lock behind: the next run simply takes it. A second live run is refused at once, never kept waiting.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from types import TracebackType

from squeeze.errors import LockError

LOCK_NAME = "lock"


class OutputLock:
    """Hold ``directory/lock`` exclusively until ``release()`` (or the end of a ``with`` block)."""

    def __init__(
        self,
        directory: Path,
        *,
        name: str = LOCK_NAME,
        holder: str = "squeeze compress",
        target: Path | None = None,
        remove: bool = False,
    ) -> None:
        """``holder`` and ``target`` (default: the work area's parent, the output) name the other run in the
        refusal; ``remove``: unlink the lock file on release (a lock file kept beside an artifact, not in a
        work area that goes anyway)."""
        self.path = Path(directory) / name
        self._holder = holder
        self._target = target if target is not None else self.path.parent.parent
        self._remove = remove
        self._fd: int | None = None

    def acquire(self) -> OutputLock:
        """Take the lock or raise LockError naming the holder's pid (if it wrote one)."""
        for _ in range(10):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_pid(fd)
                os.close(fd)
                who = f" (pid {holder})" if holder else ""
                raise LockError(
                    f"another {self._holder}{who} is writing into {self._target}",
                    hint="wait for it to finish, or choose another --output",
                ) from None
            # The holder may have finished and removed the work area between our open and our flock: then
            # we locked an unlinked file that nobody else will ever see. Lock the file now at the path.
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()}\n".encode())
                self._fd = fd
                return self
            os.close(fd)
            self.path.parent.mkdir(parents=True, exist_ok=True)
        raise LockError(f"cannot lock {self.path}: it keeps being replaced", hint="is another squeeze running?")

    def release(self) -> None:
        """Drop the lock (closing the descriptor releases the flock)."""
        if self._fd is not None:
            if self._remove:  # before the unlock: a run waiting on this inode sees it replaced, and retries
                with contextlib.suppress(OSError):
                    if os.stat(self.path).st_ino == os.fstat(self._fd).st_ino:
                        os.unlink(self.path)
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None

    def __enter__(self) -> OutputLock:
        return self.acquire()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


def _read_pid(fd: int) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return int(os.pread(fd, 32, 0).decode().strip() or 0) or None
    return None
