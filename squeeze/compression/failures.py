"""What a compress run that stopped says: interrupted by a signal, or out of disk; both name what was
committed in the work area, so the user knows that rerunning the same command resumes from there."""

from __future__ import annotations

import errno
import signal

from squeeze.compression.preflight import SizeEstimate
from squeeze.compression.workarea import WorkArea
from squeeze.errors import Interrupted, ResourceError


def committed(work: WorkArea) -> str:
    """What the work area holds, in words ("2 layer group(s) and the Fisher information committed in ...")."""
    groups = work.committed_groups()
    parts = [f"{groups} layer group(s)"] if groups else []
    if work.has_fisher():
        parts.append("the Fisher information")
    if not parts:
        return "nothing was committed yet"
    return f"{' and '.join(parts)} committed in {work.root}"


def interrupted(signum: int, work: WorkArea) -> Interrupted:
    """The error of a run stopped by signal ``signum``: resumable when the work area has checkpoints."""
    name = signal.Signals(signum).name
    resumable = work.root.is_dir() and work.has_checkpoints()
    hint = (
        "rerun the same command (or add --resume) to continue from the last committed layer group"
        if resumable
        else "nothing was committed, so there is nothing to resume: rerun the same command to start again"
    )
    return Interrupted(
        f"interrupted by {name}; {committed(work)}",
        hint=hint,
        signum=signum,
        work_dir=str(work.root),
        resumable=resumable,
    )


def disk_full(work: WorkArea, estimate: SizeEstimate | None) -> ResourceError:
    """The error of a run that ran out of disk space (see :func:`is_disk_full`)."""
    size = f" (the artifact alone needs about {estimate.total_bytes / 1e9:.2f} GB)" if estimate else ""
    return ResourceError(
        f"no space left on the device while writing into {work.output}; {committed(work)}",
        hint=f"free some disk space{size} and rerun the same command: it resumes from the last committed "
        "layer group; the source model was only read, never written",
    )


def is_disk_full(exc: BaseException | None) -> bool:
    """ENOSPC / EDQUOT anywhere in the chain; safetensors' Rust writer reports it only as text."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(exc)
        if "No space left on device" in text or "StorageFull" in text or "Disk quota exceeded" in text:
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


__all__ = ["committed", "disk_full", "interrupted", "is_disk_full"]
