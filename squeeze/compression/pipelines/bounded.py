"""The bounded compress mode (``--max-memory``): one decoder block resident at a time.

Its stages are the plain mode's (plain.py) where those hold no whole model (calibrate, tune, seal, publish) and
its own, named ``bounded_*``, where the plain ones would (load, sensitivity, quantize, write); under torchrun
(torchrun.py) :func:`bounded_world_sensitivity_stage` takes the sensitivity stage's place.

The model is built on the meta device and each block's weights are read from the source safetensors only
while that block is in use (squeeze.models.lazy); the Fisher is computed block by block from the end
backwards (squeeze.calibrate.blockwise) and committed per layer group; the quantize stage reads each group's
weights and Fisher back, and the write stage takes every unquantized tensor straight from the source. Each
number is computed by the same code as in the plain run, so the artifact is byte-identical to it. What a
bounded run refuses and the peak it reaches are checked in preflight (squeeze.compression.bounded_preflight); a
bits-per-weight plan is refused there, so this mode has no plan stage.
"""

from __future__ import annotations

import functools
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from squeeze.calibrate.activation import blockwise_activation_sensitivity
from squeeze.calibrate.block_walk import Combine
from squeeze.calibrate.blockwise import blockwise_fisher
from squeeze.calibrate.expert_streaming import ExpertStreaming
from squeeze.calibrate.windows import calibration_windows
from squeeze.compression import quantize
from squeeze.compression.assemble import artifact_tensors, seal_stage, tensor_reader, write_artifact
from squeeze.compression.distributed import owns_group, sum_in_rank_order, window_range
from squeeze.compression.embeddings import embedding_targets
from squeeze.compression.expert_plan import rows_independent
from squeeze.compression.job import CompressJob, timed
from squeeze.compression.pipelines.registry import Pipeline, register
from squeeze.compression.publish import publish_stage
from squeeze.compression.sensitivity import calibrate_stage
from squeeze.compression.tuning_stage import tune_stage
from squeeze.errors import ResumeError
from squeeze.models.expert_params import ExpertWeight
from squeeze.models.lazy import LazyModel
from squeeze.models.source import load_tokenizer
from squeeze.models.targets import target_at
from squeeze.models.weight_dtype import keep_dtype, source_dtype


def bounded_load_stage(job: CompressJob) -> None:
    """The model on the meta device (weights stay in the source), its tokenizer, targets and embeddings."""
    lazy = LazyModel(job.source)
    job.lazy, job.model = lazy, lazy.model
    job.tokenizer = load_tokenizer(job.source)
    job.targets = {name: target_at(lazy.model, name) for name in job.target_names}
    job.embeddings = embedding_targets(lazy.model, job.embedding_names)
    job.groups = quantize.layer_groups(lazy.model, {**job.targets, **job.embeddings})


def bounded_sensitivity_stage(job: CompressJob) -> None:
    """The Fisher of every group not yet quantized, block by block, each group committed as it is done;
    skipped when every such group's Fisher (or quantized checkpoint) is already in the work area."""
    if job.calibration is None:
        return
    if missing_fisher(job):
        fisher_pass(job, window_share=(0, None), spill_dir=job.work.activations)
    job.windows = None


def bounded_world_sensitivity_stage(job: CompressJob) -> None:
    """The bounded sensitivity stage under torchrun: the windows split across ranks, each group's float64 sums
    added in rank order inside the pass (rank 0 commits the totals); skipped on every rank when no rank sees a
    group left without its Fisher."""
    world = job.world
    if job.calibration is None:
        return
    _, flags = world.step("reading the Fisher", lambda: missing_fisher(job), lambda m: b"\x01" if m else b"")
    if any(flag[:1] == b"\x01" for flag in flags):  # every rank takes part: the pass exchanges sums per group
        job.windows = windows_of(job)
        fisher_pass(
            job,
            window_share=window_range(len(job.windows), world),
            spill_dir=job.work.activations / f"rank-{world.rank:05d}",
            combine=lambda sums: sum_in_rank_order(world, sums),
            commit=world.is_main,  # rank 0 holds the totals
        )
        world.step("committing the Fisher", lambda: None)  # no rank quantizes before rank 0 has committed
    job.windows = None


def missing_fisher(job: CompressJob) -> bool:
    """Whether a group neither quantized nor with a committed Fisher is left (then the Fisher pass runs)."""
    with timed(job.timings, "checkpoint"):
        return any(
            not job.work.has_group(index, names) and not job.work.has_fisher_group(index, names)
            for index, names in enumerate(job.groups)
        )


