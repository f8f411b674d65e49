"""Where a pull reads from: an http(s) URL of an artifact directory, or a Hugging Face Hub repo id.

A Source turns an artifact-relative path into a URL (each path component URL-quoted) and carries the
headers every request sends. Hub repos go through huggingface_hub for what it knows: the endpoint
(``HF_ENDPOINT`` mirrors, read when the pull starts), the ``resolve`` URL layout, the token and user agent
(``build_hf_headers``), and the local Hub cache (``cached_file``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from urllib.parse import quote, urlsplit

from squeeze.errors import ConfigError
from squeeze.version import __version__

#: ``org/name`` or ``org/name@revision`` (the Hub's own rules: letters, digits, '-', '_', '.').
_REPO_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95})(?:@(?P<revision>[\w./-]{1,200}))?")
_COMMIT = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True)
class Source:
    """An artifact's remote location. ``url_for(path)`` is the URL of one of its files."""

    text: str  # as the user gave it
    base_url: str = ""  # http(s): the directory URL, ending in '/'
    repo_id: str | None = None  # Hub: the repo and revision
    revision: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def is_hub(self) -> bool:
        return self.repo_id is not None

    def url_for(self, path: str) -> str:
        if self.repo_id is not None:
            from huggingface_hub import constants, hf_hub_url

            endpoint = os.environ.get("HF_ENDPOINT") or constants.ENDPOINT
            return hf_hub_url(self.repo_id, path, revision=self.revision, endpoint=endpoint.rstrip("/"))
        return self.base_url + "/".join(quote(part, safe="") for part in path.split("/"))

    def pinned(self, response_headers: dict[str, str]) -> Source:
        """For a Hub repo: the same source pinned to the commit the manifest came from (``X-Repo-Commit``), so
        that a branch moving during the pull cannot mix files of two commits. Else ``self``."""
        commit = {k.lower(): v for k, v in response_headers.items()}.get("x-repo-commit", "")
        if self.repo_id is not None and _COMMIT.fullmatch(commit):
            return replace(self, revision=commit)
        return self

    def cached_file(self, path: str) -> Path | None:
        """The Hub cache's copy of ``path`` at this revision, if the Hub's own downloads left one (else None)."""
        if self.repo_id is None:
            return None
        from huggingface_hub import try_to_load_from_cache

        try:  # HF_HUB_CACHE read now, like HF_ENDPOINT (huggingface_hub reads both once, at import)
            cache_dir = os.environ.get("HF_HUB_CACHE") or None
            found = try_to_load_from_cache(self.repo_id, path, cache_dir=cache_dir, revision=self.revision)
        except (OSError, ValueError):
            return None
        return Path(found) if isinstance(found, str) else None

    def cache_key(self) -> str:
        """A short, readable, filesystem-safe name for this source (the cache directory's)."""
        if self.repo_id is not None:
            name = self.repo_id.replace("/", "--") + (f"@{self.revision}" if self.revision else "")
        else:
            parts = urlsplit(self.base_url)
            name = (parts.hostname or "host") + "-" + (parts.path.rstrip("/").rsplit("/", 1)[-1] or "root")
        return re.sub(r"[^A-Za-z0-9._@-]", "_", name)[:80]


def is_remote(text: str) -> bool:
    """True when ``text`` names an artifact to pull: an http(s) URL, or a Hub repo id (``org/name[@revision]``)
    that is not an existing local path (a local directory of that name always wins, as in transformers)."""
    if text.startswith(("https://", "http://")):
        return True
    return _REPO_ID.fullmatch(text) is not None and not os.path.lexists(os.path.expanduser(text))


def parse_source(text: str) -> Source:
    """A Source from an ``https://`` / ``http://`` URL or a Hub repo id (``org/name[@revision]``).

    Raises ConfigError for anything else (another scheme, a URL with credentials, a malformed id).
    """
    if "://" in text:
        parts = urlsplit(text)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(
                f"cannot pull {text!r}: only https:// and http:// URLs (or Hub repo ids) are supported",
                hint="pass the URL of the artifact's directory, e.g. https://example.org/models/my-w4/",
            )
        if parts.username or parts.password:
            raise ConfigError(
                "the pull URL carries a user name or password",
                hint="put credentials in a header-aware mirror or use a Hub token (HF_TOKEN), not in the URL",
            )
        path = parts.path
        if path.endswith("/squeeze.manifest.json"):  # the manifest's own URL names its directory too
            path = path[: -len("squeeze.manifest.json")]
        base = f"{parts.scheme}://{parts.netloc}{path.rstrip('/')}/"
        if parts.query:
            raise ConfigError(
                f"the pull URL {text!r} has a query string",
                hint="pass the artifact directory's plain URL; its files are fetched below it",
            )
        return Source(text=text, base_url=base)
    match = _REPO_ID.fullmatch(text.strip())
    if match is None or ".." in match["repo"]:
        raise ConfigError(
            f"cannot pull {text!r}: not an http(s) URL nor a Hugging Face Hub repo id",
            hint="pass https://host/path/to/artifact/ or org/name (optionally org/name@revision)",
        )
    return Source(text=text, repo_id=match["repo"], revision=match["revision"], headers=_hub_headers())


def _hub_headers() -> dict[str, str]:
    """The Hub's user agent and, when a token is configured (HF_TOKEN or ``hf auth login``), its Authorization."""
    from huggingface_hub.utils import build_hf_headers

    return dict(build_hf_headers(library_name="squeeze", library_version=__version__))
