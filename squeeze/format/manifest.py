"""``squeeze.manifest.json``: what an artifact holds, byte for byte (specified in docs/format.md).

The manifest lists every file of the artifact (relative POSIX path, size, whole-file SHA-256 and, in
version 2, the SHA-256 of each ``chunk_bytes`` piece of a file larger than ``chunk_bytes``), the tool that
wrote it, the provenance of the artifact, and a root digest: in version 2 over the whole manifest object
(but the root digest itself), in version 1 over the file entries only. Parsing is strict: duplicate JSON
keys, unknown versions, missing or mistyped fields, chunk lists that do not fit their file, and unsafe
paths all raise FormatError.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from squeeze.errors import ConfigError, FormatError
from squeeze.format.atomic import atomic_write_text
from squeeze.format.paths import check_relative_path, short_number, short_repr
from squeeze.format.strict_json import strict_json_loads
from squeeze.version import __version__

MANIFEST_NAME = "squeeze.manifest.json"
#: The artifact's detached signature (OpenSSF model signing bundle): the one file allowed beside the manifest's
#: list, never listed in it (it signs the manifest, so it cannot be covered by it).
SIGNATURE_NAME = "model.sig"
MANIFEST_FORMAT = "squeeze.manifest"
#: The version squeeze writes; parse_manifest reads READ_VERSIONS.
MANIFEST_VERSION = 2
READ_VERSIONS = (1, 2)
#: Version 2's default chunk size (64 MiB): a file larger than this gets per-chunk digests, so verification
#: can hash one big shard on every core. Allowed: a multiple of CHUNK_ALIGN in [MIN_CHUNK_BYTES, MAX_CHUNK_BYTES].
DEFAULT_CHUNK_BYTES = 2**26
CHUNK_ALIGN = 4096
MIN_CHUNK_BYTES = 4096
MAX_CHUNK_BYTES = 2**30
#: A manifest larger than this is refused unread (a real one is a few KB per thousand files).
MAX_MANIFEST_BYTES = 64 * 2**20
#: Largest file a manifest may list (1 PiB): beyond any model, and it keeps every size a message echoes short.
MAX_FILE_BYTES = 2**50

_SHA256_RE = re.compile(r"[0-9a-f]{64}")  # used with fullmatch: "$" would also accept a trailing newline
_TOP_KEYS = {"format", "format_version", "tool", "created", "files", "root_digest", "provenance"}
_TOP_KEYS_V2 = _TOP_KEYS | {"chunk_bytes"}
_FILE_KEYS = {"path", "size", "sha256"}
_FILE_KEYS_V2 = _FILE_KEYS | {"chunks"}
_TOOL_KEYS = {"name", "version"}
_PROVENANCE_KEYS = {"source_model", "source_digest", "recipe_hash", "calibration_hash", "extra"}


def chunk_count(size: int, chunk_bytes: int) -> int:
    """How many ``chunk_bytes`` pieces a file of ``size`` bytes has digests for: 0 when it fits in one
    chunk (a file of at most ``chunk_bytes`` has none), else ceil(size / chunk_bytes)."""
    return 0 if size <= chunk_bytes else -(-size // chunk_bytes)


def check_chunk_bytes(value: int, where: str = "chunk_bytes") -> int:
    """``value`` if it is a valid chunk size (a multiple of 4096 in [4096, 2**30]); else FormatError."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise FormatError(f"{where} must be an integer, found {type(value).__name__}")
    if not MIN_CHUNK_BYTES <= value <= MAX_CHUNK_BYTES or value % CHUNK_ALIGN:
        raise FormatError(
            f"{where} must be a multiple of {CHUNK_ALIGN} between {MIN_CHUNK_BYTES} and {MAX_CHUNK_BYTES}, "
            f"found {value}",
            hint=f"the default is {DEFAULT_CHUNK_BYTES} (64 MiB)",
        )
    return value


@dataclass(frozen=True)
class FileEntry:
    """One file of the artifact as signed off.

    ``sha256`` is the SHA-256 of the whole file (what ``sha256sum`` prints) in every version; ``chunks``
    (version 2, files larger than the manifest's ``chunk_bytes`` only) the SHA-256 of each consecutive
    ``chunk_bytes`` piece, the last one shorter.
    """

    path: str
    size: int
    sha256: str
    chunks: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"path": self.path, "size": self.size, "sha256": self.sha256}
        if self.chunks:
            entry["chunks"] = list(self.chunks)
        return entry

    def chunk_range(self, index: int, chunk_bytes: int) -> tuple[int, int]:
        """(first byte, one past the last byte) of chunk ``index`` (0-based)."""
        start = index * chunk_bytes
        return start, min(start + chunk_bytes, self.size)


