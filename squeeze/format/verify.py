"""Integrity verification of an artifact against its manifest, and sealing a new artifact with one.

``verify_artifact`` checks, without ever opening a path outside the artifact directory:
the manifest parses and is self-consistent (root digest: in version 2 over the whole manifest, provenance
included); every listed file exists, is a regular file (no symlinks), has the listed size and SHA-256 or,
when the manifest lists its chunk digests, the listed digest for every chunk (the chunks are hashed in
parallel; the whole-file SHA-256 is then not recomputed: the root digest binds the chunk digests to it);
no file is present that the manifest does not list;
safetensors headers fit their files; the shard index names only listed shards and exactly the tensors
those shards hold. A malformed manifest raises FormatError; everything else lands in the report.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from squeeze.errors import FormatError, SqueezeError
from squeeze.format.hashing import ChunkPlan, HashedFile, HashOptions, ProgressFn, hash_files
from squeeze.format.manifest import (
    DEFAULT_CHUNK_BYTES,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    SIGNATURE_NAME,
    FileEntry,
    Manifest,
    Provenance,
    build_manifest,
    check_chunk_bytes,
    parse_manifest,
    write_manifest,
)
from squeeze.format.paths import (
    MAX_DEPTH,
    describe_os_error,
    open_root,
    path_error,
    read_inside,
    resolve_root,
    short_path,
    walk_artifact,
)
from squeeze.format.safetensors_header import SafetensorsHeader, parse_safetensors_header
from squeeze.format.shards import INDEX_NAME
from squeeze.format.strict_json import strict_json_loads
from squeeze.format.swap import missing_artifact_error


@dataclass
class FileResult:
    """The verdict on one file (listed, or found on disk without being listed)."""

    path: str
    ok: bool
    error: str | None = None
    size: int | None = None
    sha256: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "ok": self.ok, "error": self.error, "size": self.size, "sha256": self.sha256}


@dataclass
class VerifyReport:
    """Everything ``verify_model_integrity`` found. ``ok`` is True only if every check passed."""

    artifact_dir: str
    manifest_path: str
    root_digest: str
    files: list[FileResult] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # artifact-level problems (root digest, index)
    bytes_hashed: int = 0
    seconds: float = 0.0
    #: The manifest as parsed, and the SHA-256 of the exact bytes it was parsed from (a signature over the
    #: artifact names this digest: checking it needs no second read). None / "" until read.
    manifest: Manifest | None = field(default=None, repr=False)
    manifest_sha256: str = ""
    #: Files read with ``capture``: their bytes as hashed, and parsed safetensors headers (not serialised).
    captured: dict[str, HashedFile] = field(default_factory=dict, repr=False)
    headers: dict[str, SafetensorsHeader] = field(default_factory=dict, repr=False)

    @property
    def ok(self) -> bool:
        return not self.problems and all(result.ok for result in self.files)

    @property
    def failures(self) -> list[FileResult]:
        return [result for result in self.files if not result.ok]

    def first_error(self) -> str | None:
        """One line describing the first problem found, for error messages."""
        if self.problems:
            return self.problems[0]
        bad = self.failures
        return f"{short_path(bad[0].path)}: {bad[0].error}" if bad else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "artifact_dir": self.artifact_dir,
            "manifest": self.manifest_path,
            "root_digest": self.root_digest,
            "files": [result.to_dict() for result in self.files],
            "problems": list(self.problems),
            "bytes_hashed": self.bytes_hashed,
            "seconds": round(self.seconds, 4),
        }


def resolve_manifest_path(path: str | os.PathLike[str]) -> tuple[Path, Path]:
    """(artifact directory, manifest path) from either of them; FormatError when there is no manifest.

    The artifact's own path may be a symlink (``current -> v3``): the directory returned is the real
    root (``resolve_root``). The manifest itself, like everything inside the artifact, must not be a link.
    """
    given = Path(path)
    try:
        is_directory = given.is_dir()  # follows a link to the root: `current -> v3` names v3
    except OSError as exc:  # e.g. a path longer than the OS allows
        raise path_error("cannot read", given, exc) from None
    if is_directory:
        directory = resolve_root(given)
        manifest = directory / MANIFEST_NAME
    else:
        directory = resolve_root(given.parent)
        manifest = directory / given.name
    try:
        info = os.lstat(manifest)
    except FileNotFoundError:
        interrupted = missing_artifact_error(Path(os.path.abspath(given)))
        if interrupted is not None:
            raise interrupted from None
        raise FormatError(
            f"no manifest at {short_path(given)}", hint="pass the artifact directory or its squeeze.manifest.json"
        ) from None
    except OSError as exc:
        raise path_error("cannot read", given, exc) from None
    if manifest.name != MANIFEST_NAME:
        raise FormatError(
            f"{short_path(given)} is not a squeeze manifest (expected a file named {MANIFEST_NAME})",
            hint="pass the artifact directory or its squeeze.manifest.json",
        )
    if stat.S_ISLNK(info.st_mode):
        raise FormatError(f"{short_path(manifest)} is a symbolic link; the manifest must be a regular file")
    if not stat.S_ISREG(info.st_mode):
        raise FormatError(f"{short_path(manifest)} is not a regular file")
    return directory, manifest


def read_manifest(directory: str | os.PathLike[str]) -> Manifest:
    """Read and parse ``directory/squeeze.manifest.json`` without following symlinks inside the artifact.

    At most MAX_MANIFEST_BYTES are read (the size is checked before reading); a FIFO or device in its
    place is refused without blocking.
    """
    return read_manifest_bytes(directory)[0]


def read_manifest_bytes(directory: str | os.PathLike[str]) -> tuple[Manifest, bytes]:
    """``read_manifest`` and the exact bytes it parsed (hardened read, size capped before reading)."""
    root = resolve_root(directory)
    shown = short_path(root / MANIFEST_NAME)
    data = read_inside(root, MANIFEST_NAME, MAX_MANIFEST_BYTES, name=shown)
    return parse_manifest(data, shown), data


def verify_artifact(
    path: str | os.PathLike[str],
    *,
    workers: int | None = None,
    progress: ProgressFn | None = None,
    capture: Callable[[str], bool] | None = None,
) -> VerifyReport:
    """Verify the artifact at ``path`` (its directory or manifest). Raises FormatError if unreadable.

    ``capture(path)`` keeps the bytes of selected files in ``report.captured`` (hash while reading: the
    loader builds tensors from exactly these bytes).
    """
    started = time.perf_counter()
    directory, manifest_path = resolve_manifest_path(path)
    manifest, manifest_bytes = read_manifest_bytes(directory)
    report = VerifyReport(str(directory), str(manifest_path), manifest.root_digest)
    report.manifest, report.manifest_sha256 = manifest, hashlib.sha256(manifest_bytes).hexdigest()
    if manifest.computed_root_digest() != manifest.root_digest:
        covered = "the listed entries" if manifest.format_version == 1 else "its entries, provenance and tool"
        report.problems.append(f"{MANIFEST_NAME}: root digest does not match {covered} (manifest edited after sealing)")
    expected = manifest.entry_map()
    on_disk = _scan(directory, report)
    for path_on_disk in sorted(set(on_disk) - set(expected)):
        report.files.append(FileResult(path_on_disk, False, "extra file not listed in the manifest"))
    to_hash = _listed_at_size(manifest, on_disk, report)
    plans = {
        relative: ChunkPlan(entry.size, entry.sha256, manifest.chunk_bytes, entry.chunks)
        for relative in to_hash
        if (entry := expected[relative]).chunks and manifest.chunk_bytes is not None
    }
    total = sum(expected[p].size for p in to_hash)
    how = HashOptions(workers=workers, progress=progress, capture=capture, plans=plans)
    hashed = _hash_listed(directory, to_hash, total, how)
    headers = report.headers
    for relative in to_hash:
        outcome = hashed[relative]
        report.files.append(_judge(expected[relative], outcome, headers))
        if isinstance(outcome, HashedFile):
            report.bytes_hashed += outcome.size
            if outcome.data is not None:
                report.captured[relative] = outcome
    index = hashed.get(INDEX_NAME)
    if isinstance(index, HashedFile):
        _check_index(index, expected, headers, report)
    report.files.sort(key=lambda r: r.path)
    report.seconds = time.perf_counter() - started
    return report


def _listed_at_size(manifest: Manifest, on_disk: dict[str, os.stat_result], report: VerifyReport) -> list[str]:
    """The listed files on disk at their listed size, to hash, in manifest order; a missing, truncated or grown
    one is reported (one already reported by the scan, a symlink or special file, is passed over)."""
    to_hash: list[str] = []
    already_failed = {result.path for result in report.files}  # symlinks and special files
    for entry in manifest.files:
        info = on_disk.get(entry.path)
        if info is None and entry.path in already_failed:
            continue
        if info is None:
            report.files.append(FileResult(entry.path, False, "missing"))
        elif info.st_size != entry.size:
            word = "truncated" if info.st_size < entry.size else "grown"
            report.files.append(
                FileResult(entry.path, False, f"{word}: {info.st_size} bytes, manifest says {entry.size}", info.st_size)
            )
        else:
            to_hash.append(entry.path)
    return to_hash


def _scan(directory: Path, report: VerifyReport) -> dict[str, os.stat_result]:
    """Regular files under ``directory`` (lstat); symlinks and special files are reported as failures."""
    found: dict[str, os.stat_result] = {}
    for relative, info in walk_artifact(directory):
        if relative == MANIFEST_NAME or (relative == SIGNATURE_NAME and stat.S_ISREG(info.st_mode)):
            continue  # the signature is checked on request (--public-key), never listed
        if stat.S_ISLNK(info.st_mode):
            report.files.append(
                FileResult(relative, False, f"{_link_target(directory, relative)}; artifacts may not contain links")
            )
        elif stat.S_ISDIR(info.st_mode):
            report.files.append(
                FileResult(relative, False, f"directory nested more than {MAX_DEPTH} levels deep; not scanned")
            )
        elif not stat.S_ISREG(info.st_mode):
            report.files.append(FileResult(relative, False, "not a regular file"))
        else:
            found[relative] = info
    return found


def _link_target(directory: Path, relative: str) -> str:
    """The text "symbolic link to '<target>'" for a message (the target shortened; never followed)."""
    try:
        return f"symbolic link to {short_path(os.readlink(directory / relative))!r}"
    except OSError:  # gone meanwhile, or a path longer than the OS allows: it was a link when listed
        return "symbolic link"


def _hash_listed(
    directory: Path, paths: list[str], total: int, how: HashOptions
) -> dict[str, HashedFile | BaseException]:
    root_fd = open_root(directory)
    try:
        return hash_files(root_fd, paths, total, how)
    finally:
        os.close(root_fd)


def _judge(entry: FileEntry, outcome: HashedFile | BaseException, headers: dict[str, SafetensorsHeader]) -> FileResult:
    if isinstance(outcome, BaseException):
        return FileResult(entry.path, False, _describe_error(outcome))
    if outcome.size != entry.size:
        return FileResult(
            entry.path,
            False,
            f"size changed while reading: {outcome.size} bytes, manifest says {entry.size}",
            outcome.size,
            outcome.sha256,
        )
    if outcome.sha256 != entry.sha256:
        return FileResult(
            entry.path,
            False,
            f"SHA-256 mismatch: {outcome.sha256[:16]}..., manifest says {entry.sha256[:16]}...",
            outcome.size,
            outcome.sha256,
        )
    if entry.path.endswith(".safetensors"):
        try:
            headers[entry.path] = parse_safetensors_header(outcome.head, outcome.size, entry.path)
        except FormatError as exc:
            return FileResult(
                entry.path, False, exc.message.removeprefix(f"{entry.path}: "), outcome.size, outcome.sha256
            )
    return FileResult(entry.path, True, None, outcome.size, outcome.sha256)


def _describe_error(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.errno == errno.ELOOP:
        return describe_os_error(exc)
    if isinstance(exc, OSError):
        return f"cannot read: {describe_os_error(exc)}"
    if isinstance(exc, SqueezeError):
        return exc.message
    return f"cannot read: {exc}"


def _check_index(
    index: HashedFile, expected: dict[str, FileEntry], headers: dict[str, SafetensorsHeader], report: VerifyReport
) -> None:
    """The shard index must name listed shards and exactly the tensors each shard holds."""
    try:
        body = strict_json_loads(index.head, INDEX_NAME)
        weight_map = body["weight_map"] if isinstance(body, dict) else None
        if not isinstance(weight_map, dict):
            raise FormatError(f"{INDEX_NAME} lacks a 'weight_map' object")
    except (FormatError, KeyError) as exc:
        report.problems.append(exc.message if isinstance(exc, FormatError) else f"{INDEX_NAME} lacks 'weight_map'")
        return
    by_shard: dict[str, set[str]] = {}
    for tensor, shard in weight_map.items():
        if not isinstance(shard, str) or shard not in expected:
            report.problems.append(f"{INDEX_NAME}: tensor {tensor!r} points to {shard!r}, not a file of the manifest")
            return
        by_shard.setdefault(shard, set()).add(tensor)
    for shard, names in sorted(by_shard.items()):
        header = headers.get(shard)
        if header is not None and set(header.tensors) != names:
            missing = sorted(names - set(header.tensors))[:3]
            extra = sorted(set(header.tensors) - names)[:3]
            report.problems.append(
                f"{INDEX_NAME}: shard {shard} does not hold what the index says (missing {missing}, unlisted {extra})"
            )


# ----------------------------------------------------------------------------------------------------------
# Sealing


def seal_artifact(
    directory: str | os.PathLike[str],
    provenance: Provenance | None = None,
    *,
    workers: int | None = None,
    progress: ProgressFn | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Manifest:
    """Hash every file under ``directory`` and write its version-2 manifest atomically (the artifact's
    commit point). Each file is read once for its whole-file SHA-256 and, when larger than ``chunk_bytes``
    (a multiple of 4096 in [4096, 2**30]; FormatError otherwise), the digests of its chunks.

    Refuses symlinks, special files and leftover temp files, so a sealed artifact always verifies.
    """
    check_chunk_bytes(chunk_bytes)
    directory = resolve_root(directory)
    shown = short_path(directory)
    report = VerifyReport(str(directory), "", "")
    files = _scan(directory, report)
    if report.files:
        bad = report.files[0]
        raise FormatError(f"cannot seal {shown}: {short_path(bad.path)}: {bad.error}")
    partial = [p for p in files if p.rsplit("/", 1)[-1].startswith(".") and p.endswith(".partial")]
    if partial:
        raise FormatError(f"cannot seal {shown}: unfinished temp file {short_path(partial[0])}")
    total = sum(i.st_size for i in files.values())
    how = HashOptions(workers=workers, progress=progress, chunk_bytes=chunk_bytes)
    hashed = _hash_listed(directory, sorted(files), total, how)
    entries = []
    for relative, outcome in sorted(hashed.items()):
        if isinstance(outcome, BaseException):
            raise FormatError(f"cannot seal {shown}: {short_path(relative)}: {_describe_error(outcome)}")
        entries.append(FileEntry(relative, outcome.size, outcome.sha256, outcome.chunks))
    manifest = build_manifest(entries, provenance, chunk_bytes=chunk_bytes)
    write_manifest(directory, manifest)
    return manifest
