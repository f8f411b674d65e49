"""Compress modes as registered pipelines: which stages a run executes, in what order, on which ranks.

A **stage** is a function ``stage(job: CompressJob) -> None`` (job.py's ``Stage``): it reads what earlier
stages put on the job and fills its own fields (job.py says which stage fills which). It reads what the
recipe needs from ``job.needs`` (a :class:`~squeeze.compression.job.RecipeNeeds`: the weight format, Fisher,
Hessians, calibration), never from the recipe's method string; it commits its results to the work area
(``job.work``) so a rerun resumes, and it adds sub-timings with ``timed(job.timings, part)``. A stage of the
data-parallel mode must not communicate itself unless it is written for the world: wrap a plain stage in
``every_rank`` / ``main_rank`` / ``main_first`` (squeeze.compression.distributed), which end it with a
status exchange so a failing rank stops the others.

A **pipeline** (:class:`Pipeline`) is one mode: a name and its named stages, which every run executes after
the ``fingerprint`` stage; each stage's seconds are kept under its name in ``CompressResult.timings``. The
modes, one module each, registered at import:

- ``plain`` (plain.py): one process, the whole model loaded;
- ``bounded`` (bounded.py): ``--max-memory``, one decoder block resident at a time, byte-identical to plain;
- ``data_parallel`` (data_parallel.py): a torchrun world, windows and layer groups split across ranks;
- ``bounded_data_parallel`` (bounded_parallel.py): both, every rank streaming block by block.

:func:`mode_of` chooses the mode from the job (its one place), :func:`pipeline_for` returns its pipeline.

To add a stage: write ``stage(job)`` in the module of its concern, and list it, under a new name, in each
mode that runs it (placed with a wrapper in data_parallel.py). To add a mode: a module here that calls
``register(Pipeline(name, stages))``, imported below, and a case in :func:`mode_of`.
"""

from __future__ import annotations

from squeeze.compression.pipelines import bounded, bounded_parallel, data_parallel, plain
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
    "bounded_parallel",
    "data_parallel",
    "mode_of",
    "pipeline_for",
    "plain",
    "register",
    "registered",
]