def windows_of(job: CompressJob) -> torch.Tensor:
    """The calibration windows (n, T): the calibrate stage's, or tokenized again (it skips them when a Fisher
    checkpoint exists, which may since have proved unreadable)."""
    calibration = job.calibration
    assert calibration is not None  # the stages return first without one
    return job.windows if job.windows is not None else calibration_windows(calibration, load_tokenizer(job.source))


def fisher_pass(
    job: CompressJob,
    *,
    window_share: tuple[int, int | None],
    spill_dir: Path,
    combine: Combine | None = None,
    commit: bool = True,
) -> None:
    """blockwise_fisher (or, for ``weights.sensitivity: activation``, its forward-only counterpart
    squeeze.calibrate.activation) over the calibration windows ``[start:stop)`` of ``window_share``, spilling into
    ``spill_dir`` (removed after); each group's Fisher committed as it is done when ``commit`` (a torchrun
    rank other than 0 only adds its share: ``combine``, see squeeze.calibrate.blockwise)."""
    windows = windows_of(job)
    start, stop = window_share
    on_group, pending = _group_committer(job, commit)
    progress = job.progress
    report = (lambda done, total: progress("fisher", done, total)) if progress else None
    lazy: LazyModel = job.lazy
    try:
        # linears, embeddings and expert parameters (an ExpertWeight's ``.weight`` is its 3-D parameter)
        streaming = expert_streaming(job)
        if job.needs.activation:  # forwards only, block by block: squeeze.calibrate.activation
            blockwise_activation_sensitivity(
                lazy.model,
                windows[start:stop],
                job.targets,
                job.embeddings,
                materialized=lazy.materialized,
                spill_dir=spill_dir,
                on_group=on_group,
                progress=report,
                device=job.device,
                experts=streaming,
            )
        else:
            modules: dict[str, Any] = {**job.targets, **job.embeddings}
            blockwise_fisher(
                lazy.model,
                windows[start:stop],
                modules,
                materialized=lazy.materialized,
                spill_dir=spill_dir,
                on_group=on_group,
                progress=report,
                combine=combine,
                device=job.device,  # --device: each block moved there for its recomputation and backward
                experts=streaming,  # a MoE block's routed experts a group at a time (the same bits)
            )
    finally:
        shutil.rmtree(spill_dir, ignore_errors=True)
    if pending:  # pragma: no cover - every group's targets are in one block (or are one embedding)
        raise ValueError(f"the Fisher of group(s) {sorted(pending)} came back incomplete")


def _group_committer(
    job: CompressJob, commit: bool
) -> tuple[Callable[[dict[str, torch.Tensor]], None], dict[int, dict[str, torch.Tensor]]]:
    """(on_group, pending): ``on_group`` gathers the Fisher parts a blockwise pass hands back into their layer
    groups and commits each group once complete (when ``commit``); ``pending`` holds the incomplete ones."""
    group_of = {name: index for index, names in enumerate(job.groups) for name in names}
    pending: dict[int, dict[str, torch.Tensor]] = {}

    def on_group(part: dict[str, torch.Tensor]) -> None:
        for name, tensor in part.items():
            pending.setdefault(group_of[name], {})[name] = tensor
        for index in [i for i, got in pending.items() if len(got) == len(job.groups[i])]:
            group = pending.pop(index)
            if commit:
                with timed(job.timings, "checkpoint"):
                    job.work.save_fisher_group(index, group)

    return on_group, pending


def bounded_quantize_stage(job: CompressJob) -> None:
    """Each group without a committed checkpoint: its weights read from the source, its Fisher from the work
    area, quantized by quantize.py's own group function and committed."""
    lazy: LazyModel = job.lazy
    done = 0
    for index, names in enumerate(job.groups):
        if not owns_group(index, job.world):  # under torchrun another rank quantizes it (distributed.py)
            continue
        with timed(job.timings, "checkpoint"):
            committed = job.work.has_group(index, names)
        if not committed:
            job.fisher = _group_fisher(job, index, names) if job.calibration is not None else {}
            streaming = expert_streaming(job)
            grouped = [name for name in names if _in_groups(job.targets.get(name), streaming, job)]
            modules = [
                _module(job.targets[name] if name in job.targets else job.embeddings[name])
                for name in names
                if name not in grouped
            ]
            with lazy.materialized(*modules):
                grouping = (streaming,) if streaming is not None else ()  # a dense model: the plain call
                tensors, meta = quantize.quantize_group(job, names, *grouping)
            with timed(job.timings, "checkpoint"):
                job.work.save_group(index, tensors, meta)
            del tensors
        done += len(names)
        if job.progress:
            job.progress("quantize", done, len(job.targets))
    job.fisher = {}


