"""Where a pull reads from: an http(s) URL of an artifact directory, or a Hugging Face Hub repo id.

A Hub download happens only when it was asked for without ambiguity: ``hf://org/name`` anywhere a model is
named (``run -m``, ``serve``, ``eval``, ``squeeze.load``), or a bare ``org/name`` given to ``squeeze pull``
itself. Elsewhere ``org/name`` is a local path, so a mistyped directory is "no such artifact directory", never a
stranger's repo fetched and run; and nothing is downloaded from the Hub while ``HF_HUB_OFFLINE`` is set.

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
#: The explicit form of a Hub source wherever a local path is accepted too (as huggingface_hub's file system).
HUB_SCHEME = "hf://"


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

    @property
    def canonical(self) -> str:
        """One spelling per source: ``hf://org/name[@revision]`` for ``org/name`` and ``hf://org/name`` alike;
        a URL as given (stripped). What the artifact cache keys its directories by."""
        if self.repo_id is not None:
            return HUB_SCHEME + self.repo_id + (f"@{self.revision}" if self.revision else "")
        return self.text.strip()

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
    """True when ``text`` asks for a download: an http(s) URL or ``hf://org/name[@revision]``.

    A bare ``org/name`` is a local path here (only ``squeeze pull`` reads it as a repo id): a typo must never
    reach the Hub and run what it finds there."""
    return text.startswith(("https://", "http://", HUB_SCHEME))


def looks_like_repo_id(text: str) -> bool:
    """True when ``text`` has the shape of a Hub repo id (``org/name[@revision]``): for the hint that shows
    the explicit ``hf://`` form when such a local path does not exist."""
    return _REPO_ID.fullmatch(text) is not None and ".." not in text


def hub_offline() -> bool:
    """True when ``HF_HUB_OFFLINE`` is set to a true value (huggingface_hub's own spellings), read now."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def check_hub_allowed(source: Source) -> None:
    """Raise ConfigError for a Hub source while ``HF_HUB_OFFLINE`` is set (before any network access)."""
    if source.is_hub and hub_offline():
        raise ConfigError(
            f"HF_HUB_OFFLINE is set, and {source.text!r} would be downloaded from the Hugging Face Hub",
            hint="unset HF_HUB_OFFLINE to download it, or pass a local artifact directory",
        )


def parse_source(text: str) -> Source:
    """A Source from an ``https://`` / ``http://`` URL or a Hub repo id (``org/name[@revision]``).

    ``hf://org/name[@revision]`` is the same repo id, written explicitly. Raises ConfigError for anything else
    (another scheme, a URL with credentials, a malformed id).
    """
    repo_text = text[len(HUB_SCHEME) :] if text.startswith(HUB_SCHEME) else text
    if "://" in repo_text:
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
    match = _REPO_ID.fullmatch(repo_text.strip())
    if match is None or ".." in match["repo"]:
        raise ConfigError(
            f"cannot pull {text!r}: not an http(s) URL nor a Hugging Face Hub repo id",
            hint="pass https://host/path/to/artifact/ or hf://org/name (optionally hf://org/name@revision)",
        )
    return Source(text=text, repo_id=match["repo"], revision=match["revision"], headers=_hub_headers())


def _hub_headers() -> dict[str, str]:
    """The Hub's user agent and, when a token is configured (HF_TOKEN or ``hf auth login``), its Authorization."""
    from huggingface_hub.utils import build_hf_headers

    return dict(build_hf_headers(library_name="squeeze", library_version=__version__))
