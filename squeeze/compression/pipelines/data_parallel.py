"""The data-parallel compress mode (torchrun): the plain stages, each placed on the ranks that run it.

Every rank loads the model; the calibration windows are split across ranks for the Fisher (float64 partial
sums added in rank order, so the fp32 result has the bits one process gets); rank 0 commits a bits-per-weight
plan first and the others read it back; the layer groups are dealt round robin (quantize.py's ``owns_group``);
rank 0 writes, seals and publishes. See squeeze.compression.distributed for the world and its collectives.
"""

from __future__ import annotations

import torch

from squeeze.calibrate.fisher import finish_sums, fisher_sums, new_sums
from squeeze.calibrate.windows import calibration_windows
from squeeze.compression.assemble import seal_stage, write_stage
from squeeze.compression.bit_plan import plan_stage
from squeeze.compression.distributed import (
    broadcast_tensors,
    every_rank,
    main_first,
    main_rank,
    sum_in_rank_order,
    window_range,
)
from squeeze.compression.job import CompressJob, timed
from squeeze.compression.pipelines.plain import load_stage
from squeeze.compression.pipelines.registry import Pipeline, register
from squeeze.compression.publish import publish_stage
from squeeze.compression.quantize import quantize_stage
from squeeze.compression.sensitivity import calibrate_stage, fisher_modules
from squeeze.compression.tuning_stage import tune_stage
from squeeze.models.source import load_tokenizer


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


DATA_PARALLEL = register(
    Pipeline(
        "data_parallel",
        (
            ("calibrate", every_rank(calibrate_stage)),
            ("load", every_rank(load_stage)),
            ("sensitivity", world_sensitivity_stage),  # its windows split across ranks, the partial sums combined
            ("plan", main_first(plan_stage)),  # rank 0 commits the plan, the others read it back
            ("quantize", every_rank(quantize_stage)),  # each rank its own layer groups
            ("tune", main_rank(tune_stage)),  # every group committed, then rank 0 tunes block by block
            ("write", main_rank(write_stage)),
            ("seal", main_rank(seal_stage)),
            ("publish", main_rank(publish_stage)),
        ),
    )
)

__all__ = ["DATA_PARALLEL", "world_sensitivity_stage"]