def expert_streaming(job: CompressJob) -> ExpertStreaming | None:
    """The job's expert groups (preflight chose their size from the budget), each read by LazyModel.experts_slice."""
    if job.expert_group is None:
        return None
    lazy: LazyModel = job.lazy
    return ExpertStreaming(job.expert_group, lazy.experts_slice)


def _in_groups(target: Any, streaming: ExpertStreaming | None, job: CompressJob) -> bool:
    """Whether quantize_group reads this target a group of experts at a time (then it is not materialized whole)."""
    return streaming is not None and isinstance(target, ExpertWeight) and rows_independent(job.recipe)


def _module(target: Any) -> nn.Module:
    """The module whose parameters hold ``target``'s weight: itself, or an expert parameter's experts module
    (materialized whole: its gpt-oss biases come with it)."""
    return target.module if isinstance(target, ExpertWeight) else target


def _group_fisher(job: CompressJob, index: int, names: list[str]) -> dict[str, torch.Tensor]:
    with timed(job.timings, "checkpoint"):
        fisher = job.work.load_fisher_group(index, names)
    if fisher is None:  # removed or corrupted since the sensitivity stage: that stage must run again
        raise ResumeError(
            f"the Fisher checkpoint of layer group {index} in {job.work.root} is missing or unreadable",
            hint="rerun the same command: the Fisher of the groups not yet quantized is computed again",
        )
    return fisher


def bounded_write_stage(job: CompressJob) -> None:
    """The artifact as the unbounded write stage builds it, with every unquantized tensor read from the source."""
    staging = job.work.staging
    if staging.exists():
        shutil.rmtree(staging)
    lazy: LazyModel = job.lazy
    kept = keep_dtype(job.source, job.recipe.output.keep_dtype)
    state = lazy.state()
    job.original_bytes = sum(_state_numel(lazy, name, buf) * _itemsize(lazy, name, buf) for name, buf in state)
    source = source_dtype(job.source)
    job.source_bytes = sum(
        _state_numel(lazy, name, buf) * (source.itemsize if _floating(lazy, name, buf) else _itemsize(lazy, name, buf))
        for name, buf in state
    )
    write_artifact(job, staging, lazy.model, _tensors(job, state, kept), kept)


def _tensors(
    job: CompressJob, state: list[tuple[str, torch.Tensor | None]], kept: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """assemble.artifact_tensors over the source: every tensor not quantized read from the source (a buffer
    the meta build made real, as it is) and cast to ``kept``."""
    lazy: LazyModel = job.lazy
    readers = (
        (key, functools.partial(lazy.read_state, key) if buffer is None else tensor_reader(buffer))
        for key, buffer in state
    )
    return artifact_tensors(job, readers, kept)


def _param(lazy: LazyModel, name: str) -> torch.Tensor:
    return lazy.model.get_parameter(name)


def _state_numel(lazy: LazyModel, name: str, buffer: torch.Tensor | None) -> int:
    return (_param(lazy, name) if buffer is None else buffer).numel()


def _itemsize(lazy: LazyModel, name: str, buffer: torch.Tensor | None) -> int:
    return (_param(lazy, name) if buffer is None else buffer).element_size()


def _floating(lazy: LazyModel, name: str, buffer: torch.Tensor | None) -> bool:
    return (_param(lazy, name) if buffer is None else buffer).is_floating_point()


BOUNDED = register(
    Pipeline(
        "bounded",
        (
            ("calibrate", calibrate_stage),
            ("load", bounded_load_stage),
            ("sensitivity", bounded_sensitivity_stage),
            ("quantize", bounded_quantize_stage),
            ("tune", tune_stage),
            ("write", bounded_write_stage),
            ("seal", seal_stage),
            ("publish", publish_stage),
        ),
    )
)

__all__ = [
    "BOUNDED",
    "bounded_load_stage",
    "bounded_quantize_stage",
    "bounded_sensitivity_stage",
    "bounded_world_sensitivity_stage",
    "bounded_write_stage",
    "fisher_pass",
    "missing_fisher",
    "windows_of",
]
