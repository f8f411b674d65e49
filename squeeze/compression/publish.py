"""Putting a sealed artifact at its output path: never before it is complete, never over a user's files.

Both ways share one rule (output.py): squeeze removes only what an old artifact's manifest lists, and the
output is checked again just before it changes, since files may appear there while a job runs. They
differ in what the output path holds, so each keeps the guarantee its command documents:

* compress (:func:`publish_stage`) builds the artifact inside the output's own work area, which also
  holds the lock and the checkpoints, so the output directory itself stays put (it may be the working
  directory or a mount point). The old files are replaced one by one, manifest last, after a publishing
  record in the work area has named them: a run killed half-way is finished by the rerun, and until then
  the output holds no manifest, so nothing half-published verifies.
* calibrate-kv (calibrate_kv.py) builds the new artifact in a hidden sibling and
  exchanges the two directories atomically (squeeze.format.swap): the path holds a complete, verifying
  artifact at every instant, the old one until the exchange and the new one after it.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from typing import Any

from squeeze.compression.job import CompressJob
from squeeze.compression.output import check_output_dir, foreign_entries, owned_paths, remove_owned
from squeeze.compression.workarea import WORK_NAME, WorkArea
from squeeze.errors import ConfigError
from squeeze.format.atomic import fsync_directory
from squeeze.format.manifest import MANIFEST_NAME

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


__all__ = ["publish_stage", "finish_publish", "publish"]