@dataclass(frozen=True)
class Provenance:
    """Where an artifact came from. Fields are None when not applicable (e.g. an example artifact)."""

    source_model: str | None = None
    source_digest: str | None = None
    recipe_hash: str | None = None
    calibration_hash: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "source_model": self.source_model,
            "source_digest": self.source_digest,
            "recipe_hash": self.recipe_hash,
            "calibration_hash": self.calibration_hash,
            **({"extra": self.extra} if self.extra else {}),
        }


@dataclass(frozen=True)
class Manifest:
    """A parsed, validated manifest."""

    files: tuple[FileEntry, ...]
    root_digest: str
    tool_version: str
    created: str
    provenance: Provenance = field(default_factory=Provenance)
    format_version: int = MANIFEST_VERSION
    #: Version 2: the chunk size of the entries' ``chunks``; None in version 1.
    chunk_bytes: int | None = DEFAULT_CHUNK_BYTES

    def entry_map(self) -> dict[str, FileEntry]:
        return {entry.path: entry for entry in self.files}

    @property
    def total_size(self) -> int:
        return sum(entry.size for entry in self.files)

    def to_dict(self) -> dict[str, Any]:
        obj: dict[str, Any] = {
            "format": MANIFEST_FORMAT,
            "format_version": self.format_version,
            "tool": {"name": "squeeze", "version": self.tool_version},
            "created": self.created,
        }
        if self.chunk_bytes is not None:
            obj["chunk_bytes"] = self.chunk_bytes
        obj["files"] = [entry.to_dict() for entry in self.files]
        obj["root_digest"] = self.root_digest
        obj["provenance"] = self.provenance.to_dict()
        return obj

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, ensure_ascii=True) + "\n"

    def computed_root_digest(self) -> str:
        """The root digest this manifest's content calls for (compare with ``root_digest``): version 2 over
        everything but the root digest (``root_digest_v2``), version 1 over the entries (``root_digest``)."""
        if self.format_version == 1:
            return root_digest(self.files)
        return root_digest_v2(self.to_dict())


def root_digest(entries: list[FileEntry] | tuple[FileEntry, ...]) -> str:
    """SHA-256 over the entries sorted by path: ``path NUL size NUL sha256 LF`` each (UTF-8).

    NUL cannot occur in a valid path, so the encoding is unambiguous.
    """
    digest = hashlib.sha256()
    for entry in sorted(entries, key=lambda e: e.path.encode("utf-8")):
        digest.update(f"{entry.path}\x00{entry.size}\x00{entry.sha256}\n".encode())
    return digest.hexdigest()


def root_digest_v2(obj: dict[str, Any]) -> str:
    """Version 2's root digest: SHA-256 of the canonical JSON of the manifest object ``obj`` without its
    "root_digest" key (keys sorted, no whitespace, ASCII only), so it covers the tool, the creation time,
    the provenance, the chunk size and every entry with its chunk digests."""
    body = {key: value for key, value in obj.items() if key != "root_digest"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode("ascii")).hexdigest()


def build_manifest(
    entries: list[FileEntry],
    provenance: Provenance | None = None,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    created: str | None = None,
) -> Manifest:
    """A new version-2 manifest over ``entries`` (sorted by path), stamped with this tool's version and
    ``created`` (default: now, or SOURCE_DATE_EPOCH when set; UTC, ISO 8601 with a Z). Each entry larger
    than ``chunk_bytes`` must carry its ceil(size / chunk_bytes) chunk digests, the others none. Raises
    FormatError (ConfigError for a malformed SOURCE_DATE_EPOCH)."""
    check_chunk_bytes(chunk_bytes)
    ordered = tuple(sorted(entries, key=lambda e: e.path.encode("utf-8")))
    seen: set[str] = set()
    for entry in ordered:
        check_relative_path(entry.path, "manifest entry")
        if entry.path in seen:
            raise FormatError(f"manifest entry {entry.path!r} listed twice")
        seen.add(entry.path)
        _check_chunks(entry, chunk_bytes, f"manifest entry {entry.path!r}")
    if created is None:
        created = _creation_time()
    unsigned = Manifest(
        files=ordered,
        root_digest="",
        tool_version=__version__,
        created=created,
        provenance=provenance or Provenance(),
        format_version=MANIFEST_VERSION,
        chunk_bytes=chunk_bytes,
    )
    return replace(unsigned, root_digest=unsigned.computed_root_digest())


