"""The public face of squeeze: every verb of the CLI is one function here.

Heavier stages (models, calibration, quantization, runtime) are imported inside the functions that need
them, so ``import squeeze`` stays light and verify works without loading transformers.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from squeeze.format.inspect import ArtifactInfo, inspect_artifact
from squeeze.format.verify import VerifyReport, verify_artifact

ProgressFn = Callable[[int, int], None]


def verify_model_integrity(
    path: str | os.PathLike[str], *, workers: int | None = None, progress: ProgressFn | None = None
) -> VerifyReport:
    """Check every file of an artifact against its manifest (size and SHA-256, streamed, in parallel).

    ``path`` is the artifact directory or its ``squeeze.manifest.json``. Returns a VerifyReport whose
    ``ok`` is True only if the artifact is intact. Raises FormatError when the manifest is missing or
    malformed (nothing can be checked). ``progress(done_bytes, total_bytes)`` is called from worker threads.
    """
    return verify_artifact(path, workers=workers, progress=progress)


def inspect(path: str | os.PathLike[str]) -> ArtifactInfo:
    """Summarise an artifact (files, tensors by role, bits per weight, manifest status) from headers only."""
    return inspect_artifact(path)


__all__ = ["verify_model_integrity", "inspect", "VerifyReport", "ArtifactInfo"]
