"""Streaming SHA-256 of artifact files, in parallel threads, with bounded memory.

Files are opened through ``open_inside`` (never following a symlink, never leaving the artifact) and read
in fixed-size pieces into one reused buffer per thread; hashlib releases the GIL on large updates, so
threads hash several files at disk speed. A file the manifest lists with chunk digests (format version 2)
is checked as independent chunk tasks, ``os.preadv`` at each chunk's offset, so one big shard is hashed
on every worker thread. For safetensors files the header bytes are captured from the same read, so the
header that gets validated is the header that was hashed.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import mmap
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from squeeze.errors import IntegrityError
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
    #: The SHA-256 of the whole file. For a file checked by its chunk digests (``ChunkPlan``) it is not
    #: recomputed: it is the manifest's, which the matching chunk digests are bound to by the root digest.
    sha256: str
    head: bytes  # the whole file if small (<= KEEP_BYTES), else a safetensors header prefix, else b""
    #: With ``capture``: the whole file as read, uint8 (size,), the very bytes that were hashed.
    data: torch.Tensor | None = None
    #: With ``chunk_bytes`` (sealing) or a ``ChunkPlan`` (verifying): the SHA-256 of each chunk.
    chunks: tuple[str, ...] = ()


@dataclass(frozen=True)
class ChunkPlan:
    """What a manifest says about a file listed with chunk digests: check it chunk by chunk."""

    size: int
    sha256: str  # the whole file's, as listed (reported back when every chunk matches)
    chunk_bytes: int
    chunks: tuple[str, ...]  # ceil(size / chunk_bytes) lowercase hex SHA-256 digests


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


#: Captures at least this large are backed by an anonymous mapping advised to use transparent huge pages.
HUGE_PAGE_BYTES = 2 * 2**20


def private_bytes(size: int) -> torch.Tensor:
    """An uninitialised uint8 tensor of ``size`` bytes, the private copy a capture reads into.

    A large one is an anonymous ``mmap`` advised MADV_HUGEPAGE where the OS offers it (Linux with
    transparent huge pages in "madvise" mode): the first write to each page is the load's hidden cost
    (measured 0.5 s per GiB of 4 KiB page faults on the 2-core dev machine, 0.13-0.3 s with huge pages).
    Elsewhere, or if the advice is refused, it is plain memory. The tensor keeps the mapping alive.
    """
    if size < HUGE_PAGE_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(size, dtype=torch.uint8)
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # only advice: THP "never", or an old kernel
        mapping.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(mapping, dtype=torch.uint8)


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
    digest of each ``chunk_bytes`` piece (``chunks``, for a file larger than one piece), hashed on a
    second thread from the same buffer, so sealing a big file takes one hash's time, not two; a file that
    grows past ``chunk_bytes`` while being read raises IntegrityError.
    """
    fd = open_inside(root_fd, relative)
    digest = hashlib.sha256()
    head = bytearray()
    size = 0
    file_size = os.fstat(fd).st_size
    # only a file larger than one chunk has chunk digests (the whole-file digest covers a smaller one)
    pieces = ChunkDigests(chunk_bytes) if chunk_bytes is not None and file_size > chunk_bytes else None
    second_thread = ThreadPoolExecutor(max_workers=1) if pieces is not None else contextlib.nullcontext()
    data = private_bytes(file_size) if capture else None
    buffer = bytearray(0 if capture else CHUNK_BYTES)
    # ndarray.data: the same writable view; numpy types memoryview(ndarray) only for Python >= 3.12
    view = data.numpy().data if data is not None else memoryview(buffer)
    with io.FileIO(fd, "rb", closefd=True) as handle, second_thread as helper:
        keep_all = file_size <= KEEP_BYTES
        want_head = _head_wanted(relative, keep_all)
        while True:
            chunk, count = _read_chunk(handle, view, buffer, data is not None, size, file_size)
            if not count:
                break
            # the chunk digests on the helper thread while this one updates the whole-file digest (hashlib
            # releases the GIL); both are done before the buffer is read into again
            pending = helper.submit(pieces.update, chunk) if pieces is not None and helper is not None else None
            digest.update(chunk)
            if pending is not None:
                pending.result()
            want_head = _grow_head(head, chunk, want_head, keep_all)
            size += count
            if on_bytes is not None:
                on_bytes(count)
    if data is not None and size != file_size:
        data = data[:size]  # the file shrank while being read: the size check reports it
    if chunk_bytes is not None and pieces is None and size > chunk_bytes:
        raise IntegrityError(
            f"size changed while reading: {size} bytes, {file_size} when opened; re-run once nothing writes the file"
        )
    chunks = pieces.finish() if pieces is not None else ()
    return HashedFile(path=relative, size=size, sha256=digest.hexdigest(), head=bytes(head), data=data, chunks=chunks)


