"""``squeeze push``: upload a verified artifact to the Hugging Face Hub."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PushResult:
    """What was uploaded where."""

    repo_id: str
    revision: str | None
    files: int
    bytes_uploaded: int
    url: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "repo_id": self.repo_id,
            "revision": self.revision,
            "files": self.files,
            "bytes_uploaded": self.bytes_uploaded,
            "url": self.url,
        }


def push_artifact(
    path: str | os.PathLike[str],
    repo_id: str,
    *,
    token: str | None = None,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
) -> PushResult:
    """Verify the artifact at ``path`` and upload every file it lists (manifest and signature included) to the
    Hub repo ``repo_id``."""
    raise NotImplementedError("squeeze push is being built")  # replaced by the push implementation
