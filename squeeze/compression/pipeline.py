"""The compress pipeline: preflight -> lock -> the job's stages -> a sealed artifact in the output.

Preflight runs every cheap check first (output rules, architecture on the meta device, target linears,
size, disk, memory, context length); only then is the output locked and the job run as named stages
(job.py): fingerprint, calibrate, load, sensitivity, quantize, write, seal, publish. Work happens in the
resumable work area ``<output>/.squeeze-work`` (see workarea.py): the Fisher information and each quantized
layer group are committed there as checkpoints, so a rerun of an interrupted job skips what is done. The
artifact is assembled and sealed in the work area and moved into the output only when complete (manifest
last); with ``overwrite`` the old artifact is removed only at that point, and only the files its manifest
lists (see output.py: a directory holding anything else is refused before any work).
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
from typing import Any

import torch
from torch import nn

from squeeze.calibrate.fisher import finish_sums, fisher_information, fisher_sums, new_sums
from squeeze.calibrate.generated import sample_windows_from_model, start_token
from squeeze.calibrate.hessian import hessian_bytes_bound, input_hessians
from squeeze.calibrate.windows import calibration_windows
from squeeze.compression import streaming
from squeeze.compression.assemble import seal_stage, write_stage
from squeeze.compression.bit_plan import plan_stage
from squeeze.compression.distributed import (
    World,
    broadcast_tensors,
    check_same_job,
    check_visible,
    check_world_options,
    every_rank,
    job_digest,
    join,
    leave,
    main_first,
    main_rank,
    share_json,
    sum_in_rank_order,
    window_range,
    world_from_env,
)
from squeeze.compression.embeddings import embedding_names, embedding_targets
from squeeze.compression.fingerprint import build_fingerprint, fingerprint_differences
from squeeze.compression.job import CompressJob, CompressResult, Stage, StageProgress, run_stages, timed
from squeeze.compression.lock import OutputLock
from squeeze.compression.output import check_not_model_path, check_output_dir, output_path
from squeeze.compression.preflight import (
    SizeEstimate,
    check_budget,
    check_context_length,
    check_disk,
    check_memory,
    estimate_peak_memory,
    estimate_size,
    meta_model,
)
from squeeze.compression.publish import finish_publish, publish_stage
from squeeze.compression.quantize import layer_groups, quantize_module, quantize_stage, weight_format
from squeeze.compression.tuning import tune_stage
from squeeze.compression.workarea import WORK_NAME, WorkArea
from squeeze.config import CalibrationSpec, Recipe
from squeeze.errors import ConfigError, Interrupted, ResourceError, ResumeError
from squeeze.format.manifest import MANIFEST_NAME
from squeeze.format.quant_config import FORMAT_VERSION
from squeeze.models.source import ModelSource, load_model, load_tokenizer, resolve_model, source_digest
from squeeze.models.targets import Target, find_targets, linear_targets, target_at
from squeeze.version import __version__


def needs_calibration(recipe: Recipe) -> bool:
    """Whether compress needs calibration text: the recipe's format uses the Fisher and the recipe asks for it,
    or the recipe asks for error compensation (the input Hessians come from the same calibration pass)."""
    fmt = weight_format(recipe)
    return (fmt.uses_fisher and recipe.weights.sensitivity == "fisher") or uses_hessians(recipe)


def uses_hessians(recipe: Recipe) -> bool:
    """Whether the recipe quantizes with error compensation (then calibration also accumulates input Hessians)."""
    return weight_format(recipe).uses_hessian and recipe.weights.error_compensation


def run_compress(
    model: str | ModelSource,
    output: str | os.PathLike[str],
    recipe: Recipe,
    calibration: CalibrationSpec | None,
    *,
    seed: int = 0,
    overwrite: bool = False,
    resume: bool = False,
    restart: bool = False,
    force: bool = False,
    progress: StageProgress | None = None,
    max_memory: int | None = None,
) -> CompressResult:
    """Compress ``model`` with ``recipe`` into the artifact directory ``output``. See squeeze.api.compress."""
    started = time.perf_counter()
    output = output_path(output)  # absolute; `current -> v3` means v3; a path too long for the work area is refused
    if resume and restart:
        raise ConfigError("--resume and --restart contradict each other", hint="pass at most one of them")
    # -- preflight: nothing expensive happens before every check below has passed; only the lock is written
    source = model if isinstance(model, ModelSource) else resolve_model(model)
    work = WorkArea(output)
    world = world_from_env()  # one process, or this rank of a torchrun world (distributed.py)
    check_world_options(world, error_compensation=uses_hessians(recipe), max_memory=max_memory)
    job = CompressJob(
        source=source,
        recipe=recipe,
        calibration=_calibration_for(recipe, calibration),
        work=work,
        target_names=(),
        seed=seed,
        overwrite=overwrite,
        restart=restart,
        progress=progress if world.is_main else None,
        started=started,
        max_memory=max_memory,
        world=world,
    )
    created_output = not output.exists()
    created_work = False
    lock: OutputLock | None = None
    estimate: SizeEstimate | None = None
    joined = join(world)
    try:
        # rank 0 alone checks the output rules, then creates and locks the work area; the others wait for it
        (created_work, lock), _ = world.step(
            "checking the output", lambda: _claim_output(work, source, overwrite=overwrite, resume=resume, world=world)
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
            raise _interrupted(job.guard.received, work) from None
        if _is_disk_full(exc):
            raise _disk_full(work, estimate) from exc
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


def _calibration_for(recipe: Recipe, calibration: CalibrationSpec | None) -> CalibrationSpec | None:
    """The calibration the recipe uses: required for Fisher sensitivity, dropped (None) otherwise."""
    if not needs_calibration(recipe):
        return None
    if calibration is None:
        raise ConfigError(
            "no calibration text given, and this recipe weights k-means by Fisher sensitivity",
            hint="pass a text file or spec (e.g. --calibration my_corpus.txt, or wikitext2-train), "
            "or use --sensitivity uniform",
        )
    return calibration


def _preflight(job: CompressJob, force: bool) -> SizeEstimate:
    """Size, disk, memory and context checks on the meta-device model; finds the target linears (once)."""
    check_visible(job.world, job.work.root)  # torchrun: the work area rank 0 made is on a shared filesystem
    if job.max_memory is not None:  # before the architecture is read (a GGUF file's takes long)
        streaming.check_source(job.source)
    skeleton = meta_model(job.source)
    weights = job.recipe.weights
    # linears and 3-D expert parameters (MoE); ModelError when there is none
    targets = find_targets(skeleton, weights.targets, weights.ignore)
    estimate = estimate_size(skeleton, job.recipe, targets=targets)
    calibration = job.calibration
    checkpoint_bytes = estimate.quantized_bytes + (estimate.n_quantized_weights * 4 if calibration else 0)
    if uses_hessians(job.recipe):
        checkpoint_bytes += hessian_bytes_bound(linear_targets(targets))
    if job.max_memory is not None and calibration is not None:  # the hidden states a bounded run spills
        checkpoint_bytes += streaming.spill_bytes(skeleton, calibration.num_samples, calibration.seq_len)
    already = 0 if job.restart else job.work.disk_bytes()
    check_disk(job.work.output, estimate, checkpoint_bytes - already, force)
    seq_len = calibration.seq_len if calibration else None
    if job.max_memory is not None:  # a bounded run streams block by block (streaming.py): its own, lower peak
        streaming.check_streamable(job.source, job.recipe, skeleton, targets)
        job.peak_estimate = streaming.streaming_peak_bytes(skeleton, job.recipe, targets, seq_len, estimate.total_bytes)
        check_budget(job.peak_estimate, job.max_memory, force)
        check_memory(job.peak_estimate, force)
    else:
        check_memory(estimate_peak_memory(skeleton, job.recipe, seq_len, targets=targets), force)
    if calibration is not None:
        check_context_length(skeleton, calibration.seq_len)
    job.target_names = tuple(targets)
    job.embedding_names = embedding_names(skeleton, job.recipe, targets)  # weights.embedding_bits
    return estimate


def _run_locked(job: CompressJob) -> CompressResult:
    """Everything after the lock: the stages, or only the end of a publish a killed run began."""
    run_stages(job, (("fingerprint", fingerprint_stage),))
    # every rank reads the record before rank 0 may act on it; rank 0's reading decides
    record, flags = job.world.step("resuming", job.work.publishing, lambda r: b"\x01" if r is not None else b"")
    if flags[0][:1] == b"\x01":  # killed while publishing: the artifact is complete in the work area
        run_stages(job, (("publish", main_rank(lambda j: finish_publish(j, record or {}))),))
    else:
        run_stages(
            job,
            tuple(
                (name, _placed(job, name, stage))
                for name, stage in (STAGE_FUNCTIONS if job.max_memory is None else STREAMING_STAGE_FUNCTIONS)
                if job.calibration is not None or name not in _CALIBRATION_STAGES
            ),
        )
    job.summary = share_json(job.world, job.summary)  # torchrun: rank 0 sealed; every rank returns its result
    return job.result()


def _placed(job: CompressJob, name: str, stage: Stage) -> Stage:
    """Which ranks of a torchrun world run ``stage`` (distributed.py); one process: it runs as it is."""
    if not job.world.active:
        return stage
    if name == "sensitivity":
        return world_sensitivity_stage  # its windows split across ranks, the partial sums combined
    if name == "plan":
        return main_first(stage)  # rank 0 commits the plan, the others read it back
    if name in ("tune", "write", "seal", "publish"):  # tune: every group's checkpoint, then rank 0's write
        return main_rank(stage)
    return every_rank(stage)  # calibrate, load, quantize (each rank its own layer groups)


# -- the stages before quantization (quantize.py, assemble.py and publish.py hold the rest)


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
    _check_fingerprint(job.work, job.fingerprint)


def calibrate_stage(job: CompressJob) -> None:
    """Token windows (n, T) of the calibration text, unless the Fisher is already committed; before the
    model loads, so a text too short fails fast."""
    calibration = job.calibration
    if calibration is not None and not job.work.has_fisher():
        tokenizer = load_tokenizer(job.source)
        job.windows = calibration_windows(calibration, tokenizer)
        if job.recipe.weights.generated_samples and uses_hessians(job.recipe):
            start_token(tokenizer)  # a tokenizer with nothing to start a sample from fails before the model loads


def load_stage(job: CompressJob) -> None:
    """The model in fp32 and its target linears (the ones preflight found on the meta-device build)."""
    job.model, job.tokenizer = load_model(job.source, dtype=torch.float32)
    job.targets = _target_modules(job.model, job.target_names)
    job.embeddings = embedding_targets(job.model, job.embedding_names)


def _target_modules(net: nn.Module, names: tuple[str, ...]) -> dict[str, Target]:
    """``names`` -> the targets of ``net`` (linears, expert parameters); the meta build and the loaded model
    share one architecture, so every name is found again."""
    return {name: target_at(net, name) for name in names}


def sensitivity_stage(job: CompressJob) -> None:
    """The Fisher information of every target weight: read back from its checkpoint, or computed and committed."""
    calibration = job.calibration
    if calibration is None:
        return
    ec = uses_hessians(job.recipe)
    with timed(job.timings, "checkpoint"):
        loaded = job.work.load_fisher([*job.targets, *job.embeddings])
        hessians = job.work.load_hessians(list(linear_targets(job.targets))) if ec and loaded is not None else None
    if loaded is not None and (hessians is not None or not ec):
        job.fisher = loaded
        job.hessians = hessians or {}
    else:
        if job.windows is None:  # the saved Fisher (or Hessians) was unreadable
            job.windows = calibration_windows(calibration, load_tokenizer(job.source))
        progress = job.progress
        report = (lambda done, total: progress("fisher", done, total)) if progress else None
        # the input Hessians (error compensation) accumulate by forward hooks during the Fisher pass itself
        # (expert parameters have no input of their own: no Hessian, they are quantized without compensation)
        with input_hessians(linear_targets(job.targets) if ec else {}) as accumulated:
            job.fisher = fisher_information(  # the embeddings' gradients too, when they are quantized
                job.loaded_model(), job.windows, _fisher_modules(job), progress=report
            )
            if _samples_for_hessians(job):
                _sample_for_hessians(job, calibration.seq_len)  # the same hooks add the sampled tokens' inputs
        job.hessians = accumulated.result() if ec else {}
        with timed(job.timings, "checkpoint"):
            if ec:  # first: a committed Fisher without its Hessians is recomputed, never half trusted
                job.work.save_hessians(job.hessians)
            job.work.save_fisher(job.fisher)
    job.windows = None


def _samples_for_hessians(job: CompressJob) -> bool:
    """Whether the model samples text for the Hessians: weights.generated_samples with error compensation and
    at least one linear to compensate (expert parameters have no Hessian)."""
    weights = job.recipe.weights
    return bool(weights.generated_samples and uses_hessians(job.recipe) and linear_targets(job.targets))


def _sample_for_hessians(job: CompressJob, seq_len: int) -> None:
    """Run the model on ``weights.generated_samples`` sequences it samples itself (seeded by the job's seed),
    inside the caller's input_hessians context: their tokens' inputs join the calibration text's."""
    progress = job.progress
    report = (lambda done, total: progress("generate", done, total)) if progress else None
    with timed(job.timings, "generate"):
        sample_windows_from_model(
            job.loaded_model(),
            job.recipe.weights.generated_samples,
            seq_len,
            start=start_token(job.tokenizer),
            seed=job.seed,
            progress=report,
        )


def _fisher_modules(job: CompressJob) -> dict[str, nn.Linear | nn.Embedding]:
    """Every weight whose Fisher is accumulated: targets and embeddings. An ExpertWeight exposes its 3-D
    parameter as ``.weight``, all fisher_information reads, so its Fisher comes shaped like the parameter."""
    modules: dict[str, Any] = {**job.targets, **job.embeddings}
    return modules


def world_sensitivity_stage(job: CompressJob) -> None:
    """sensitivity_stage under torchrun: each rank sums the squared gradients of its contiguous share of the
    windows (float64), rank 0 adds the shares in rank order, rounds once to fp32 and commits the Fisher; every
    rank gets it (the bits one process computes). Error compensation is refused before (check_world_options)."""
    world = job.world
    calibration = job.calibration
    if calibration is None:
        return
    modules = _fisher_modules(job)

    def read() -> dict[str, torch.Tensor] | None:
        with timed(job.timings, "checkpoint"):
            return job.work.load_fisher(list(modules))

    loaded, flags = world.step("reading the Fisher", read, lambda f: b"\x01" if f is not None else b"")
    if loaded is not None and all(flag[:1] == b"\x01" for flag in flags):
        job.fisher, job.windows = loaded, None
        return

    def partial() -> dict[str, torch.Tensor]:
        windows = (
            job.windows if job.windows is not None else calibration_windows(calibration, load_tokenizer(job.source))
        )
        start, stop = window_range(len(windows), world)
        if start == stop:  # more ranks than windows: this rank adds nothing
            return new_sums({name: module.weight for name, module in modules.items()})
        progress = job.progress
        report = (lambda done, total: progress("fisher", done, total)) if progress else None
        return fisher_sums(job.loaded_model(), windows[start:stop], modules, progress=report)

    sums, _ = world.step("the Fisher", partial)
    sum_in_rank_order(world, sums)  # rank 0: the total; the others keep their share (then overwritten)
    job.fisher = finish_sums(sums)
    broadcast_tensors(world, job.fisher)
    job.windows = None

    def commit() -> None:
        with timed(job.timings, "checkpoint"):
            job.work.save_fisher(job.fisher)

    world.step("committing the Fisher", lambda: commit() if world.is_main else None)


#: Stages a job without calibration (uniform sensitivity, RTN) skips.
_CALIBRATION_STAGES = ("calibrate", "sensitivity")
#: The stages after the fingerprint, in order (job.STAGES names them all).
STAGE_FUNCTIONS: tuple[tuple[str, Stage], ...] = (
    ("calibrate", calibrate_stage),
    ("load", load_stage),
    ("sensitivity", sensitivity_stage),
    ("plan", plan_stage),
    ("quantize", quantize_stage),
    ("tune", tune_stage),
    ("write", write_stage),
    ("seal", seal_stage),
    ("publish", publish_stage),
)
#: The stages of a run within ``--max-memory`` (streaming.py): the same names, one block at a time; a budget
#: plan (target_bpw) is refused in preflight, so there is no plan stage.
STREAMING_STAGE_FUNCTIONS: tuple[tuple[str, Stage], ...] = (
    ("calibrate", calibrate_stage),
    ("load", streaming.load_stage),
    ("sensitivity", streaming.sensitivity_stage),
    ("quantize", streaming.quantize_stage),
    ("tune", tune_stage),
    ("write", streaming.write_stage),
    ("seal", seal_stage),
    ("publish", publish_stage),
)


# -- failures


def _check_fingerprint(work: WorkArea, fingerprint: dict[str, Any]) -> None:
    """Write the fingerprint of a new job, or refuse to resume a work area made by a different one."""
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


def _committed(work: WorkArea) -> str:
    groups = work.committed_groups()
    parts = [f"{groups} layer group(s)"] if groups else []
    if work.has_fisher():
        parts.append("the Fisher information")
    if not parts:
        return "nothing was committed yet"
    return f"{' and '.join(parts)} committed in {work.root}"


def _interrupted(signum: int, work: WorkArea) -> Interrupted:
    name = signal.Signals(signum).name
    resumable = work.root.is_dir() and work.has_checkpoints()
    hint = (
        "rerun the same command (or add --resume) to continue from the last committed layer group"
        if resumable
        else "nothing was committed, so there is nothing to resume: rerun the same command to start again"
    )
    return Interrupted(
        f"interrupted by {name}; {_committed(work)}",
        hint=hint,
        signum=signum,
        work_dir=str(work.root),
        resumable=resumable,
    )


def _disk_full(work: WorkArea, estimate: SizeEstimate | None) -> ResourceError:
    size = f" (the artifact alone needs about {estimate.total_bytes / 1e9:.2f} GB)" if estimate else ""
    return ResourceError(
        f"no space left on the device while writing into {work.output}; {_committed(work)}",
        hint=f"free some disk space{size} and rerun the same command: it resumes from the last committed "
        "layer group; the source model was only read, never written",
    )


def _is_disk_full(exc: BaseException | None) -> bool:
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


__all__ = [
    "CompressResult",
    "FORMAT_VERSION",
    "StageProgress",
    "layer_groups",
    "needs_calibration",
    "quantize_module",
    "run_compress",
]
