"""The bounded data-parallel compress mode: ``--max-memory`` under torchrun, every rank streaming.

Each rank builds the model on the meta device and reads one decoder block at a time from the source, as the
bounded mode does (bounded.py); the calibration windows are split across the ranks as in the data-parallel
mode: each rank runs the block-by-block Fisher pass over its own share (spilling into its own directory of
the work area), and after each group's backward the ranks' float64 sums are added in rank order
(squeeze.compression.distributed.sum_in_rank_order) before the one rounding to fp32, so rank 0 commits the
Fisher one process computes. The layer groups are then dealt round robin, each rank quantizing its own with
only that group resident; rank 0 writes, seals and publishes. The artifact is byte-identical to one process.

The budget is per rank: each rank holds one block, its share of the windows' activations and one window's
logits. The Fisher pass communicates once per group inside the pass; a rank that fails there exits, and
torchrun stops the others (committed groups stay in the work area: rerunning the command resumes).
"""

from __future__ import annotations

from squeeze.compression.assemble import seal_stage
from squeeze.compression.distributed import every_rank, main_rank, sum_in_rank_order, window_range
from squeeze.compression.job import CompressJob
from squeeze.compression.pipelines import bounded
from squeeze.compression.pipelines.registry import Pipeline, register
from squeeze.compression.publish import publish_stage
from squeeze.compression.sensitivity import calibrate_stage
from squeeze.compression.tuning_stage import tune_stage


def world_sensitivity_stage(job: CompressJob) -> None:
    """bounded.sensitivity_stage with the windows split across ranks and each group's sums combined in rank
    order; skipped on every rank when no rank sees a group left without its Fisher."""
    world = job.world
    if job.calibration is None:
        return
    _, flags = world.step("reading the Fisher", lambda: bounded.missing_fisher(job), lambda m: b"\x01" if m else b"")
    if any(flag[:1] == b"\x01" for flag in flags):  # every rank takes part: the pass exchanges sums per group
        job.windows = bounded.windows_of(job)
        bounded.fisher_pass(
            job,
            window_share=window_range(len(job.windows), world),
            spill_dir=job.work.activations / f"rank-{world.rank:05d}",
            combine=lambda sums: sum_in_rank_order(world, sums),
            commit=world.is_main,  # rank 0 holds the totals
        )
        world.step("committing the Fisher", lambda: None)  # no rank quantizes before rank 0 has committed
    job.windows = None


BOUNDED_DATA_PARALLEL = register(
    Pipeline(
        "bounded_data_parallel",
        (
            ("calibrate", every_rank(calibrate_stage)),
            ("load", every_rank(bounded.load_stage)),
            ("sensitivity", world_sensitivity_stage),  # windows split, each group's sums combined in the pass
            ("quantize", every_rank(bounded.quantize_stage)),  # each rank its own layer groups
            ("tune", main_rank(tune_stage)),  # every group committed, then rank 0 tunes block by block
            ("write", main_rank(bounded.write_stage)),
            ("seal", main_rank(seal_stage)),
            ("publish", main_rank(publish_stage)),
        ),
    )
)

__all__ = ["BOUNDED_DATA_PARALLEL", "world_sensitivity_stage"]
