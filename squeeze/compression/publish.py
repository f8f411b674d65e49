"""Putting a sealed artifact at its output path: never before it is complete, never over a user's files.

Both ways share one rule (output.py): squeeze removes only what an old artifact's manifest lists, and the
output is checked again just before it changes, since files may appear there while a job runs. They
differ in what the output path holds, so each keeps the guarantee its command documents:

* compress (:func:`publish_stage`) builds the artifact inside the output's own work area, which also
  holds the lock and the checkpoints, so the output directory itself stays put (it may be the working
  directory or a mount point). The old files are replaced one by one, manifest last, after a publishing
  record in the work area has named them: a run killed half-way is finished by the rerun, and until then
  the output holds no manifest, so nothing half-published verifies.
* calibrate-kv (:func:`kv_staging`, :func:`replace_dir`) builds the new artifact in a hidden sibling and
  exchanges the two directories atomically (squeeze.format.swap): the path holds a complete, verifying
  artifact at every instant, the old one until the exchange and the new one after it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from squeeze.compression.job import CompressJob
from squeeze.compression.output import check_output_dir, foreign_entries, owned_paths, remove_owned
from squeeze.compression.workarea import WORK_NAME, WorkArea
from squeeze.errors import ConfigError, FormatError
from squeeze.format.atomic import directory_mode, fsync_directory
from squeeze.format.manifest import MANIFEST_NAME
from squeeze.format.swap import aside_pattern, swap_in

# -- compress: in place, from the work area


def publish_stage(job: CompressJob) -> None:
    """Move the sealed artifact into the output, signals held back until it is done."""
    with job.guard.deferred():
        # checked again: the output may have changed during the run; what the old manifest lists now is
        # recorded before anything is touched, so a publish cut short knows on rerun what it may remove
        old_files = check_output_dir(job.work.output, job.overwrite, ignore=(WORK_NAME,))
        job.work.mark_publishing(job.summary, job.fingerprint, sorted(old_files))
        publish(job.work, old_files)


def finish_publish(job: CompressJob, record: dict[str, Any]) -> None:
    """Finish the publish a killed run began (``record``: WorkArea.publishing()) and take its summary."""
    with job.guard.deferred():
        publish(job.work, record["old_files"])
    job.summary = record["summary"]


def publish(work: WorkArea, old_files: Iterable[str]) -> None:
    """Move the sealed artifact from the work area into the output, manifest last, then drop the work area.

    The old artifact's manifest goes first (it stops verifying before anything else changes), then the old
    files the new artifact does not replace; the new files are renamed in one by one (a rename over an old
    file of the same name replaces it atomically), the manifest last. Only paths in ``old_files`` (what
    the old manifest listed, recorded before the publish began) or in the new manifest are ever touched.
    A run killed at any point finishes this on rerun.
    """
    staging, output = work.staging, work.output
    if (staging / MANIFEST_NAME).is_file():
        new_files = owned_paths(staging)
        foreign = foreign_entries(output, set(old_files) | new_files, ignore=(WORK_NAME,))
        if foreign:  # appeared since the run's checks: never overwritten, never deleted
            raise ConfigError(
                f"output directory {output} now holds files squeeze did not write: {', '.join(foreign)}",
                hint="move them away and rerun the same command: the sealed artifact is kept in the work area",
            )
        remove_owned(output, old_files, keep=new_files - {MANIFEST_NAME})
        for relative in sorted(new_files - {MANIFEST_NAME}):
            source = staging / relative
            if source.is_file():  # else moved by the run that was cut short
                (output / relative).parent.mkdir(parents=True, exist_ok=True)
                os.replace(source, output / relative)
        fsync_directory(output)
        os.replace(staging / MANIFEST_NAME, output / MANIFEST_NAME)
        fsync_directory(output)
    if staging.is_dir():
        shutil.rmtree(staging)  # empty directories, in squeeze's own work area
    work.remove()
    fsync_directory(output)


# -- calibrate-kv: a sibling directory, exchanged atomically

_STAGING_INFIX = ".kv-"
_STAGING_SUFFIX = ".partial"


@contextlib.contextmanager
def kv_staging(out: Path) -> Iterator[Path]:
    """A fresh hidden staging directory next to ``out``, flock-ed while in use; removed on failure.

    The lock tells a later run's leftover clean-up that this directory belongs to a live process.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}{_STAGING_INFIX}", suffix=_STAGING_SUFFIX, dir=out.parent))
    os.chmod(staging, directory_mode())  # mkdtemp makes it 0700; the swapped-in artifact keeps this mode
    fd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # not yet swapped: everything in it was written here
        raise
    finally:
        os.close(fd)


def replace_dir(staging: Path, out: Path, *, overwrite: bool, drop: frozenset[str] = frozenset()) -> None:
    """Swap the sealed ``staging`` in at ``out`` atomically, then discard what was there before. ``drop``: top
    level files of the old artifact that the user agreed to lose beside its listed ones (its model.sig)."""
    if os.path.lexists(out):  # checked again: files may have appeared in the output during calibration
        check_output_dir(out, overwrite, ignore=tuple(drop))
    previous = swap_in(staging, out)
    if previous is not None:
        _discard(previous, out, unfinished_staging=False, drop=drop)


def _discard(old: Path, out: Path, *, unfinished_staging: bool, drop: frozenset[str] = frozenset()) -> None:
    """Delete a directory moved aside from ``out`` (its old artifact), or a staging directory left behind.

    Only what squeeze wrote goes: an old artifact's manifest-listed files (checked to be all it holds just
    before the swap), or the whole of a staging directory that was never sealed (``unfinished_staging``:
    squeeze wrote all of it). Should anything else be there, only the listed files are removed and the
    directory is kept, visibly renamed, with the rest.
    """
    try:
        owned: frozenset[str] | None = owned_paths(old) | drop
    except (FormatError, OSError):
        owned = None if unfinished_staging else frozenset()
    if owned is not None and foreign_entries(old, owned):
        kept = Path(tempfile.mkdtemp(prefix=f"{out.name}.kv-leftover-", dir=old.parent))
        os.rename(old, kept)
        remove_owned(kept, owned)
        return
    shutil.rmtree(old, ignore_errors=True)


def clean_kv_leftovers(out: Path) -> None:
    """Drop what a killed calibrate-kv left next to ``out``: stale staging dirs, an old artifact moved aside."""
    parent = out.parent
    if not parent.is_dir():
        return
    patterns = (f".{out.name}{_STAGING_INFIX}*{_STAGING_SUFFIX}", aside_pattern(out))
    for candidate in sorted({p for pattern in patterns for p in parent.glob(pattern)}):
        if candidate.is_symlink() or not candidate.is_dir():
            continue
        fd = os.open(candidate, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # a live calibrate-kv is writing it
        finally:
            os.close(fd)
        _discard(candidate, out, unfinished_staging=candidate.name.startswith(f".{out.name}{_STAGING_INFIX}"))


__all__ = ["publish_stage", "finish_publish", "publish", "kv_staging", "replace_dir", "clean_kv_leftovers"]
