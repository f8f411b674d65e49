"""Streaming SHA-256 of artifact files, in parallel threads, with bounded memory.

Files are opened through ``open_inside`` (never following a symlink, never leaving the artifact) and read
in fixed-size chunks into one reused buffer per thread; hashlib releases the GIL on large updates, so
threads hash several files at disk speed. For safetensors files the header bytes are captured from the
same read, so the header that gets validated is the header that was hashed.
"""

from __future__ import annotations

import hashlib
import io
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from squeeze.format.paths import open_inside
from squeeze.format.safetensors_header import MAX_HEADER_BYTES

CHUNK_BYTES = 8 * 2**20
#: Small files (JSON, tokenizer) are kept in memory after hashing, so they can be parsed from the hashed bytes.
KEEP_BYTES = 16 * 2**20

ProgressFn = Callable[[int, int], None]


@dataclass(frozen=True)
class HashedFile:
    """The result of reading one file: its size, SHA-256 and, when captured, its leading bytes."""

    path: str
    size: int
    sha256: str
    head: bytes  # the whole file if small (<= KEEP_BYTES), else a safetensors header prefix, else b""
    #: With ``capture``: the whole file as read, uint8 (size,), the very bytes that were hashed.
    data: torch.Tensor | None = None
    #: With ``chunk_bytes`` (sealing): the SHA-256 of each ``chunk_bytes`` piece, for a file larger than that.
    chunks: tuple[str, ...] = ()


class ChunkDigests:
    """SHA-256 of consecutive ``chunk_bytes`` pieces of a stream fed in buffers of any size."""

    def __init__(self, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes
        self.digests: list[str] = []
        self._current = hashlib.sha256()
        self._filled = 0

    def update(self, data: memoryview) -> None:
        while len(data):
            take = min(len(data), self.chunk_bytes - self._filled)
            self._current.update(data[:take])
            self._filled += take
            data = data[take:]
            if self._filled == self.chunk_bytes:
                self.digests.append(self._current.hexdigest())
                self._current, self._filled = hashlib.sha256(), 0

    def finish(self) -> tuple[str, ...]:
        """The digests; none when the whole stream fit in one chunk (the whole-file digest covers it)."""
        if self._filled:
            self.digests.append(self._current.hexdigest())
            self._current, self._filled = hashlib.sha256(), 0
        return tuple(self.digests) if len(self.digests) > 1 else ()


def hash_file(
    root_fd: int,
    relative: str,
    on_bytes: Callable[[int], None] | None = None,
    *,
    capture: bool = False,
    chunk_bytes: int | None = None,
) -> HashedFile:
    """SHA-256 of ``relative`` under ``root_fd``. Raises OSError / FormatError from ``open_inside``.

    With ``capture`` the file is read into one private uint8 tensor and hashed from there, so a caller
    that builds tensors from ``data`` uses exactly the bytes that were hashed, whatever happens to the
    file afterwards (replaced, rewritten in place). With ``chunk_bytes`` the same read also yields the
    digest of each ``chunk_bytes`` piece (``chunks``, for a file larger than one piece).
    """
    fd = open_inside(root_fd, relative)
    digest = hashlib.sha256()
    pieces = ChunkDigests(chunk_bytes) if chunk_bytes is not None else None
    head = bytearray()
    size = 0
    want_head = KEEP_BYTES
    file_size = os.fstat(fd).st_size
    data = torch.empty(file_size, dtype=torch.uint8) if capture else None
    buffer = bytearray(0 if capture else CHUNK_BYTES)
    # ndarray.data: the same writable view; numpy types memoryview(ndarray) only for Python >= 3.12
    view = data.numpy().data if data is not None else memoryview(buffer)
    with io.FileIO(fd, "rb", closefd=True) as handle:
        keep_all = file_size <= KEEP_BYTES
        if not keep_all and relative.endswith(".safetensors"):
            want_head = 8 + MAX_HEADER_BYTES  # trimmed below once the real header length is known
        elif not keep_all:
            want_head = 0
        while True:
            if data is not None:  # read straight into the private copy, chunk by chunk
                if size >= file_size:
                    break  # a file that grew since fstat reads as its fstat size; the size check catches it
                chunk = view[size : min(size + CHUNK_BYTES, file_size)]
                count = handle.readinto(chunk)
                chunk = chunk[:count]
            else:
                count = handle.readinto(buffer)
                chunk = view[:count]
            if not count:
                break
            digest.update(chunk)
            if pieces is not None:
                pieces.update(chunk)
            if len(head) < want_head:
                head += chunk[: want_head - len(head)]
                if not keep_all and len(head) >= 8:
                    want_head = min(want_head, 8 + int.from_bytes(head[:8], "little"))
                    del head[want_head:]
            size += count
            if on_bytes is not None:
                on_bytes(count)
    if data is not None and size != file_size:
        data = data[:size]  # the file shrank while being read: the size check reports it
    chunks = pieces.finish() if pieces is not None else ()
    return HashedFile(path=relative, size=size, sha256=digest.hexdigest(), head=bytes(head), data=data, chunks=chunks)


class ByteCounter:
    """Thread-safe running byte count reported to a ``progress(done, total)`` callback."""

    def __init__(self, total: int, progress: ProgressFn | None) -> None:
        self.total = total
        self.done = 0
        self._progress = progress
        self._lock = threading.Lock()

    def __call__(self, count: int) -> None:
        with self._lock:
            self.done += count
            done = self.done
        if self._progress is not None:
            self._progress(done, self.total)


def default_workers(n_files: int) -> int:
    return max(1, min(n_files, 8, (os.cpu_count() or 2) * 2))


def hash_files(
    root_fd: int,
    paths: Iterable[str],
    total_bytes: int,
    *,
    workers: int | None = None,
    progress: ProgressFn | None = None,
    capture: Callable[[str], bool] | None = None,
    chunk_bytes: int | None = None,
) -> dict[str, HashedFile | BaseException]:
    """Hash ``paths`` in parallel threads; per path, the HashedFile or the exception that stopped it.

    ``capture(path)`` selects the files whose bytes are kept, ``chunk_bytes`` asks for chunk digests
    (see ``hash_file``).
    """
    paths = list(paths)
    counter = ByteCounter(total_bytes, progress)
    # only passed when asked for: tests wrap hash_file with the plain signature
    options: dict[str, int] = {} if chunk_bytes is None else {"chunk_bytes": chunk_bytes}

    def one(path: str) -> HashedFile | BaseException:
        try:
            return hash_file(root_fd, path, counter, capture=bool(capture and capture(path)), **options)
        except Exception as exc:  # noqa: BLE001 - reported against that file; the others still get checked
            return exc

    with ThreadPoolExecutor(max_workers=workers or default_workers(len(paths))) as pool:
        return dict(zip(paths, pool.map(one, paths), strict=True))