def _head_wanted(relative: str, keep_all: bool) -> int:
    """Leading bytes to keep: a small file's all, a safetensors header's most (``_grow_head`` trims), else none."""
    return KEEP_BYTES if keep_all else 8 + MAX_HEADER_BYTES if relative.endswith(".safetensors") else 0


def _read_chunk(
    handle: io.FileIO, view: memoryview, buffer: bytearray, capture: bool, size: int, file_size: int
) -> tuple[memoryview, int]:
    """(next piece, its byte count: 0 at the end), read into the private copy ``view`` (capture) or ``buffer``."""
    if capture:
        if size >= file_size:
            return view[:0], 0  # a file that grew since fstat reads as its fstat size; the size check catches it
        chunk = view[size : min(size + CHUNK_BYTES, file_size)]
        count = handle.readinto(chunk)
        return chunk[:count], count
    count = handle.readinto(buffer)
    return view[:count], count


def _grow_head(head: bytearray, chunk: memoryview, want_head: int, keep_all: bool) -> int:
    """Append to ``head`` what it still wants of ``chunk``; the bytes wanted now (a header's real length)."""
    if len(head) < want_head:
        head += chunk[: want_head - len(head)]
        if not keep_all and len(head) >= 8:
            want_head = min(want_head, 8 + int.from_bytes(head[:8], "little"))
            del head[want_head:]
    return want_head


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


def default_workers(n_tasks: int) -> int:
    """Threads for ``n_tasks`` files or chunks: two per core (one hashes while the other waits on the
    disk), at most 8 and at most one per task."""
    return max(1, min(n_tasks, 8, (os.cpu_count() or 2) * 2))


def _head_limit(relative: str, size: int) -> int:
    """How many leading bytes ``HashedFile.head`` may keep (trimmed to a safetensors header once known)."""
    if size <= KEEP_BYTES:
        return size
    return min(size, 8 + MAX_HEADER_BYTES) if relative.endswith(".safetensors") else 0


class _ChunkedFile:
    """One file being checked as chunk tasks on several threads: the shared fd (opened by the first task
    through ``open_inside``, closed by the last), the capture buffer, the head and the first failure."""

    def __init__(self, root_fd: int, relative: str, plan: ChunkPlan, capture: bool) -> None:
        self.root_fd, self.relative, self.plan, self.capture = root_fd, relative, plan, capture
        self.lock = threading.Lock()
        self.fd: int | None = None
        self.data: torch.Tensor | None = None
        self.view: memoryview | None = None
        self.pending = len(plan.chunks)
        self.failed = False
        self.error: BaseException | None = None
        self.error_index = len(plan.chunks)  # the lowest chunk that failed: its error is the one reported
        self.digests: list[str] = [""] * len(plan.chunks)
        self.head_limit = _head_limit(relative, plan.size)
        self.head_parts: dict[int, bytes] = {}  # offset -> bytes of [0, head_limit) as hashed (no capture)

    def open(self) -> int:
        with self.lock:
            if self.fd is None:
                fd = open_inside(self.root_fd, self.relative)
                try:
                    found = os.fstat(fd).st_size
                    if found != self.plan.size:
                        raise IntegrityError(
                            f"size changed while reading: {found} bytes, manifest says {self.plan.size}"
                        )
                    if self.capture:
                        self.data = private_bytes(self.plan.size)
                        self.view = self.data.numpy().data
                except BaseException:
                    os.close(fd)
                    raise
                self.fd = fd
            return self.fd

    def fail(self, index: int, exc: BaseException) -> None:
        with self.lock:
            self.failed = True
            if index < self.error_index:
                self.error, self.error_index = exc, index

    def done_one(self) -> None:
        with self.lock:
            self.pending -= 1
            if self.pending == 0 and self.fd is not None:
                os.close(self.fd)
                self.fd = None

    def describe(self, index: int) -> str:
        start, end = index * self.plan.chunk_bytes, min((index + 1) * self.plan.chunk_bytes, self.plan.size)
        return f"chunk {index} of {len(self.plan.chunks)} (bytes {start}-{end - 1})"

    def check_chunk(self, index: int, buffer: memoryview, on_bytes: Callable[[int], None] | None) -> None:
        """Read chunk ``index`` (into its slice of the capture buffer, else ``buffer`` piece by piece), hash
        it and compare; IntegrityError naming the chunk on a mismatch or a size change."""
        if self.failed:
            return  # an earlier failure of this file: its remaining chunks are skipped
        fd = self.open()
        plan = self.plan
        start, end = index * plan.chunk_bytes, min((index + 1) * plan.chunk_bytes, plan.size)
        digest = hashlib.sha256()
        position = start
        while position < end:
            if self.failed:
                return
            want = min(CHUNK_BYTES, end - position)
            target = self.view[position : position + want] if self.view is not None else buffer[:want]
            count = os.preadv(fd, [target], position)
            if not count:
                raise IntegrityError(
                    f"{self.describe(index)}: size changed while reading: the file ends at byte {position}, "
                    f"manifest says {plan.size} bytes"
                )
            piece = target[:count]
            digest.update(piece)
            if position < self.head_limit and self.view is None:
                with self.lock:
                    if position == 0 and self.plan.size > KEEP_BYTES and count >= 8:  # a safetensors header
                        self.head_limit = min(self.head_limit, 8 + int.from_bytes(piece[:8], "little"))
                    if position < self.head_limit:  # again: chunk 0 may have just lowered it
                        self.head_parts[position] = bytes(piece[: self.head_limit - position])
            position += count
            if on_bytes is not None:
                on_bytes(count)
        if end == plan.size and os.pread(fd, 1, end):
            raise IntegrityError(
                f"{self.describe(index)}: size changed while reading: the file is longer than the "
                f"{plan.size} bytes the manifest says"
            )
        found = digest.hexdigest()
        self.digests[index] = found
        if found != plan.chunks[index]:
            raise IntegrityError(
                f"{self.describe(index)}: SHA-256 mismatch: {found[:16]}..., manifest says {plan.chunks[index][:16]}..."
            )

    def result(self) -> HashedFile | BaseException:
        if self.error is not None:
            return self.error
        size, limit = self.plan.size, self.head_limit
        if self.view is not None:
            if size > KEEP_BYTES and limit >= 8:  # a safetensors file: keep just its header
                limit = min(limit, 8 + int.from_bytes(self.view[:8], "little"))
            prefix = bytes(self.view[:limit])
        else:  # pieces read before the header length was known may run past it
            prefix = b"".join(self.head_parts[offset] for offset in sorted(self.head_parts))[:limit]
        return HashedFile(
            path=self.relative,
            size=size,
            sha256=self.plan.sha256,
            head=prefix,
            data=self.data,
            chunks=tuple(self.digests),
        )


