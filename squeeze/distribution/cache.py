"""The local artifact cache: where ``squeeze pull`` without ``--output`` and ``squeeze run -m URL`` put artifacts.

Layout: ``${SQUEEZE_CACHE:-${XDG_CACHE_HOME:-~/.cache}/squeeze}/artifacts/<source>/<root digest[:16]>/``.
``<source>`` is a readable name of the URL or repo (host and last path part, or ``org--name``) plus a short
hash of the exact source text; the root digest names the artifact's content, so a source that publishes a
new version gets a new directory and a complete earlier pull of the same version is reused as it is. Offline,
``resolve_source`` falls back to the latest complete pull from the same source.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from squeeze.distribution.pull import ProgressFn
from squeeze.distribution.source import Source, parse_source
from squeeze.format.manifest import MANIFEST_NAME


def cache_root() -> Path:
    """``$SQUEEZE_CACHE``, else ``$XDG_CACHE_HOME/squeeze``, else ``~/.cache/squeeze``."""
    explicit = os.environ.get("SQUEEZE_CACHE")
    if explicit:
        return Path(explicit).expanduser().absolute()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return (base / "squeeze").absolute()


def source_dir(source: Source) -> Path:
    """The cache directory of every version pulled from ``source``."""
    tag = hashlib.sha256(source.text.strip().encode("utf-8")).hexdigest()[:12]
    return cache_root() / "artifacts" / f"{source.cache_key()}-{tag}"


def artifact_cache_dir(source: Source, root_digest: str) -> Path:
    """Where the artifact with ``root_digest`` pulled from ``source`` lives in the cache."""
    return source_dir(source) / root_digest[:16]


def resolve_source(
    source: str, *, public_key: str | os.PathLike[str] | None = None, progress: ProgressFn | None = None
) -> Path:
    """A local artifact directory for ``source``: an existing local path as it is; an http(s) URL or a Hub
    repo id (``org/name[@revision]`` that is not an existing local path) pulled into the cache first
    (reused when the cache already holds a complete pull of the version the source serves now).

    When the source cannot be reached (TransferError: offline, server down) and the cache holds a complete
    earlier pull from it, the most recent one is returned (without a ``public_key``: a signature is only
    checked against what the source serves).

    The returned directory is verified when it loads (``squeeze.api.load``). Raises what ``pull_artifact``
    raises; ConfigError for a string that is neither a path nor a URL nor a repo id.
    """
    if "://" not in source and Path(source).expanduser().exists():
        return Path(source).expanduser()
    from squeeze.distribution.http import TransferError
    from squeeze.distribution.pull import pull_artifact

    parsed = parse_source(source)  # ConfigError before any network access for neither a URL nor a repo id
    try:
        return pull_artifact(source, None, public_key=public_key, progress=progress).output
    except TransferError:
        cached = None if public_key is not None else latest_cached(parsed)
        if cached is None:
            raise
        return cached


def latest_cached(source: Source) -> Path | None:
    """The most recently pulled complete artifact from ``source`` in the cache (a directory with a manifest:
    only complete pulls are renamed into place), or None."""
    try:
        found = [
            d for d in source_dir(source).iterdir() if not d.name.startswith(".") and (d / MANIFEST_NAME).is_file()
        ]
    except OSError:
        return None
    return max(found, key=lambda d: (d / MANIFEST_NAME).stat().st_mtime, default=None)
