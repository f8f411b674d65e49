"""``squeeze pull``: download an artifact, verifying every byte against its manifest before it is kept.

Order of work: the manifest (and ``model.sig``) first; the manifest is parsed strictly (paths inside the
artifact only) and its root digest checked; with a public key the signature is checked over it before any
weight is fetched. Then every listed file downloads in parallel into the staging directory (see
``download`` for the pieces and resume, ``staging`` for the directory), and the staging directory is renamed
to the output once all of them verified. A failed pull leaves nothing under the output name.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from squeeze.distribution.cache import artifact_cache_dir, latest_cached
from squeeze.distribution.download import DEFAULT_RETRIES, Downloader, default_workers
from squeeze.distribution.http_client import DEFAULT_TIMEOUT, HttpClient, NotFound, show_url
from squeeze.distribution.pull_output import (
    ProgressFn,
    check_output,
    holds_manifest,
    intact,
    resolve_output,
    set_aside_for_repair,
)
from squeeze.distribution.remote import (
    Source,
    check_hub_allowed,
    hub_offline,
    is_remote,
    looks_like_repo_id,
    parse_source,
)
from squeeze.distribution.staging import Staging
from squeeze.distribution.watch import TransferWatch
from squeeze.errors import ConfigError, FormatError, IntegrityError, TransferError
from squeeze.format.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, SIGNATURE_NAME, Manifest, parse_manifest

#: A real signature is a few hundred bytes per file; anything larger is refused unread.
MAX_SIGNATURE_BYTES = 16 * 2**20


@dataclass(frozen=True)
class PullResult:
    """A pulled, verified artifact: where it is and what the pull moved."""

    source: str
    output: Path
    files: int
    bytes_downloaded: int
    bytes_reused: int
    seconds: float
    root_digest: str
    signed_by: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "output": str(self.output),
            "files": self.files,
            "bytes_downloaded": self.bytes_downloaded,
            "bytes_reused": self.bytes_reused,
            "seconds": round(self.seconds, 4),
            "root_digest": self.root_digest,
            "signed_by": self.signed_by,
            **self.extra,
        }


def pull_artifact(
    source: str,
    output: str | os.PathLike[str] | None = None,
    *,
    public_key: str | os.PathLike[str] | None = None,
    workers: int | None = None,
    progress: ProgressFn | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    retries: int = DEFAULT_RETRIES,
    min_rate: float | None = None,
    deadline: float | None = None,
) -> PullResult:
    """Download the artifact at ``source`` (an http(s) URL of its directory, or a Hub repo id
    ``org/name[@revision]``) into ``output`` (default: the local artifact cache, see ``cache``), verified
    against its manifest (and signature, with ``public_key``).

    ``output`` must not exist, or be an empty directory, or hold a complete earlier pull of the same
    artifact (hashed: nothing is downloaded when it is intact; a damaged one is repaired); a symbolic link is
    resolved first. ``timeout`` bounds each connect and read (seconds); a dropped connection is retried
    ``retries`` times in a row from where it stopped. ``progress(done, total)`` is called from worker
    threads. ``min_rate`` (bytes/s averaged over a minute) and ``deadline`` (seconds for the whole pull,
    0: none) stop a drip-fed or endless transfer (defaults: ``$SQUEEZE_PULL_MIN_RATE``, else 4096;
    ``$SQUEEZE_PULL_DEADLINE``, else none; see ``watch``). Raises ConfigError (bad source or output),
    FormatError (no manifest at the source, malformed manifest), IntegrityError (a byte, size or signature
    that does not match; the bad partial file is deleted) and TransferError (network; rerun to resume).
    """
    started = time.perf_counter()
    if workers is not None and workers < 1:
        raise ConfigError(f"workers must be >= 1, found {workers}", hint="omit it for the default")
    parsed = requested = parse_source(source)
    check_hub_allowed(parsed)
    target = resolve_output(Path(output)) if output is not None else None
    if target is not None:
        check_output(target, None)
    watch = TransferWatch(min_rate=min_rate, deadline=deadline)
    client = HttpClient(parsed.headers, timeout=timeout, watch=watch)
    try:
        remote = _remote_manifest(client, parsed, retries, public_key)
        manifest = remote.manifest
        if target is None:  # keyed by the source as named (a Hub pull is pinned to its commit by now)
            target = artifact_cache_dir(requested, manifest.root_digest)
        present = check_output(target, manifest) and intact(target, progress)
        done = (0, manifest.total_size, 0) if present else _download(client, remote, target, workers, progress, retries)
        downloaded, reused, count = done
        seconds = time.perf_counter() - started
    finally:
        client.close()
    return PullResult(
        source=source,
        output=target,
        files=len(manifest.files),
        bytes_downloaded=downloaded,
        bytes_reused=reused,
        seconds=seconds,
        root_digest=manifest.root_digest,
        signed_by=remote.signed_by,
        extra={"already_present": present, "workers": count},
    )


@dataclass(frozen=True)
class _Remote:
    """The source's manifest, parsed and its root digest checked, with its bytes, the signature (if any) and
    who signed it (with a public key); ``source`` as the manifest fetch resolved it."""

    source: Source
    manifest: Manifest
    manifest_bytes: bytes
    signature: bytes | None
    signed_by: str | None


def _remote_manifest(
    client: HttpClient, parsed: Source, retries: int, public_key: str | os.PathLike[str] | None
) -> _Remote:
    """The manifest and ``model.sig`` first, checked before any weight is fetched."""
    manifest_bytes, parsed = _fetch_manifest(client, parsed, retries)
    shown = f"{MANIFEST_NAME} from {show_url(parsed.url_for(MANIFEST_NAME))}"
    manifest = parse_manifest(manifest_bytes, shown)
    if manifest.computed_root_digest() != manifest.root_digest:
        raise IntegrityError(
            f"{shown}: root digest does not match the manifest's content (edited after it was sealed)",
            hint="the server holds a damaged or tampered manifest; nothing was downloaded",
        )
    manifest_sha256 = hashlib.sha256(manifest_bytes).hexdigest()
    signature = _fetch_optional(client, parsed, SIGNATURE_NAME, MAX_SIGNATURE_BYTES, retries, public_key is None)
    signed_by = None
    if public_key is not None:
        signed_by = _check_signature(signature, manifest, manifest_sha256, public_key, parsed)
    return _Remote(parsed, manifest, manifest_bytes, signature, signed_by)


def _download(
    client: HttpClient,
    remote: _Remote,
    target: Path,
    workers: int | None,
    progress: ProgressFn | None,
    retries: int,
) -> tuple[int, int, int]:
    """Every listed file downloaded in parallel into ``target``'s staging directory (a damaged earlier pull of
    this artifact set aside there first: its files resume the pull, re-hashed), the manifest and signature beside
    them, renamed to ``target`` once all verified: (bytes downloaded, bytes reused, the workers it ran)."""
    if holds_manifest(target):
        set_aside_for_repair(target)
    manifest = remote.manifest
    with Staging(target) as staging:
        downloader = Downloader(client, remote.source, manifest, staging, retries=retries, progress=progress)
        pieces = downloader.plan()
        count = workers if workers is not None else default_workers(len(pieces))
        totals = downloader.run(pieces, count)
        staging.write_small(MANIFEST_NAME, remote.manifest_bytes)
        keep = {entry.path for entry in manifest.files} | {MANIFEST_NAME}
        if remote.signature is not None:
            staging.write_small(SIGNATURE_NAME, remote.signature)
            keep.add(SIGNATURE_NAME)
        staging.prune(keep)
        staging.commit({entry.path: entry.size for entry in manifest.files})
    return totals.downloaded, totals.reused, count


def _fetch_manifest(client: HttpClient, source: Source, retries: int) -> tuple[bytes, Source]:
    """The manifest's bytes, and the source pinned to the Hub commit they came from. FormatError when the
    source has no manifest (not an artifact)."""
    url = source.url_for(MANIFEST_NAME)
    try:
        data, headers = _get_small(client, url, MAX_MANIFEST_BYTES, retries)
    except NotFound:
        raise FormatError(
            f"no {MANIFEST_NAME} at {show_url(url)}: not a squeeze artifact",
            hint="pass the URL of the directory that holds squeeze.manifest.json (or a Hub repo with one)",
        ) from None
    return data, source.pinned(headers)


def _fetch_optional(
    client: HttpClient, source: Source, name: str, limit: int, retries: int, lenient: bool
) -> bytes | None:
    """``name``'s bytes, or None when the server has none (404). ``lenient`` (nobody asked for it): any
    refusal (403, too large) also reads as none; a network failure still fails the pull."""
    try:
        return _get_small(client, source.url_for(name), limit, retries)[0]
    except NotFound:
        return None
    except TransferError as exc:
        if lenient and not exc.retryable:
            return None
        raise
    except FormatError:
        if lenient:
            return None
        raise


#: The hint of a manifest or signature too large to be one.
_NOT_AN_ARTIFACT = "the URL must name a squeeze artifact's directory (the one holding squeeze.manifest.json)"


def _get_small(client: HttpClient, url: str, limit: int, retries: int) -> tuple[bytes, dict[str, str]]:
    """A small whole response body (at most ``limit`` bytes, refused unread when it announces more)."""
    for attempt in range(retries + 1):
        try:
            body = client.get(url, limit=limit)
            if body.length > limit and not body.to_eof:
                body.close(reuse=False)
                raise FormatError(
                    f"{show_url(url)} is {body.length} bytes, larger than the {limit} byte limit", hint=_NOT_AN_ARTIFACT
                )
            data = body.read_all()
            if len(data) > limit:
                raise FormatError(f"{show_url(url)} is larger than the {limit} byte limit", hint=_NOT_AN_ARTIFACT)
            return data, dict(body.headers)
        except TransferError as exc:
            if isinstance(exc, NotFound) or not exc.retryable:
                raise
            if attempt == retries:
                if exc.hint:
                    raise
                raise TransferError(
                    exc.message,
                    hint="check the URL and that the server is up, then rerun",
                    retryable=exc.retryable,
                ) from None
            time.sleep(min(2.0, 0.1 * 2 ** (attempt + 1)))
    raise AssertionError("unreachable")


def _check_signature(
    signature: bytes | None,
    manifest: Manifest,
    manifest_sha256: str,
    public_key: str | os.PathLike[str],
    source: Source,
) -> str:
    """The signer's key digest, once ``signature`` checks out over the manifest; IntegrityError otherwise."""
    if signature is None:
        raise IntegrityError(
            f"the artifact at {show_url(source.url_for(''))} is not signed (no {SIGNATURE_NAME})",
            hint="pull without --public-key to accept an unsigned artifact, or ask its publisher to sign it",
        )
    from squeeze.format.signature import verify_signature_bytes

    return verify_signature_bytes(signature, manifest, manifest_sha256, public_key).key_sha256


