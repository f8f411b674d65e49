"""The registry of compress modes: each a :class:`Pipeline` (a name and its named stages), registered once
by its own module, and the one place that chooses a mode from the job (:func:`mode_of`)."""

from __future__ import annotations

from dataclasses import dataclass

from squeeze.compression.job import CompressJob, Stage

#: A stage as a pipeline lists it: its name (the key of its seconds in ``CompressResult.timings``) and function.
NamedStage = tuple[str, Stage]

#: Stages that only read calibration text or its products: skipped by a job without calibration (uniform
#: sensitivity, RTN), in every mode.
CALIBRATION_STAGES = frozenset({"calibrate", "sensitivity"})


@dataclass(frozen=True)
class Pipeline:
    """One compress mode: the stages it runs, in order, after the fingerprint (which every mode runs first)."""

    name: str
    stages: tuple[NamedStage, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.stages)

    def for_job(self, job: CompressJob) -> tuple[NamedStage, ...]:
        """The stages ``job`` runs: all of them, less the calibration stages when it has no calibration."""
        return tuple((n, s) for n, s in self.stages if job.calibration is not None or n not in CALIBRATION_STAGES)


_PIPELINES: dict[str, Pipeline] = {}


def register(pipeline: Pipeline) -> Pipeline:
    """Add ``pipeline`` under its name (a module calls this once, at import); a name is registered once."""
    if pipeline.name in _PIPELINES:
        raise ValueError(f"a compress pipeline named {pipeline.name!r} is already registered")
    _PIPELINES[pipeline.name] = pipeline
    return pipeline


def registered() -> tuple[str, ...]:
    """The names of the registered pipelines, in registration order."""
    return tuple(_PIPELINES)


def mode_of(job: CompressJob) -> str:
    """The compress mode ``job`` asks for: "bounded" (``--max-memory``: one block resident at a time),
    "data_parallel" (a torchrun world: windows and layer groups split across ranks), both at once
    ("bounded_data_parallel"), or "plain"."""
    if job.max_memory is not None:
        return "bounded_data_parallel" if job.world.active else "bounded"
    if job.world.active:
        return "data_parallel"
    return "plain"


def pipeline_for(job: CompressJob) -> Pipeline:
    """The registered pipeline of ``job``'s mode."""
    mode = mode_of(job)
    if mode not in _PIPELINES:  # pragma: no cover - pipelines/__init__.py imports every mode's module
        raise ValueError(f"no compress pipeline registered for mode {mode!r}; registered: {registered()}")
    return _PIPELINES[mode]


__all__ = ["CALIBRATION_STAGES", "NamedStage", "Pipeline", "mode_of", "pipeline_for", "register", "registered"]
