"""Compress modes as registered pipelines: which stages a run executes, in what order, on which ranks.

A **stage** is a function ``stage(job: CompressJob) -> None`` (job.py's ``Stage``): it reads what earlier
stages put on the job and fills its own fields (job.py says which stage fills which). It reads what the
recipe needs from ``job.needs`` (a :class:`~squeeze.compression.job.RecipeNeeds`: the weight format, Fisher,
Hessians, calibration), never from the recipe's method string; it commits its results to the work area
(``job.work``) so a rerun resumes, and it adds sub-timings with ``timed(job.timings, part)``. A stage does not
communicate: under torchrun it is placed on its ranks by a wrapper that ends it with a status exchange
(torchrun.py), except the sensitivity stage, which has a world-wide form written for the world.

A **pipeline** (:class:`Pipeline`) is one mode: a name and its named stages, which every run executes after
the ``fingerprint`` stage; each stage's seconds are kept under its name in ``CompressResult.timings``. The
modes are a 2 x 2 product, registered at import:

- memory: ``plain`` (plain.py: one process, the whole model loaded) or ``bounded`` (bounded.py:
  ``--max-memory``, one decoder block resident at a time, byte-identical to plain; its own stages are named
  ``bounded_*``);
- processes: one, or a torchrun world (torchrun.py): ``data_parallel`` and ``bounded_data_parallel`` are
  derived from the two one-process pipelines, each stage placed on its ranks, with one override (the
  world-wide sensitivity stage: windows split across ranks, the partial sums added in rank order).

:func:`mode_of` chooses the mode from the job (its one place), :func:`pipeline_for` returns its pipeline.

To add a stage: write ``stage(job)`` in the module of its concern, list it under a new name in plain.py (and in
bounded.py, with a ``bounded_`` form if it needs the whole model), and give that name a placement in
torchrun.PLACEMENT. To add a mode: a module here that calls ``register(Pipeline(name, stages))``, imported
below, and a case in :func:`mode_of`.
"""

from __future__ import annotations

from squeeze.compression.pipelines import bounded, plain, torchrun
from squeeze.compression.pipelines.registry import (
    CALIBRATION_STAGES,
    NamedStage,
    Pipeline,
    mode_of,
    pipeline_for,
    register,
    registered,
)

#: Every stage a plain run executes, in order (the fingerprint first, in every mode).
STAGES: tuple[str, ...] = ("fingerprint", *plain.PLAIN.names)

__all__ = [
    "CALIBRATION_STAGES",
    "NamedStage",
    "Pipeline",
    "STAGES",
    "bounded",
    "mode_of",
    "pipeline_for",
    "plain",
    "register",
    "registered",
    "torchrun",
]
