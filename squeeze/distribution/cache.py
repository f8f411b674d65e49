"""The local artifact cache: where ``squeeze pull`` without ``--output`` and ``squeeze run -m URL`` put artifacts.

Layout: ``${SQUEEZE_CACHE:-${XDG_CACHE_HOME:-~/.cache}/squeeze}/artifacts/<source>/<root digest[:16]>/``.
``<source>`` is a readable name of the URL or repo (host and last path part, or ``org--name``) plus a short
hash of the exact source text; the root digest names the artifact's content, so a source that publishes a
new version gets a new directory and a complete earlier pull of the same version is reused as it is. Offline,
``squeeze.distribution.pull.resolve_source`` falls back to the latest complete pull from the same source.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from squeeze.distribution.remote import Source
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
    """The cache directory of every version pulled from ``source`` (as the user named it: for a Hub repo, the
    revision asked for, not the commit a pull was pinned to, so that offline use finds it again)."""
    tag = hashlib.sha256(source.canonical.encode("utf-8")).hexdigest()[:12]
    return cache_root() / "artifacts" / f"{source.cache_key()}-{tag}"


def artifact_cache_dir(source: Source, root_digest: str) -> Path:
    """Where the artifact with ``root_digest`` pulled from ``source`` lives in the cache."""
    return source_dir(source) / root_digest[:16]


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
