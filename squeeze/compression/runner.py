"""The compress run: preflight -> lock -> the stages of the job's mode -> a sealed artifact in the output.

Preflight runs every cheap check first (output rules, architecture on the meta device, target linears,
size, disk, memory, context length); only then is the output locked and the job run as named stages: the
fingerprint (fingerprint.py), then the stages of the job's mode (squeeze.compression.pipelines: the whole
model or bounded by ``--max-memory``, in one process or under torchrun). Work happens in the
resumable work area ``<output>/.squeeze-work`` (see workarea.py): the Fisher information and each quantized
layer group are committed there as checkpoints, so a rerun of an interrupted job skips what is done. The
artifact is assembled and sealed in the work area and moved into the output only when complete (manifest
last); with ``overwrite`` the old artifact is removed only at that point, and only the files its manifest
lists (see output.py: a directory holding anything else is refused before any work).
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass

import torch

from squeeze.calibrate.block_walk import model_parts
from squeeze.calibrate.hessian import hessian_bytes_bound
from squeeze.compression import bounded_preflight, expert_plan
from squeeze.compression.distributed import (
    World,
    check_visible,
    check_world_options,
    join,
    leave,
    main_rank,
    share_json,
    world_from_env,
)
from squeeze.compression.embeddings import embedding_names
from squeeze.compression.failures import disk_full, interrupted, is_disk_full
from squeeze.compression.fingerprint import fingerprint_stage
from squeeze.compression.job import CompressJob, CompressResult, RecipeNeeds, StageProgress, run_stages
from squeeze.compression.lock import OutputLock
from squeeze.compression.output import check_not_model_path, check_output_dir, output_path
from squeeze.compression.pipelines import pipeline_for
from squeeze.compression.preflight import (
    SizeEstimate,
    check_budget,
    check_context_length,
    check_device,
    check_device_options,
    check_disk,
    check_memory,
    estimate_peak_memory,
    estimate_size,
    meta_model,
)
from squeeze.compression.publish import finish_publish
from squeeze.compression.workarea import WORK_NAME, WorkArea
from squeeze.config import CalibrationSpec, Recipe
from squeeze.errors import ConfigError, ResumeError
from squeeze.format.manifest import MANIFEST_NAME
from squeeze.models.source import ModelSource, resolve_model
from squeeze.models.targets import find_targets, linear_targets


@dataclass(frozen=True)
class RunOptions:
    """How a compress run goes, beside what it compresses (squeeze.api.compress's keywords; see there): the seed,
    what it may do to the output and its work area, the progress callback, the memory budget and the device.
    Checked by :func:`run_compress` before anything is read."""

    seed: int = 0
    overwrite: bool = False
    resume: bool = False
    restart: bool = False
    force: bool = False
    progress: StageProgress | None = None
    max_memory: int | None = None
    device: str | torch.device | None = None


def run_compress(
    model: str | ModelSource,
    output: str | os.PathLike[str],
    recipe: Recipe,
    calibration: CalibrationSpec | None,
    options: RunOptions = RunOptions(),
) -> CompressResult:
    """Compress ``model`` with ``recipe`` into the artifact directory ``output``. See squeeze.api.compress."""
    started = time.perf_counter()
    device, resume, restart, progress = options.device, options.resume, options.restart, options.progress
    compute = check_device(device)  # --device: a malformed spec, no CUDA, an index past the last GPU
    output = output_path(output)  # absolute; `current -> v3` means v3; a path too long for the work area is refused
    if resume and restart:
        raise ConfigError("--resume and --restart contradict each other", hint="pass at most one of them")
    # -- preflight: nothing expensive happens before every check below has passed; only the lock is written
    source = model if isinstance(model, ModelSource) else resolve_model(model)
    world = world_from_env()  # one process, or this rank of a torchrun world (distributed.py)
    needs = RecipeNeeds.of(recipe)
    check_world_options(world, error_compensation=needs.hessians, activation=needs.activation)
    check_device_options(compute, error_compensation=needs.hessians, ranks=world.size)
    job = CompressJob(
        source=source,
        recipe=recipe,
        calibration=_calibration_for(needs, calibration),
        work=WorkArea(output),
        target_names=(),
        seed=options.seed,
        overwrite=options.overwrite,
        restart=restart,
        progress=progress if world.is_main else None,
        started=started,
        max_memory=options.max_memory,
        world=world,
        device=compute,
    )
    return _run(job, resume=resume, force=options.force)


def _run(job: CompressJob, *, resume: bool, force: bool) -> CompressResult:
    """Claim the output, preflight, then the stages under the lock; on failure, a work area with nothing worth
    resuming is removed and the error says what was committed (failures.py)."""
    work, world = job.work, job.world
    output = work.output
    created_output = not output.exists()
    created_work = False
    lock: OutputLock | None = None
    estimate: SizeEstimate | None = None
    joined = join(world)
    try:
        # rank 0 alone checks the output rules, then creates and locks the work area; the others wait for it
        (created_work, lock), _ = world.step(
            "checking the output",
            lambda: _claim_output(work, job.source, overwrite=job.overwrite, resume=resume, world=world),
        )
        estimate, _ = world.step("preflight", lambda: _preflight(job, force))
        with job.guard:
            return _run_locked(job)
    except BaseException as exc:
        if created_work and not work.has_checkpoints():  # nothing worth resuming: leave no trace
            work.remove()
            if created_output:
                with contextlib.suppress(OSError):
                    output.rmdir()
        if job.guard.received is not None:
            raise interrupted(job.guard.received, work) from None
        if is_disk_full(exc):
            raise disk_full(work, estimate) from exc
        raise
    finally:
        if lock is not None:
            lock.release()
        leave(joined)


def _claim_output(
    work: WorkArea, source: ModelSource, *, overwrite: bool, resume: bool, world: World
) -> tuple[bool, OutputLock | None]:
    """Rank 0 (or the one process): the output rules, then the work area made (True if new) and locked. The
    other ranks of a torchrun world only check, later, that they see it (a filesystem every rank shares)."""
    if not world.is_main:
        return False, None
    _check_output(work, source, overwrite=overwrite, resume=resume)
    created = work.create()
    return created, OutputLock(work.root).acquire()  # a concurrent run into this output is refused here, at once


def _check_output(work: WorkArea, source: ModelSource, *, overwrite: bool, resume: bool) -> None:
    """The output rules (output.py), after clearing what an older squeeze's clean-up left next to an artifact."""
    output = work.output
    if work.is_leftover() and (output / MANIFEST_NAME).is_file():
        with OutputLock(work.root):  # held by a live run (before its fingerprint is written): LockError
            work.remove()  # garbage next to a sealed artifact (it made verify fail): nothing to resume in it
    if work.is_publishing():  # a publish cut short: its record says which files it replaces (checked there)
        check_not_model_path(output, [source.path])
    else:
        check_output_dir(output, overwrite, ignore=(WORK_NAME,), protected=[source.path])
    if resume and not work.root.is_dir():
        raise ResumeError(
            f"nothing to resume: {output} has no work area ({WORK_NAME})",
            hint="run the command without --resume to start a new compression",
        )


def _calibration_for(needs: RecipeNeeds, calibration: CalibrationSpec | None) -> CalibrationSpec | None:
    """The calibration the recipe uses: required for Fisher sensitivity, dropped (None) otherwise."""
    if not needs.calibration:
        return None
    if calibration is None:
        if needs.activation:
            why = "this recipe weights k-means by activation sensitivity (forward passes over calibration text)"
        elif needs.fisher:
            why = "this recipe weights k-means by Fisher sensitivity"
        else:
            why = "this recipe's error compensation takes its input Hessians from calibration text"
        other = "use --sensitivity uniform" if needs.fisher else "choose a recipe without error compensation"
        raise ConfigError(
            f"no calibration text given, and {why}",
            hint=f"pass a text file or spec (e.g. --calibration my_corpus.txt, or wikitext2-train), or {other}",
        )
    return calibration


def _preflight(job: CompressJob, force: bool) -> SizeEstimate:
    """Size, disk, memory and context checks on the meta-device model; finds the target linears (once)."""
    check_visible(job.world, job.work.root)  # torchrun: the work area rank 0 made is on a shared filesystem
    if job.max_memory is not None:  # before the architecture is read (a GGUF file's takes long)
        bounded_preflight.check_source(job.source)
    skeleton = meta_model(job.source)
    weights = job.recipe.weights
    # linears and 3-D expert parameters (MoE); ModelError when there is none
    targets = find_targets(skeleton, weights.targets, weights.ignore)
    estimate = estimate_size(skeleton, job.recipe, targets=targets)
    calibration = job.calibration
    checkpoint_bytes = estimate.quantized_bytes + (estimate.n_quantized_weights * 4 if calibration else 0)
    if job.needs.hessians:
        checkpoint_bytes += hessian_bytes_bound(linear_targets(targets))
    if job.max_memory is not None and calibration is not None:  # the hidden states a bounded run spills
        checkpoint_bytes += bounded_preflight.spill_bytes(skeleton, calibration.num_samples, calibration.seq_len)
    already = 0 if job.restart else job.work.disk_bytes()
    check_disk(job.work.output, estimate, checkpoint_bytes - already, force)
    seq_len = calibration.seq_len if calibration else None
    if job.max_memory is not None:  # a bounded run streams block by block (bounded_preflight.py): its own, lower peak
        bounded_preflight.check_streamable(job.source, job.recipe, skeleton, targets)
        plan = expert_plan.plan_expert_groups(
            skeleton, job.recipe, targets, seq_len, estimate.total_bytes, job.max_memory, _device_bytes(job.device)
        )
        job.expert_group, job.peak_estimate = plan.group, plan.peak_bytes  # a MoE block's experts, in groups
        expert_plan.check_expert_budget(plan, job.max_memory, force)
        check_budget(job.peak_estimate, job.max_memory, force)
        check_memory(job.peak_estimate, force)
    else:
        check_memory(estimate_peak_memory(skeleton, job.recipe, seq_len, targets=targets), force)
        if (device_bytes := _device_bytes(job.device)) is not None:  # --device cuda: experts in groups that fit it
            plan = expert_plan.plan_expert_groups(
                skeleton, job.recipe, targets, seq_len, estimate.total_bytes, None, device_bytes
            )
            job.expert_group = plan.group
    if calibration is not None:
        check_context_length(skeleton, calibration.seq_len)
        if job.device is not None:  # the Fisher runs block by block on the device (blockwise.py)
            model_parts(skeleton, option="--device")
    job.target_names = tuple(targets)
    job.embedding_names = embedding_names(skeleton, job.recipe, targets)  # weights.embedding_bits
    return estimate


def _device_bytes(device: torch.device | None) -> int | None:
    """A CUDA device's memory (what the expert groups of a bounded run must fit there); None: no CUDA device."""
    if device is None or device.type != "cuda":
        return None
    return int(torch.cuda.get_device_properties(device).total_memory)


def _run_locked(job: CompressJob) -> CompressResult:
    """Everything after the lock: the fingerprint, then the job's pipeline, or only the end of a publish a
    killed run began."""
    run_stages(job, (("fingerprint", fingerprint_stage),))
    # every rank reads the record before rank 0 may act on it; rank 0's reading decides
    record, flags = job.world.step("resuming", job.work.publishing, lambda r: b"\x01" if r is not None else b"")
    if flags[0][:1] == b"\x01":  # killed while publishing: the artifact is complete in the work area
        run_stages(job, (("publish", main_rank(lambda j: finish_publish(j, record or {}), "publish")),))
    else:
        run_stages(job, pipeline_for(job).for_job(job))
    job.summary = share_json(job.world, job.summary)  # torchrun: rank 0 sealed; every rank returns its result
    return job.result()


__all__ = ["CompressResult", "RunOptions", "StageProgress", "run_compress"]
