"""The torchrun compress modes, derived from the one-process ones: the second axis of the 2 x 2 of modes.

A torchrun world runs the stages of the one-process pipeline of its memory mode (plain.py: the whole model;
bounded.py: ``--max-memory``) with two changes, made here and nowhere else:

- each stage is placed on the ranks that run it (:data:`PLACEMENT`, by stage name: every rank, rank 0 alone,
  or rank 0 first and then the others), each placement ending with a status exchange so a failing rank stops
  the others (squeeze.compression.distributed);
- the one override: the sensitivity stage is replaced by its world-wide form, written for the world (the
  calibration windows split across ranks, the float64 partial sums added in rank order so the fp32 Fisher has
  the bits one process computes): sensitivity.world_sensitivity_stage, bounded.bounded_world_sensitivity_stage.

The layer groups are dealt round robin inside the quantize stages themselves (distributed.owns_group), so
they need no override. A stage added to a one-process pipeline must be given a placement here, or importing
this module fails naming it.
"""

from __future__ import annotations

from collections.abc import Callable

from squeeze.compression.distributed import every_rank, main_first, main_rank
from squeeze.compression.job import Stage
from squeeze.compression.pipelines.bounded import BOUNDED, bounded_world_sensitivity_stage
from squeeze.compression.pipelines.plain import PLAIN
from squeeze.compression.pipelines.registry import NamedStage, Pipeline, register
from squeeze.compression.sensitivity import world_sensitivity_stage

#: Which ranks run each stage of a one-process pipeline (wrapper(stage, step name) -> the placed stage).
PLACEMENT: dict[str, Callable[[Stage, str], Stage]] = {
    "calibrate": every_rank,
    "load": every_rank,
    "plan": main_first,  # rank 0 commits the bits-per-weight plan, the others read it back
    "quantize": every_rank,  # each rank its own layer groups
    "tune": main_rank,  # every group committed, then rank 0 tunes block by block
    "distill": main_rank,  # the whole model end to end, on rank 0
    "write": main_rank,
    "seal": main_rank,
    "publish": main_rank,
}
#: The one stage a torchrun world replaces rather than places: it communicates inside itself.
OVERRIDDEN = "sensitivity"


def across_ranks(pipeline: Pipeline, name: str, sensitivity: Stage) -> Pipeline:
    """The torchrun mode ``name`` of the one-process ``pipeline``: its stages in order, each placed by
    :data:`PLACEMENT`, and ``sensitivity`` (written for the world) in place of its sensitivity stage."""
    stages: list[NamedStage] = []
    for stage_name, stage in pipeline.stages:
        if stage_name == OVERRIDDEN:
            stages.append((stage_name, sensitivity))
        elif stage_name in PLACEMENT:
            stages.append((stage_name, PLACEMENT[stage_name](stage, stage_name)))
        else:
            raise ValueError(
                f"stage {stage_name!r} of the {pipeline.name!r} compress mode has no placement on a torchrun world: "
                "add it to squeeze.compression.pipelines.torchrun.PLACEMENT"
            )
    if OVERRIDDEN not in pipeline.names:
        raise ValueError(f"the {pipeline.name!r} compress mode has no {OVERRIDDEN!r} stage to run world-wide")
    return Pipeline(name, tuple(stages))


DATA_PARALLEL = register(across_ranks(PLAIN, "data_parallel", world_sensitivity_stage))
BOUNDED_DATA_PARALLEL = register(across_ranks(BOUNDED, "bounded_data_parallel", bounded_world_sensitivity_stage))

__all__ = ["BOUNDED_DATA_PARALLEL", "DATA_PARALLEL", "OVERRIDDEN", "PLACEMENT", "across_ranks"]