def _creation_time() -> str:
    """Now, UTC, ISO 8601 with a Z; or the time SOURCE_DATE_EPOCH names (seconds since 1970, the
    reproducible-builds convention), so two runs over the same inputs can seal the same root digest."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH", "").strip()
    if epoch:
        if not epoch.isdigit():
            raise ConfigError(
                f"SOURCE_DATE_EPOCH must be a whole number of seconds since 1970, found {short_repr(epoch)}",
                hint="unset it, or set it to e.g. $(git log -1 --format=%ct)",
            )
        moment = _dt.datetime.fromtimestamp(int(epoch), _dt.timezone.utc)
    else:
        moment = _dt.datetime.now(_dt.timezone.utc)
    return moment.replace(microsecond=0).isoformat().replace("+00:00", "Z")


def _check_chunks(entry: FileEntry, chunk_bytes: int, where: str) -> None:
    """``entry.chunks`` must be ceil(size / chunk_bytes) lowercase hex SHA-256 digests for a file larger
    than ``chunk_bytes``, and absent for any other file; FormatError otherwise."""
    want = chunk_count(entry.size, chunk_bytes)
    if not want and entry.chunks:
        raise FormatError(
            f"{where}: a file of {entry.size} bytes fits in one chunk of {chunk_bytes} bytes and must not list "
            f"chunks, found {len(entry.chunks)}"
        )
    if len(entry.chunks) != want:
        raise FormatError(
            f"{where}: {entry.size} bytes in chunks of {chunk_bytes} need {want} chunk digests, "
            f"found {len(entry.chunks)}"
        )
    for index, digest in enumerate(entry.chunks):
        if not isinstance(digest, str) or not _SHA256_RE.fullmatch(digest):
            raise FormatError(f"{where}: chunks[{index}] must be 64 lowercase hex digits, found {short_repr(digest)}")


def write_manifest(directory: str | Path, manifest: Manifest) -> Path:
    """Write ``manifest`` atomically as ``directory/squeeze.manifest.json``; returns its path."""
    path = Path(directory) / MANIFEST_NAME
    atomic_write_text(path, manifest.to_json())
    return path


# ----------------------------------------------------------------------------------------------------------
# Strict parsing


def _field(obj: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in obj:
        raise FormatError(f"{where} lacks the field {key!r}")
    value = obj[key]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        expected = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise FormatError(f"{where}: field {key!r} must be {expected}, found {type(value).__name__}")
    return value


def parse_manifest(data: bytes | str, name: str = MANIFEST_NAME) -> Manifest:
    """Parse and validate manifest bytes (version 1 or 2); raises FormatError naming the problem.

    Parsing does not check the root digest (``Manifest.computed_root_digest``: verification reports a
    mismatch against the files). A version-2 manifest must parse back to exactly the object it holds
    (no unknown keys anywhere), so its root digest covers every byte of meaning in the file.
    """
    if len(data) > MAX_MANIFEST_BYTES:
        raise FormatError(f"{name} is {len(data)} bytes, larger than the {MAX_MANIFEST_BYTES} byte limit")
    obj = strict_json_loads(data, name)
    if not isinstance(obj, dict):
        raise FormatError(f"{name} must hold a JSON object, found {type(obj).__name__}")
    if obj.get("format") != MANIFEST_FORMAT:
        raise FormatError(f"{name}: field 'format' must be {MANIFEST_FORMAT!r}, found {obj.get('format')!r}")
    version = _field(obj, "format_version", int, name)
    if version not in READ_VERSIONS:
        raise FormatError(
            f"{name}: unknown format_version {version} (this squeeze reads versions "
            f"{', '.join(map(str, READ_VERSIONS))})",
            hint="upgrade squeeze to read newer artifacts",
        )
    v2 = version >= 2
    unknown = sorted(set(obj) - (_TOP_KEYS_V2 if v2 else _TOP_KEYS))
    if unknown:
        raise FormatError(f"{name}: unknown field(s) {', '.join(map(repr, unknown))}")
    tool = _field(obj, "tool", dict, name)
    tool_version = _field(tool, "version", str, f"{name} tool")
    created = _field(obj, "created", str, name)
    chunk_bytes = check_chunk_bytes(_field(obj, "chunk_bytes", int, name), f"{name}: chunk_bytes") if v2 else None
    raw_files = _field(obj, "files", list, name)
    digest = _field(obj, "root_digest", str, name)
    if not _SHA256_RE.fullmatch(digest):
        raise FormatError(f"{name}: root_digest must be 64 lowercase hex digits, found {digest[:80]!r}")
    seen: set[str] = set()
    files = [_file_entry(raw, f"{name} files[{i}]", seen, chunk_bytes) for i, raw in enumerate(raw_files)]
    prov_raw = _field(obj, "provenance", dict, name)
    if v2:
        _check_v2_tool_and_provenance(tool, prov_raw, name)
    provenance = _provenance(prov_raw, name)
    manifest = Manifest(
        files=tuple(files),
        root_digest=digest,
        tool_version=tool_version,
        created=created,
        provenance=provenance,
        format_version=version,
        chunk_bytes=chunk_bytes,
    )
    if v2 and manifest.to_dict() != obj:  # e.g. a provenance field left out instead of null
        raise FormatError(
            f"{name}: not in the form squeeze writes (a field missing or out of place), so its root digest "
            "would not cover it",
            hint="re-seal the artifact with squeeze",
        )
    return manifest


def _check_v2_tool_and_provenance(tool: dict[str, Any], prov_raw: dict[str, Any], name: str) -> None:
    """Version 2's stricter rules: exactly the tool fields, tool name squeeze, no unknown provenance field."""
    _check_exact_keys(tool, _TOOL_KEYS, f"{name} tool")
    if tool["name"] != "squeeze":
        raise FormatError(f"{name}: tool name must be 'squeeze', found {short_repr(tool['name'])}")
    unknown = sorted(set(prov_raw) - _PROVENANCE_KEYS)
    if unknown:
        raise FormatError(f"{name} provenance: unknown field(s) {', '.join(map(repr, unknown))}")
    if "extra" in prov_raw and (not isinstance(prov_raw["extra"], dict) or not prov_raw["extra"]):
        raise FormatError(f"{name}: provenance field 'extra' must be a non-empty object when present")