def resolve_source(
    source: str, *, public_key: str | os.PathLike[str] | None = None, progress: ProgressFn | None = None
) -> Path:
    """A local artifact directory for ``source``: a local path as it is; an http(s) URL or ``hf://org/name``
    (``[@revision]``) pulled into the cache first (reused when the cache already holds a complete pull of the
    version the source serves now). A bare ``org/name`` is a local path (see squeeze.distribution.remote).

    When the source cannot be reached (TransferError: offline, server down) and the cache holds a complete
    earlier pull from it, the most recent one is returned (without a ``public_key``: a signature is only
    checked against what the source serves). With ``HF_HUB_OFFLINE`` set, a Hub source is that cached pull
    or a ConfigError, with no network access.

    The returned directory is verified when it loads (``squeeze.api.load``). Raises what ``pull_artifact``
    raises; ConfigError for a local path that does not exist.
    """
    if not is_remote(source):
        return existing_artifact_dir(source)
    parsed = parse_source(source)  # ConfigError before any network access for a malformed URL or repo id
    if parsed.is_hub and hub_offline():
        cached = None if public_key is not None else latest_cached(parsed)
        if cached is not None:
            return cached
        check_hub_allowed(parsed)  # raises: nothing cached, and no download while offline
    try:
        return pull_artifact(source, None, public_key=public_key, progress=progress).output
    except TransferError:
        cached = None if public_key is not None else latest_cached(parsed)
        if cached is None:
            raise
        return cached


def existing_artifact_dir(text: str) -> Path:
    """``text`` as a local path that exists; ConfigError naming it otherwise, with the explicit ``hf://`` form
    in the hint when it has a repo id's shape (a local path is never taken for a Hub repo)."""
    path = Path(text).expanduser()
    if os.path.lexists(path):
        return path
    from squeeze.format.swap import missing_artifact_error

    aside = missing_artifact_error(path.absolute())  # a calibrate-kv swap cut short: name the copy and the fix
    if aside is not None:
        raise aside
    hint = "pass the artifact's directory (or its squeeze.manifest.json)"
    if looks_like_repo_id(text):
        hint = f"to download the Hub repo {text} instead, pass hf://{text} (or run `squeeze pull {text}`)"
    raise ConfigError(f"no such artifact directory: {text}", hint=hint)