@dataclass(frozen=True)
class HashOptions:
    """How :func:`hash_files` hashes: ``workers`` threads (None: the default for the work), ``progress(done,
    total)`` over the bytes, ``capture(path)`` selects the files whose bytes are kept, ``chunk_bytes`` asks for
    chunk digests (sealing; see ``hash_file``), and a path in ``plans`` is checked chunk by chunk instead."""

    workers: int | None = None
    progress: ProgressFn | None = None
    capture: Callable[[str], bool] | None = None
    chunk_bytes: int | None = None
    plans: Mapping[str, ChunkPlan] | None = None


def hash_files(
    root_fd: int, paths: Iterable[str], total_bytes: int, how: HashOptions = HashOptions()
) -> dict[str, HashedFile | BaseException]:
    """Hash ``paths`` in parallel threads as ``how`` says; per path, the HashedFile or the exception that stopped
    it. A path in ``how.plans`` has its chunks spread over the same threads as the whole files: the first chunk
    that does not match its digest (or a size change) is the file's IntegrityError, naming the chunk; its
    remaining chunks are skipped."""
    workers, progress, capture, chunk_bytes = how.workers, how.progress, how.capture, how.chunk_bytes
    paths = list(paths)
    plans = how.plans or {}
    counter = ByteCounter(total_bytes, progress)
    # only passed when asked for: tests wrap hash_file with the plain signature
    options: dict[str, int] = {} if chunk_bytes is None else {"chunk_bytes": chunk_bytes}
    chunked = {
        path: _ChunkedFile(root_fd, path, plans[path], bool(capture and capture(path)))
        for path in paths
        if path in plans
    }
    buffers = threading.local()

    def whole(path: str) -> HashedFile | BaseException:
        try:
            return hash_file(root_fd, path, counter, capture=bool(capture and capture(path)), **options)
        except Exception as exc:  # noqa: BLE001 - reported against that file; the others still get checked
            return exc

    def chunk(state: _ChunkedFile, index: int) -> None:
        try:
            if getattr(buffers, "view", None) is None:
                buffers.view = memoryview(bytearray(CHUNK_BYTES))
            state.check_chunk(index, buffers.view, counter)
        except Exception as exc:  # noqa: BLE001 - reported against that file
            state.fail(index, exc)
        finally:
            state.done_one()

    # the big files' chunks first, each file's in order (sequential reads for the disk), then whole files
    by_size = sorted(chunked.values(), key=lambda state: -state.plan.size)
    tasks = [(state, index) for state in by_size for index in range(len(state.plan.chunks))]
    singles = [path for path in paths if path not in chunked]
    with ThreadPoolExecutor(max_workers=workers or default_workers(len(tasks) + len(singles))) as pool:
        for state, index in tasks:
            pool.submit(chunk, state, index)
        done = dict(zip(singles, pool.map(whole, singles), strict=True))
    done.update((path, state.result()) for path, state in chunked.items())
    return {path: done[path] for path in paths}
