"""The stages that read calibration text: ``calibrate`` (token windows) and ``sensitivity`` (the Fisher
information of every target weight, or the activation weights of ``weights.sensitivity: activation``, and with
error compensation the input Hessians, from one pass).

Both run in the plain pipeline (pipelines/plain.py); under torchrun (pipelines/torchrun.py) ``calibrate`` runs on
every rank and :func:`world_sensitivity_stage` takes the sensitivity stage's place (the windows split across
ranks, the partial sums added in rank order). A bounded run has its own block-by-block sensitivity stages
(pipelines/bounded.py). What the recipe needs is read from ``job.needs`` (job.py), never from the recipe.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from squeeze.calibrate.activation import activation_sensitivity, blockwise_activation_sensitivity
from squeeze.calibrate.blockwise import blockwise_fisher
from squeeze.calibrate.expert_streaming import ExpertStreaming
from squeeze.calibrate.fisher import finish_sums, fisher_information, fisher_sums, new_sums
from squeeze.calibrate.generated import sample_windows_from_model, start_token
from squeeze.calibrate.hessian import input_hessians
from squeeze.calibrate.windows import calibration_windows
from squeeze.compression.distributed import broadcast_tensors, sum_in_rank_order, window_range
from squeeze.compression.job import CompressJob, timed
from squeeze.errors import CalibrationError
from squeeze.models.modes import eval_mode, input_device
from squeeze.models.source import load_tokenizer
from squeeze.models.targets import linear_targets


def calibrate_stage(job: CompressJob) -> None:
    """Token windows (n, T) of the calibration text, unless the Fisher is already committed; before the
    model loads, so a text too short fails fast."""
    calibration = job.calibration
    if calibration is not None and not job.work.has_fisher():
        tokenizer = load_tokenizer(job.source)
        held = _held_out_windows(job)
        if held and calibration.num_samples <= held:
            raise CalibrationError(
                f"weights.lnq_rounds holds out the last {held} calibration windows (weights.lnq_held_out), and the "
                f"calibration has {calibration.num_samples}: none would be left to fit",
                hint=f"use --num-samples {4 * held} or more, or a smaller weights.lnq_held_out",
            )
        job.windows = calibration_windows(calibration, tokenizer)
        if job.recipe.weights.generated_samples and job.needs.hessians:
            start_token(tokenizer)  # a tokenizer with nothing to start a sample from fails before the model loads


def sensitivity_stage(job: CompressJob) -> None:
    """The Fisher information of every target weight: read back from its checkpoint, or computed and committed."""
    calibration = job.calibration
    if calibration is None:
        return
    ec = job.needs.hessians
    with timed(job.timings, "checkpoint"):
        loaded = job.work.load_fisher([*job.targets, *job.embeddings])
        names = list(linear_targets(job.targets))
        hessians = job.work.load_hessians(names) if ec and loaded is not None else None
        held = _held_out_windows(job)
        held_out = job.work.load_hessians(names, held_out=True) if held and hessians is not None else None
    if loaded is not None and (hessians is not None or not ec) and (held_out is not None or not held):
        job.fisher = loaded
        job.hessians = hessians or {}
        job.held_out_hessians = held_out or {}
    else:
        if job.windows is None:  # the saved Fisher (or Hessians) was unreadable
            job.windows = calibration_windows(calibration, load_tokenizer(job.source))
        progress = job.progress
        report = (lambda done, total: progress("fisher", done, total)) if progress else None
        # the input Hessians (error compensation) accumulate by forward hooks during the Fisher pass itself
        # (expert parameters have no input of their own: no Hessian, they are quantized without compensation)
        # weights.lnq_rounds: the last windows are held out, seen by neither the Fisher nor the fitted Hessians
        fitted = job.windows[:-held] if held else job.windows
        with input_hessians(linear_targets(job.targets) if ec else {}) as accumulated:
            job.fisher = _fisher(job, fitted, report)  # the embeddings' gradients too, when quantized
            if _samples_for_hessians(job):
                _sample_for_hessians(job, calibration.seq_len)  # the same hooks add the sampled tokens' inputs
        job.hessians = accumulated.result() if ec else {}
        if held:
            with timed(job.timings, "held_out"), input_hessians(linear_targets(job.targets)) as held_acc:
                _forward(job.loaded_model(), job.windows[-held:])
            job.held_out_hessians = held_acc.result()
        with timed(job.timings, "checkpoint"):
            if held:
                job.work.save_hessians(job.held_out_hessians, held_out=True)
            if ec:  # first: a committed Fisher without its Hessians is recomputed, never half trusted
                job.work.save_hessians(job.hessians)
            job.work.save_fisher(job.fisher)
    job.windows = None


def world_sensitivity_stage(job: CompressJob) -> None:
    """The sensitivity stage under torchrun: each rank sums the squared gradients of its contiguous share of the
    windows (float64), rank 0 adds the shares in rank order, rounds once to fp32 and commits the Fisher; every
    rank gets it (the bits one process computes). Error compensation is refused before (check_world_options)."""
    world = job.world
    if job.calibration is None:
        return
    modules = fisher_modules(job)

    def read() -> dict[str, torch.Tensor] | None:
        with timed(job.timings, "checkpoint"):
            return job.work.load_fisher(list(modules))

    loaded, flags = world.step("reading the Fisher", read, lambda f: b"\x01" if f is not None else b"")
    if loaded is not None and all(flag[:1] == b"\x01" for flag in flags):
        job.fisher, job.windows = loaded, None
        return
    sums, _ = world.step("the Fisher", lambda: _partial_sums(job))
    sum_in_rank_order(world, sums)  # rank 0: the total; the others keep their share (then overwritten)
    job.fisher = finish_sums(sums)
    broadcast_tensors(world, job.fisher)
    job.windows = None

    def commit() -> None:
        with timed(job.timings, "checkpoint"):
            job.work.save_fisher(job.fisher)

    world.step("committing the Fisher", lambda: commit() if world.is_main else None)


def _partial_sums(job: CompressJob) -> dict[str, torch.Tensor]:
    """This rank's float64 sums of squared gradients over its share of the windows (zeros for no share)."""
    calibration = job.calibration
    assert calibration is not None  # world_sensitivity_stage returns first without one
    modules = fisher_modules(job)
    windows = job.windows if job.windows is not None else calibration_windows(calibration, load_tokenizer(job.source))
    start, stop = window_range(len(windows), job.world)
    if start == stop:  # more ranks than windows: this rank adds nothing
        return new_sums({name: module.weight for name, module in modules.items()})
    progress = job.progress
    report = (lambda done, total: progress("fisher", done, total)) if progress else None
    return fisher_sums(job.loaded_model(), windows[start:stop], modules, progress=report)


