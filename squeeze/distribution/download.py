"""The verified parallel downloader: every listed file into the staging directory, hashed as it streams.

Work is cut into pieces handed to a pool of threads (each with its own kept-alive connection):

* a file with chunk digests (manifest version 2, larger than ``chunk_bytes``): one piece per chunk, fetched
  with a Range request and written at its offset; the chunk's SHA-256 is checked as it arrives. When every
  chunk matched, the whole-file digest is implied (the manifest, root digest and signature cover the chunk
  digests), so the file is not read again.
* any other file: one piece, one stream, its whole-file SHA-256 computed as the bytes arrive.

Resume: a piece already on disk from an interrupted pull is re-hashed, never trusted: a chunk whose digest
matches is kept; a single-stream file continues after its on-disk prefix (hashed first), and if the
finished file does not match, it is downloaded once more from its start before the pull fails.
No piece reads more bytes than the manifest lists (HttpClient refuses a response announcing another size).
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass

from squeeze.distribution.http_client import HttpClient, NotFound, show_url
from squeeze.distribution.remote import Source
from squeeze.distribution.staging import Staging
from squeeze.errors import ConfigError, IntegrityError, SqueezeError, TransferError
from squeeze.format.hashing import ByteCounter
from squeeze.format.manifest import FileEntry, Manifest
from squeeze.format.paths import short_path

BUFFER_BYTES = 1 << 20
#: Read buffer size per worker; large enough that a syscall and a hash update each move a lot of bytes.
DEFAULT_RETRIES = 3


def default_workers(pieces: int) -> int:
    """Parallel streams: enough to fill a link whose single stream is latency-bound, few enough for 2 cores."""
    return max(1, min(pieces, 8))


@dataclass(frozen=True)
class Piece:
    """Bytes ``[start, end)`` of one file; ``digest`` their SHA-256 (a chunk), or None for a whole file."""

    entry: FileEntry
    start: int
    end: int
    digest: str | None
    #: A chunk that may already be on disk from an earlier pull (re-hashed before anything is fetched).
    on_disk: bool = False

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass
class Totals:
    """Bytes moved over the network and bytes kept from an earlier pull (re-hashed)."""

    downloaded: int = 0
    reused: int = 0


class _Cancelled(Exception):
    """Another piece failed: stop this one quietly."""


class Downloader:
    """Downloads the pieces of ``manifest`` from ``source`` into ``staging``; ``run`` raises the first failure."""

    def __init__(
        self,
        client: HttpClient,
        source: Source,
        manifest: Manifest,
        staging: Staging,
        *,
        retries: int = DEFAULT_RETRIES,
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        self.client = client
        self.source = source
        self.manifest = manifest
        self.staging = staging
        self.retries = retries
        self.counter = ByteCounter(manifest.total_size, progress)
        self.cancel = threading.Event()
        self.totals = Totals()
        self._lock = threading.Lock()
        self._local = threading.local()

    # ------------------------------------------------------------------------------------------------
    # Planning

    def plan(self) -> list[Piece]:
        """Create (or size) every partial file and cut the work into pieces, largest first."""
        chunk_bytes = self.manifest.chunk_bytes
        pieces: list[Piece] = []
        for entry in self.manifest.files:
            try:
                fd = self.staging.open_file(entry.path, create=True)
            except OSError as exc:
                raise ConfigError(
                    f"cannot create {entry.path} in {short_path(self.staging.path)}: {exc.strerror or exc}",
                    hint="delete that staging directory (left by an interrupted pull) and pull again",
                ) from None
            try:
                found = os.fstat(fd).st_size
                if not found and entry.size:
                    found = self._seed_from_hub_cache(entry, fd)
                if entry.chunks and chunk_bytes:
                    if found != entry.size:
                        os.ftruncate(fd, entry.size)  # sparse: each chunk lands at its offset
                    for index, digest in enumerate(entry.chunks):
                        start, end = entry.chunk_range(index, chunk_bytes)
                        pieces.append(Piece(entry, start, end, digest, on_disk=end <= found))
                else:
                    if found > entry.size:
                        os.ftruncate(fd, 0)  # longer than the file can be: not a prefix of it
                    pieces.append(Piece(entry, 0, entry.size, None))
            finally:
                os.close(fd)
        pieces.sort(key=lambda piece: (-piece.length, piece.entry.path, piece.start))
        return pieces

    def _seed_from_hub_cache(self, entry: FileEntry, fd: int) -> int:
        """Copy the Hub cache's copy of ``entry`` (left by huggingface_hub's own downloads of this commit) into
        the empty partial file; it is then re-hashed like any partial file, never trusted. Returns its size
        (0 when there is none of the listed size)."""
        cached = self.source.cached_file(entry.path)
        if cached is None:
            return 0
        try:
            with open(cached, "rb") as handle:
                if os.fstat(handle.fileno()).st_size != entry.size:
                    return 0
                copied = 0
                while copied < entry.size:
                    count = os.copy_file_range(handle.fileno(), fd, entry.size - copied, copied, copied)
                    if not count:
                        break
                    copied += count
        except OSError:
            os.ftruncate(fd, 0)
            return 0
        return copied

    # ------------------------------------------------------------------------------------------------
    # Running

    def run(self, pieces: list[Piece], workers: int) -> Totals:
        """Fetch every piece with ``workers`` threads. Raises the first IntegrityError / TransferError."""
        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="squeeze-pull")
        try:
            futures = [pool.submit(self._run_piece, piece) for piece in pieces]
            wait(futures, return_when=FIRST_EXCEPTION)
            if any(f.done() and f.exception() is not None for f in futures):
                self.cancel.set()  # the others stop at their next buffer
                wait(futures)
        except BaseException:  # Ctrl-C: stop the workers too (their partial files stay for a resume)
            self.cancel.set()
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        real = [e for f in futures if (e := f.exception()) is not None and not isinstance(e, _Cancelled)]
        if real:
            # an integrity failure says more than the network errors it may have caused elsewhere
            real.sort(key=lambda e: not isinstance(e, IntegrityError))
            raise real[0]
        return self.totals

    def _run_piece(self, piece: Piece) -> None:
        if self.cancel.is_set():
            raise _Cancelled
        try:
            if piece.digest is None:
                self._whole_file(piece)
            else:
                self._chunk(piece)
        except OSError as exc:  # the staging directory itself (disk full, a path clash with an older pull)
            raise ConfigError(
                f"cannot write {piece.entry.path} in {short_path(self.staging.path)}: {exc.strerror or exc}",
                hint="free disk space, or delete that staging directory and pull again",
            ) from None

    def _add(self, downloaded: int = 0, reused: int = 0) -> None:
        with self._lock:
            self.totals.downloaded += downloaded
            self.totals.reused += reused

    def _rehashed(self, count: int) -> None:
        """Kept bytes re-hashed: progress for the transfer watch too (a long re-hash is not a slow server)."""
        if self.client.watch is not None and count:
            self.client.watch.add(count)

    def _buffer(self) -> memoryview:
        view: memoryview | None = getattr(self._local, "buffer", None)
        if view is None:
            view = self._local.buffer = memoryview(bytearray(BUFFER_BYTES))
        return view

    def _chunk(self, piece: Piece) -> None:
        entry = piece.entry
        fd = self.staging.open_file(entry.path)
        try:
            if piece.on_disk and _hash_range(fd, piece.start, piece.end, self._buffer()) == piece.digest:
                self._add(reused=piece.length)
                self.counter(piece.length)
                self._rehashed(piece.length)
                return
            digest = hashlib.sha256()
            self._stream(entry, fd, piece.start, piece.end, digest.update)
            if digest.hexdigest() != piece.digest:
                self.staging.remove(entry.path)
                what = f"bytes {piece.start}-{piece.end - 1}"
                raise self._mismatch(entry, what, digest.hexdigest(), piece.digest or "")
            os.fdatasync(fd)  # written back while other pieces download, not all at the end
        finally:
            os.close(fd)

    def _whole_file(self, piece: Piece) -> None:
        entry = piece.entry
        fd = self.staging.open_file(entry.path)
        try:
            kept = os.fstat(fd).st_size
            digest = hashlib.sha256()
            if kept:
                _hash_prefix(fd, kept, self._buffer(), digest.update)
                self.counter(kept)
                self._rehashed(kept)
            self._stream(entry, fd, kept, entry.size, digest.update)
            if digest.hexdigest() != entry.sha256 and kept:
                # the kept prefix was not this file's (another version, a torn write): once more, from byte 0
                os.ftruncate(fd, 0)
                kept = 0
                digest = hashlib.sha256()
                self._stream(entry, fd, 0, entry.size, digest.update)
            if digest.hexdigest() != entry.sha256:
                self.staging.remove(entry.path)
                raise self._mismatch(entry, "the file", digest.hexdigest(), entry.sha256)
            self._add(reused=kept)
            os.fdatasync(fd)
        finally:
            os.close(fd)

    def _mismatch(self, entry: FileEntry, what: str, found: str, expected: str) -> IntegrityError:
        return IntegrityError(
            f"{entry.path} from {show_url(self.source.url_for(entry.path))}: SHA-256 of {what} is {found[:16]}..., "
            f"the manifest says {expected[:16]}...",
            hint="the server holds other bytes than its manifest lists (corrupted or substituted); "
            "nothing was kept under the output name",
        )

    def _stream(self, entry: FileEntry, fd: int, start: int, end: int, on_data: Callable[[memoryview], object]) -> None:
        """Download bytes [start, end) of ``entry`` into ``fd`` at their offsets, passing each buffer to
        ``on_data`` (a hash) in order. A dropped connection is retried from where it stopped, up to
        ``retries`` times in a row without progress."""
        url = self.source.url_for(entry.path)
        view = self._buffer()
        position = start
        failures = 0
        while position < end:
            if self.cancel.is_set():
                raise _Cancelled
            body = None
            try:
                try:
                    body = self.client.get(url, start=position, length=end - position, total=entry.size)
                except NotFound:
                    raise IntegrityError(
                        f"{entry.path} is listed in the manifest but missing on the server "
                        f"({show_url(url)}: not found)",
                        hint="the artifact on the server is incomplete; nothing was kept under the output name",
                    ) from None
                while position < end:
                    if self.cancel.is_set():
                        body.close(reuse=False)
                        raise _Cancelled
                    count = body.readinto(view)
                    data = view[:count]
                    on_data(data)
                    _pwrite_all(fd, data, position)
                    position += count
                    failures = 0
                    self._add(downloaded=count)
                    self.counter(count)
                body.close()
            except TransferError as exc:
                if body is not None:
                    body.close(reuse=False)
                failures += 1
                if not exc.retryable or failures > self.retries:
                    raise TransferError(
                        f"{exc.message} (downloading {entry.path}, {failures} attempt(s))",
                        hint=exc.hint or "rerun the same squeeze pull: it resumes from the verified partial files",
                        retryable=exc.retryable,
                    ) from None
                time.sleep(min(2.0, 0.1 * 2**failures))


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written


def _hash_range(fd: int, start: int, end: int, view: memoryview) -> str:
    digest = hashlib.sha256()
    position = start
    while position < end:
        count = os.preadv(fd, [view[: min(len(view), end - position)]], position)
        if not count:
            break  # shorter than expected: the digest will not match
        digest.update(view[:count])
        position += count
    return digest.hexdigest()


def _hash_prefix(fd: int, length: int, view: memoryview, update: Callable[[memoryview], object]) -> None:
    position = 0
    while position < length:
        count = os.preadv(fd, [view[: min(len(view), length - position)]], position)
        if not count:
            raise SqueezeError(f"a partial file shrank while being re-hashed ({position} of {length} bytes)")
        update(view[:count])
        position += count
