"""What a compress run depends on, so that a resumed run provably continues the same job.

A fingerprint holds the digest of the source model's files, the full recipe, the calibration spec (with a
digest of its text file instead of the path, so the same file reached from another directory matches),
the seed, and the squeeze and format versions. Two fingerprints are compared key by key, so a refusal can
say exactly what changed. :func:`fingerprint_stage`, the first stage of every compress run, claims the work
area for the job (writing its fingerprint) or refuses one made by a different job.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from squeeze.compression.distributed import check_same_job, job_digest
from squeeze.compression.job import CompressJob
from squeeze.compression.workarea import WorkArea
from squeeze.config import CalibrationSpec, Recipe
from squeeze.errors import ResumeError
from squeeze.format.quant_config import FORMAT_VERSION
from squeeze.models.source import source_digest
from squeeze.version import __version__

_CHUNK = 4 * 2**20


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def build_fingerprint(
    *,
    source_model: str,
    source_digest: str,
    recipe: Recipe,
    calibration: CalibrationSpec | None,
    seed: int,
    squeeze_version: str,
    format_version: int,
) -> dict[str, Any]:
    """A JSON-ready description of everything the artifact's bytes depend on."""
    calib: dict[str, Any] | None = None
    if calibration is not None:
        calib = calibration.to_dict()
        path = calib.pop("path", None)
        if path and Path(path).is_file():
            calib["text_sha256"] = file_sha256(Path(path))
        elif path:
            calib["path"] = path
    return {
        "squeeze_version": squeeze_version,
        "format_version": format_version,
        "source": {"model": source_model, "digest": source_digest},
        "recipe": recipe.to_dict(),
        "calibration": calib,
        "seed": seed,
    }


def _flatten(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(value, Mapping) and value:
        for key in sorted(value):
            yield from _flatten(value[key], f"{prefix}.{key}" if prefix else str(key))
    else:
        yield prefix, value


def fingerprint_differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """One line per differing key: ``recipe.weights.bits: 4 in the work area, 3 now``; empty when equal."""
    old, new = dict(_flatten(saved)), dict(_flatten(current))
    lines = []
    for key in sorted(set(old) | set(new)):
        if old.get(key, "<absent>") != new.get(key, "<absent>"):
            before, after = _short(old.get(key, "<absent>")), _short(new.get(key, "<absent>"))
            lines.append(f"{key}: {before} in the work area, {after} now")
    return lines


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:16] + "..." + text[-8:]


def fingerprint_stage(job: CompressJob) -> None:
    """Claim the work area for this job (writing its fingerprint), or refuse one made by a different job.

    Under torchrun every rank computes the fingerprint and a world whose ranks disagree is refused on every
    rank; rank 0 alone then claims the work area."""
    world = job.world
    options = {"output": str(job.work.output), "overwrite": job.overwrite, "restart": job.restart}
    _, digests = world.step("fingerprint", lambda: _fingerprint(job), lambda _: job_digest(job.fingerprint, options))
    check_same_job(world, digests)
    world.step("claiming the work area", lambda: _claim_work_area(job) if world.is_main else None)


def _fingerprint(job: CompressJob) -> None:
    job.digest = source_digest(job.source)
    job.fingerprint = build_fingerprint(
        source_model=job.source.model_id,
        source_digest=job.digest,
        recipe=job.recipe,
        calibration=job.calibration,
        seed=job.seed,
        squeeze_version=__version__,
        format_version=FORMAT_VERSION,
    )


def _claim_work_area(job: CompressJob) -> None:
    if job.restart:
        job.work.reset()
    job.work.clean_temps()
    check_fingerprint(job.work, job.fingerprint)


def check_fingerprint(work: WorkArea, fingerprint: dict[str, Any]) -> None:
    """Write the fingerprint of a new job, or refuse (ResumeError) to resume a work area made by a different one."""
    saved = work.read_fingerprint()
    if saved is None:
        if work.has_checkpoints():
            raise ResumeError(
                f"the work area {work.root} has checkpoints but no fingerprint, so it cannot be resumed",
                hint="pass --restart to discard it and start over",
            )
        work.write_fingerprint(fingerprint)
        return
    differences = fingerprint_differences(saved, fingerprint)
    if differences:
        more = f"; and {len(differences) - 6} more" if len(differences) > 6 else ""
        raise ResumeError(
            f"cannot resume the work area in {work.output}: it was made by a different job ("
            + "; ".join(differences[:6])
            + more
            + ")",
            hint="rerun with the original model, recipe, calibration and seed, or pass --restart to discard "
            "the work area and start over",
        )


__all__ = ["build_fingerprint", "check_fingerprint", "file_sha256", "fingerprint_differences", "fingerprint_stage"]