def _fisher(job: CompressJob, windows: torch.Tensor, report: Any) -> dict[str, torch.Tensor]:
    """The Fisher of every target and quantized embedding (or, with ``weights.sensitivity: activation``, the
    activation weights that stand in for it: squeeze.calibrate.activation): on the whole model at once on the
    host, or with ``--device`` block by block on the device (the same windows, each block moved there and back)."""
    # --device cuda: a MoE block's routed experts a group at a time when the whole block would not fit the device
    # (preflight chose job.expert_group; views of the resident parameters, the same bits)
    experts = ExpertStreaming(job.expert_group) if job.expert_group is not None else None
    if job.needs.activation:
        if job.device is None:
            return activation_sensitivity(job.loaded_model(), windows, job.targets, job.embeddings, progress=report)
        return blockwise_activation_sensitivity(
            job.loaded_model(),
            windows,
            job.targets,
            job.embeddings,
            progress=report,
            device=job.device,
            experts=experts,
        )
    if job.device is None:
        return fisher_information(job.loaded_model(), windows, fisher_modules(job), progress=report)
    modules = fisher_modules(job)
    return blockwise_fisher(job.loaded_model(), windows, modules, progress=report, device=job.device, experts=experts)


def fisher_modules(job: CompressJob) -> dict[str, nn.Linear | nn.Embedding]:
    """Every weight whose Fisher is accumulated: targets and embeddings. An ExpertWeight exposes its 3-D
    parameter as ``.weight``, all fisher_information reads, so its Fisher comes shaped like the parameter."""
    modules: dict[str, Any] = {**job.targets, **job.embeddings}
    return modules


def _held_out_windows(job: CompressJob) -> int:
    """Calibration windows held out for weights.lnq_rounds (0 without it or without error compensation)."""
    weights = job.recipe.weights
    return weights.lnq_held_out if weights.lnq_rounds and job.needs.hessians else 0


def _forward(model: nn.Module, windows: torch.Tensor) -> None:
    """Run ``model`` on each window (int64 (n, T)) without gradients, for the hooks of the caller's context."""
    device = input_device(model)
    with torch.no_grad(), eval_mode(model):
        for window in windows:
            model(window[None, :].to(device))


def _samples_for_hessians(job: CompressJob) -> bool:
    """Whether the model samples text for the Hessians: weights.generated_samples with error compensation and
    at least one linear to compensate (expert parameters have no Hessian)."""
    return bool(job.recipe.weights.generated_samples and job.needs.hessians and linear_targets(job.targets))


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


__all__ = ["calibrate_stage", "fisher_modules", "sensitivity_stage", "world_sensitivity_stage"]
