"""A compress run as one job: the context its named stages read and fill, and the result it returns.

The stages of a plain run, in order (each compress mode lists its own: squeeze.compression.pipelines):
``fingerprint`` (the work area belongs to this job, or is claimed for it), ``calibrate`` (token windows;
before the model loads, so a text too short fails fast), ``load``, ``sensitivity`` (Fisher information, or
its checkpoint), ``plan`` (each linear's width for a ``weights.target_bpw`` budget, or its checkpoint;
nothing without one), ``quantize`` (layer groups, each committed as a checkpoint), ``write`` (shards and
metadata assembled in the staging directory), ``seal`` (the manifest) and ``publish`` (the sealed artifact
moved into the output). Each stage's seconds are kept under its name in ``timings``; "checkpoint"
(checkpoint I/O) and "sparse" / "kmeans" / "rtn" (one weight's quantization) break parts of some stages
down and are included in those stages' seconds.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from squeeze.compression.bit_budget import Setting, plan_summary
from squeeze.compression.distributed import SINGLE, World
from squeeze.compression.signals import SignalGuard
from squeeze.compression.workarea import WorkArea
from squeeze.config import CalibrationSpec, Recipe
from squeeze.format.manifest import Manifest
from squeeze.format.quant_config import ModuleEntry
from squeeze.models.source import ModelSource
from squeeze.models.targets import Target
from squeeze.quant.schemes import WeightFormat, format_for_recipe

#: progress(stage, done, total). Every stage of the pipeline reports (name, 0, 0) as it starts (run_stages);
#: counted work then reports (name, done, total) with total > 0: "fisher", "generate", "plan", "quantize",
#: "tune", "distill".
StageProgress = Callable[[str, int, int], None]


def weight_format(recipe: Recipe) -> type[WeightFormat]:
    """The registered format ``recipe.weights`` selects (recipes are checked against the registry when built)."""
    fmt = format_for_recipe(recipe.weights)
    if fmt is None:
        raise ValueError(f"no registered weight format for method {recipe.weights.method!r}")
    return fmt


@dataclass(frozen=True)
class RecipeNeeds:
    """What a recipe's weight format asks of a compress run, worked out once (:meth:`of`) and kept on the job,
    so no stage re-derives it from the recipe.

    ``fisher``: k-means weighted by a sensitivity, stored and passed as "the Fisher" (the format uses it and
    ``weights.sensitivity`` is not "uniform"); ``activation``: that sensitivity is the activation one
    (squeeze.calibrate.activation: forward passes only) rather than the Fisher's backward; ``hessians``: error
    compensation (the format uses an input Hessian and the recipe turns ``weights.error_compensation`` on),
    whose Hessians come from the same calibration pass; ``calibration``: either of them, so the run reads
    calibration text.
    """

    format: type[WeightFormat]
    fisher: bool
    hessians: bool
    activation: bool = False

    @property
    def calibration(self) -> bool:
        return self.fisher or self.hessians

    @classmethod
    def of(cls, recipe: Recipe) -> RecipeNeeds:
        fmt = weight_format(recipe)
        weights = recipe.weights
        return cls(
            format=fmt,
            fisher=fmt.uses_fisher and weights.sensitivity != "uniform",
            hessians=fmt.uses_hessian and weights.error_compensation,
            activation=fmt.uses_fisher and weights.sensitivity == "activation",
        )


def needs_calibration(recipe: Recipe) -> bool:
    """Whether compressing with ``recipe`` needs calibration text (see :class:`RecipeNeeds`)."""
    return RecipeNeeds.of(recipe).calibration


@dataclass
class CompressResult:
    """What a compress run produced, and how long each stage took (seconds, by stage name)."""

    output: str
    model: str
    recipe: str
    bits_per_weight: float
    seconds: float
    timings: dict[str, float] = field(default_factory=dict)
    quantized_modules: int = 0
    quantized_weights: int = 0
    artifact_bytes: int = 0
    original_bytes: int = 0  # the loaded model's tensors (fp32), tied weights once
    root_digest: str = ""
    #: a weights.target_bpw run: the share of the quantized linears' weights at each setting ({"w4": 0.3, ...})
    plan: dict[str, float] | None = None
    source_bytes: int = 0  # the model's tensors in the source checkpoint's dtype (float16 for GGUF), tied once
    #: --max-memory: the budget and preflight's estimate of the bounded run's peak resident bytes (0: unbounded)
    max_memory: int = 0
    peak_estimate_bytes: int = 0
    expert_group: int = 0  # routed experts resident at once in a bounded run of a MoE model (0: whole blocks)
    #: --device: where the blocks were computed ("cuda:0", "cpu"); "" for the host run without a device
    device: str = ""
    #: a MoE model: the (layer, expert) pairs quantized, and those the calibration never routed to (zero
    #: Fisher; quantized with uniform weights); both 0 for a dense model, unrouted 0 without calibration
    experts: int = 0
    unrouted_experts: int = 0
    #: weights.lnq_rounds: per linear, the refit's objective on the held-out and the fitted windows, before and
    #: after (held_out_after <= held_out_before), and the share of rows whose LUT changed
    lnq_layers: dict[str, dict[str, float]] = field(default_factory=dict)
    #: weights.distill: its status ("distilled", "unchanged", "refused"), the held-out KL (nats a token) at the
    #: start and at the kept state, the steps run and the windows it trained on
    distill: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "output": self.output,
            "model": self.model,
            "recipe": self.recipe,
            "bits_per_weight": self.bits_per_weight,
            "seconds": round(self.seconds, 3),
            "timings": {k: round(v, 3) for k, v in self.timings.items()},
            "quantized_modules": self.quantized_modules,
            "quantized_weights": self.quantized_weights,
            "artifact_bytes": self.artifact_bytes,
            "original_bytes": self.original_bytes,
            "source_bytes": self.source_bytes,
            "root_digest": self.root_digest,
            **({"plan": self.plan} if self.plan is not None else {}),
            **(
                {"max_memory": self.max_memory, "peak_estimate_bytes": self.peak_estimate_bytes}
                | ({"expert_group": self.expert_group} if self.expert_group else {})
                if self.max_memory
                else {}
            ),
            **({"device": self.device} if self.device else {}),
            **({"experts": self.experts, "unrouted_experts": self.unrouted_experts} if self.experts else {}),
            **({"lnq_layers": self.lnq_layers} if self.lnq_layers else {}),
            **({"distill": self.distill} if self.distill else {}),
        }


@dataclass
class CompressJob:
    """Everything one compress run reads and produces, passed from stage to stage.

    The first block is set before the stages run; the rest is filled by the stage named beside it.
    """

    source: ModelSource
    recipe: Recipe
    calibration: CalibrationSpec | None  # None: no Fisher (uniform sensitivity or RTN)
    work: WorkArea
    target_names: tuple[str, ...]  # the linears to quantize, found once on the meta model in preflight
    #: the embeddings to quantize (``weights.embedding_bits``): the input embedding, an untied LM head; found in
    #: preflight, none when the recipe keeps them
    embedding_names: tuple[str, ...] = ()
    seed: int = 0
    overwrite: bool = False
    restart: bool = False
    progress: StageProgress | None = None
    #: ``--max-memory``: the peak resident bytes the run must stay under (streaming block by block); None: unbounded
    max_memory: int | None = None
    #: preflight (--max-memory): the estimated peak resident bytes of the bounded run
    peak_estimate: int = 0
    #: preflight (--max-memory): routed experts of a MoE block resident at once (squeeze.compression.expert_plan;
    #: the same bits whatever it is); None: every block whole
    expert_group: int | None = None
    #: ``--device``: the device each block is moved to for its Fisher and its quantization (the model stays on
    #: the host, or is read lazily); None: everything on the host, as before. Checked in preflight.check_device.
    device: torch.device | None = None
    #: this process's rank under torchrun (distributed.py); one process: rank 0 of 1
    world: World = SINGLE
    #: what the recipe's format needs (Fisher, Hessians, calibration): from ``recipe`` when the job is built
    needs: RecipeNeeds = field(init=False)
    guard: SignalGuard = field(default_factory=SignalGuard)
    started: float = field(default_factory=time.perf_counter)
    timings: dict[str, float] = field(default_factory=dict)

    digest: str = ""  # fingerprint: the source model files' digest
    fingerprint: dict[str, Any] = field(default_factory=dict)  # fingerprint
    windows: torch.Tensor | None = None  # calibrate: (n, T) token ids; dropped after sensitivity
    model: nn.Module | None = None  # load: fp32 weights (--max-memory: on the meta device, see ``lazy``)
    #: load (--max-memory): the squeeze.models.lazy.LazyModel that reads ``model``'s weights one block at a time
    lazy: Any = None
    tokenizer: Any = None  # load
    #: load: target_names -> the linears and expert parameters (squeeze.models.expert_params) of ``model``
    targets: dict[str, Target] = field(default_factory=dict)
    #: load: embedding_names -> modules of ``model`` (the nn.Embedding; an untied LM head's nn.Linear)
    embeddings: dict[str, nn.Linear | nn.Embedding] = field(default_factory=dict)
    fisher: dict[str, torch.Tensor] = field(default_factory=dict)  # sensitivity: name -> (out, in) fp32
    hessians: dict[str, torch.Tensor] = field(default_factory=dict)  # sensitivity (EC): name -> (in, in) fp32
    # sensitivity, with weights.lnq_rounds: the held-out windows' Hessians, name -> (in, in) fp32
    held_out_hessians: dict[str, torch.Tensor] = field(default_factory=dict)
    bit_plan: dict[str, Setting] = field(default_factory=dict)  # plan (weights.target_bpw): name -> its setting
    groups: list[list[str]] = field(default_factory=list)  # quantize: target names by decoder block
    #: tune (weights.tuning): artifact tensor name -> the tuned tensor replacing the quantized (or kept) one
    tuned: dict[str, torch.Tensor] = field(default_factory=dict)
    #: write (from the group checkpoints): experts the calibration never reached ({experts module: [expert ids]})
    #: and the (layer, expert) pairs quantized
    unrouted: dict[str, list[int]] = field(default_factory=dict)
    n_experts: int = 0
    modules: dict[str, ModuleEntry] = field(default_factory=dict)  # write: quantization_config.modules
    n_weights: int = 0  # write: quantized weights
    storage_bits: int = 0  # write: bits they take in the artifact
    #: write, weights.lnq_rounds: each linear's held-out / fitted objective before and after the refit
    lnq: dict[str, dict[str, float]] = field(default_factory=dict)
    #: distill (weights.distill): the stage's record (CompressResult.distill)
    distill: dict[str, Any] = field(default_factory=dict)
    original_bytes: int = 0  # write
    source_bytes: int = 0  # write
    manifest: Manifest | None = None  # seal
    summary: dict[str, Any] = field(default_factory=dict)  # seal (or the publishing record): CompressResult fields

    def __post_init__(self) -> None:
        self.needs = RecipeNeeds.of(self.recipe)

    def loaded_model(self) -> nn.Module:
        if self.model is None:
            raise ValueError("the load stage has not run")
        return self.model

    def result(self) -> CompressResult:
        plan = None
        if self.bit_plan and self.targets:  # a budget recipe: the share of the weights at each setting
            plan = plan_summary(self.bit_plan, {name: m.weight.numel() for name, m in self.targets.items()})
        seconds = time.perf_counter() - self.started
        return CompressResult(
            **self.summary,
            seconds=seconds,
            timings=self.timings,
            plan=plan,
            max_memory=self.max_memory or 0,
            peak_estimate_bytes=self.peak_estimate,
            expert_group=self.expert_group or 0,
            device=str(self.device) if self.device is not None else "",
            lnq_layers=self.lnq,
            distill=self.distill,
        )


@contextlib.contextmanager
def timed(timings: dict[str, float], name: str) -> Iterator[None]:
    """Add the block's wall seconds to ``timings[name]`` (also when it raises)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - start


Stage = Callable[[CompressJob], None]


def run_stages(job: CompressJob, stages: tuple[tuple[str, Stage], ...]) -> None:
    """Run ``stages`` in order, each timed under its name and announced to ``job.progress`` as (name, 0, 0)."""
    for name, stage in stages:
        if job.progress:
            job.progress(name, 0, 0)
        with timed(job.timings, name):
            stage(job)


__all__ = [
    "CompressJob",
    "CompressResult",
    "RecipeNeeds",
    "Stage",
    "StageProgress",
    "needs_calibration",
    "run_stages",
    "timed",
    "weight_format",
]