def _provenance(prov_raw: dict[str, Any], name: str) -> Provenance:
    return Provenance(
        source_model=_optional_str(prov_raw, "source_model", name),
        source_digest=_optional_str(prov_raw, "source_digest", name),
        recipe_hash=_optional_str(prov_raw, "recipe_hash", name),
        calibration_hash=_optional_str(prov_raw, "calibration_hash", name),
        extra=prov_raw.get("extra", {}) if isinstance(prov_raw.get("extra", {}), dict) else {},
    )


def _check_exact_keys(obj: dict[str, Any], keys: set[str], where: str) -> None:
    if set(obj) != keys:
        raise FormatError(f"{where} must have exactly the fields {sorted(keys)}, found {sorted(obj)}")


def _file_entry(raw: object, where: str, seen: set[str], chunk_bytes: int | None = None) -> FileEntry:
    """One validated ``files[i]`` entry; ``seen`` collects the paths so far (a path listed twice is refused).
    ``chunk_bytes``: the manifest's (version 2), None in version 1 (no ``chunks`` allowed)."""
    if not isinstance(raw, dict):
        raise FormatError(f"{where} must be an object, found {type(raw).__name__}")
    extra = sorted(set(raw) - (_FILE_KEYS if chunk_bytes is None else _FILE_KEYS_V2))
    if extra:
        raise FormatError(f"{where}: unknown field(s) {', '.join(map(repr, extra))}")
    path = check_relative_path(_field(raw, "path", str, where), where)
    if path == MANIFEST_NAME:
        raise FormatError(f"{where}: the manifest cannot list itself")
    if path in seen:
        raise FormatError(f"{where}: path {path!r} is listed twice")
    seen.add(path)
    size = _field(raw, "size", int, where)
    if not 0 <= size <= MAX_FILE_BYTES:
        raise FormatError(f"{where}: size must be in [0, {MAX_FILE_BYTES}] (2**50), found {short_number(size)}")
    sha = _field(raw, "sha256", str, where)
    if not _SHA256_RE.fullmatch(sha):
        raise FormatError(f"{where}: sha256 must be 64 lowercase hex digits, found {sha[:80]!r}")
    if chunk_bytes is None:
        return FileEntry(path, size, sha)
    chunks = tuple(_field(raw, "chunks", list, where)) if "chunks" in raw else ()
    if "chunks" in raw and not chunks:
        raise FormatError(f"{where}: 'chunks' must be left out, not empty, for a file without chunk digests")
    entry = FileEntry(path, size, sha, chunks)
    _check_chunks(entry, chunk_bytes, where)
    return entry


def _optional_str(obj: dict[str, Any], key: str, where: str) -> str | None:
    value = obj.get(key)
    if value is not None and not isinstance(value, str):
        raise FormatError(f"{where}: provenance field {key!r} must be a string or null")
    return value
