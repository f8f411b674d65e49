"""``squeeze pull``: download an artifact, verifying every byte against its manifest before it is kept."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ProgressFn = Callable[[int, int], None]


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
) -> PullResult:
    """Download the artifact at ``source`` (an http(s) URL of its directory, or a Hub repo id) into ``output``
    (default: the local artifact cache), verified against its manifest (and signature, with ``public_key``)."""
    raise NotImplementedError("squeeze pull is being built")  # replaced by the pull implementation
