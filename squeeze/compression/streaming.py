"""The stages of a compress run within a memory budget (``--max-memory``): one decoder block at a time.

The model is built on the meta device and each block's weights are read from the source safetensors only
while that block is in use (squeeze.models.lazy); the Fisher is computed block by block from the end
backwards (squeeze.calibrate.blockwise) and committed per layer group; the quantize stage reads each group's
weights and Fisher back, and the write stage takes every unquantized tensor straight from the source. Each
number is computed by the same code as in the unbounded run, so the artifact is byte-identical to it.

:func:`check_streamable` refuses, before any work, what a bounded run cannot do (GGUF sources, error
compensation, a bits-per-weight budget, expert parameters); :func:`streaming_peak_bytes` is the estimated
peak that preflight compares with the budget.
"""

from __future__ import annotations

import functools
import shutil
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from squeeze.calibrate.blockwise import blockwise_fisher, model_parts
from squeeze.calibrate.windows import calibration_windows
from squeeze.compression.assemble import (
    artifact_tensors,
    tensor_reader,
    write_artifact,
)
from squeeze.compression.embeddings import embedding_targets
from squeeze.compression.job import CompressJob, timed
from squeeze.compression.quantize import _quantize_group, layer_groups, weight_format
from squeeze.config import Recipe
from squeeze.errors import ConfigError
from squeeze.models.experts import ExpertWeight
from squeeze.models.lazy import LazyModel
from squeeze.models.source import ModelSource, keep_dtype, load_tokenizer, source_dtype
from squeeze.models.targets import target_at

#: Python, torch, transformers, squeeze and the tokenizer, before any tensor (about 520 MB RSS measured), plus
#: allocator slack: a SmolLM2-135M 32 x 512 run peaked at 1.158 GB against an estimate of 1.139 GB without it.
STREAMING_BASE_BYTES = 576 * 2**20


def check_source(source: ModelSource) -> None:
    """ConfigError for a source ``--max-memory`` cannot read block by block: a GGUF file (hint: convert it)."""
    if source.kind == "gguf":
        LazyModel(source)  # raises the GGUF ConfigError with its conversion hint


def check_streamable(source: ModelSource, recipe: Recipe, skeleton: nn.Module, targets: dict[str, Any]) -> None:
    """ConfigError for what ``--max-memory`` cannot stream: a GGUF source, error compensation, a
    ``target_bpw`` budget (both need every layer at once), a model not shaped like Llama. Linears and MoE
    expert parameters (squeeze.models.experts) both stream with their decoder block."""
    weights = recipe.weights
    option = "--max-memory"
    check_source(source)
    if weights.target_bpw is not None:
        raise ConfigError(
            f"{option} cannot plan a bits-per-weight budget (target_bpw {weights.target_bpw}): the plan weighs every "
            "layer against all the others at once",
            hint="use a fixed-width recipe (e.g. w4, w3-s045) with --max-memory, or drop --max-memory",
        )
    if weight_format(recipe).uses_hessian and weights.error_compensation:
        raise ConfigError(
            f"{option} does not stream error compensation (the input Hessians of every layer)",
            hint="use a recipe without error compensation, or drop --max-memory",
        )
    model_parts(skeleton)  # ConfigError for a model that is not lm_head(norm(blocks(embed(ids))))


def streaming_peak_bytes(
    skeleton: nn.Module,
    recipe: Recipe,
    targets: dict[str, Any],
    seq_len: int | None,
    artifact_bytes: int,
) -> int:
    """Estimated peak resident bytes of a bounded run of ``skeleton`` (meta): the largest of its phases, on top
    of the process itself (STREAMING_BASE_BYTES).

    Fisher (``seq_len`` set): the embedding and LM head (fp32), the largest block's fp32 weights (a MoE block's
    3-D expert parameters included: every expert is materialized with its block), their float64
    accumulators and one gradient, one window's saved activations of one block, one window's logits and
    log-probabilities with two gradients of their size (T x vocab fp32 each), and one window's hidden state and
    carried gradient (the rest are spilled to the work area). Quantize: the largest group's weights and Fisher
    plus k-means scratch on its largest target. Write: one shard of the artifact (at most ``max_shard_bytes``)
    plus one source tensor in its own dtype and in fp32.
    """
    embed, blocks, _norm, head = model_parts(skeleton)
    config = getattr(skeleton, "config", None)
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    inter = int(getattr(config, "intermediate_size", 0) or 4 * hidden)
    # a MoE block's routed experts: each token's intermediate activations in top-k experts at once
    top_k = int(getattr(config, "num_experts_per_tok", 0) or 0)
    inter = max(inter, top_k * int(getattr(config, "moe_intermediate_size", 0) or inter))
    edges = _numel(embed) + (0 if _tied(embed, head) else _numel(head))
    block = max((_numel(b) for b in blocks), default=0)
    largest = max((t.weight.numel() for t in targets.values()), default=0)
    quantize = max(block, largest) * (4 + 4) + largest * 4 * 8
    largest_tensor = max((p.numel() for p in skeleton.parameters()), default=0)
    write = min(recipe.output.max_shard_bytes, artifact_bytes) + largest_tensor * (4 + 2)
    fisher = 0
    if seq_len is not None:
        one_window = seq_len * 4 * (12 * hidden + 4 * inter)
        logits = seq_len * vocab * 4 * 4  # logits, log-probabilities and two gradients of their size
        boundaries = 2 * seq_len * hidden * 4
        fisher = edges * 4 + block * (4 + 8 + 4) + one_window + logits + boundaries
    return STREAMING_BASE_BYTES + max(quantize, write, fisher)


def spill_bytes(skeleton: nn.Module, n_windows: int, seq_len: int) -> int:
    """Disk the Fisher pass of a bounded run spills at most (its work area's ``activations/``): every block's
    input for every window (kept until that block's backward) plus one boundary's carried gradients, fp32."""
    _embed, blocks, _norm, _head = model_parts(skeleton)
    hidden = int(getattr(getattr(skeleton, "config", None), "hidden_size", 0) or 0)
    return (len(blocks) + 2) * n_windows * seq_len * hidden * 4


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _tied(embed: nn.Module, head: nn.Module) -> bool:
    return getattr(embed, "weight", None) is getattr(head, "weight", None)


# -- the stages (pipeline.STREAMING_STAGE_FUNCTIONS lists them)


def load_stage(job: CompressJob) -> None:
    """The model on the meta device (weights stay in the source), its tokenizer, targets and embeddings."""
    lazy = LazyModel(job.source)
    job.lazy, job.model = lazy, lazy.model
    job.tokenizer = load_tokenizer(job.source)
    job.targets = {name: target_at(lazy.model, name) for name in job.target_names}
    job.embeddings = embedding_targets(lazy.model, job.embedding_names)
    job.groups = layer_groups(lazy.model, {**job.targets, **job.embeddings})


def sensitivity_stage(job: CompressJob) -> None:
    """The Fisher of every group not yet quantized, block by block, each group committed as it is done;
    skipped when every such group's Fisher (or quantized checkpoint) is already in the work area."""
    calibration = job.calibration
    if calibration is None:
        return
    with timed(job.timings, "checkpoint"):
        missing = [
            index
            for index, names in enumerate(job.groups)
            if not job.work.has_group(index, names) and not job.work.has_fisher_group(index, names)
        ]
    if not missing:
        job.windows = None
        return
    if job.windows is None:
        job.windows = calibration_windows(calibration, load_tokenizer(job.source))
    group_of = {name: index for index, names in enumerate(job.groups) for name in names}
    pending: dict[int, dict[str, torch.Tensor]] = {}

    def commit(part: dict[str, torch.Tensor]) -> None:
        for name, tensor in part.items():
            pending.setdefault(group_of[name], {})[name] = tensor
        for index in [i for i, got in pending.items() if len(got) == len(job.groups[i])]:
            with timed(job.timings, "checkpoint"):
                job.work.save_fisher_group(index, pending.pop(index))

    progress = job.progress
    report = (lambda done, total: progress("fisher", done, total)) if progress else None
    lazy: LazyModel = job.lazy
    try:
        # linears, embeddings and expert parameters (an ExpertWeight's ``.weight`` is its 3-D parameter)
        modules: dict[str, Any] = {**job.targets, **job.embeddings}
        blockwise_fisher(
            lazy.model,
            job.windows,
            modules,
            materialized=lazy.materialized,
            spill_dir=job.work.activations,
            on_group=commit,
            progress=report,
            device=job.device,  # --device: each block moved there for its recomputation and backward
        )
    finally:
        shutil.rmtree(job.work.activations, ignore_errors=True)
    if pending:  # pragma: no cover - every group's targets are in one block (or are one embedding)
        raise ValueError(f"the Fisher of group(s) {sorted(pending)} came back incomplete")
    job.windows = None


def quantize_stage(job: CompressJob) -> None:
    """Each group without a committed checkpoint: its weights read from the source, its Fisher from the work
    area, quantized by quantize.py's own group function and committed."""
    lazy: LazyModel = job.lazy
    done = 0
    for index, names in enumerate(job.groups):
        with timed(job.timings, "checkpoint"):
            committed = job.work.has_group(index, names)
        if not committed:
            job.fisher = _group_fisher(job, index, names) if job.calibration is not None else {}
            modules = [_module(job.targets[name] if name in job.targets else job.embeddings[name]) for name in names]
            with lazy.materialized(*modules):
                tensors, meta = _quantize_group(job, names)
            with timed(job.timings, "checkpoint"):
                job.work.save_group(index, tensors, meta)
            del tensors
        done += len(names)
        if job.progress:
            job.progress("quantize", done, len(job.targets))
    job.fisher = {}


def _module(target: Any) -> nn.Module:
    """The module whose parameters hold ``target``'s weight: itself, or an expert parameter's experts module
    (materialized whole: its gpt-oss biases come with it)."""
    return target.module if isinstance(target, ExpertWeight) else target


def _group_fisher(job: CompressJob, index: int, names: list[str]) -> dict[str, torch.Tensor]:
    with timed(job.timings, "checkpoint"):
        fisher = job.work.load_fisher_group(index, names)
    if fisher is None:  # removed or corrupted since the sensitivity stage: that stage must run again
        from squeeze.errors import ResumeError

        raise ResumeError(
            f"the Fisher checkpoint of layer group {index} in {job.work.root} is missing or unreadable",
            hint="rerun the same command: the Fisher of the groups not yet quantized is computed again",
        )
    return fisher


def write_stage(job: CompressJob) -> None:
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


__all__ = [
    "STREAMING_BASE_BYTES",
    "check_source",
    "check_streamable",
    "load_stage",
    "quantize_stage",
    "sensitivity_stage",
    "spill_bytes",
    "streaming_peak_bytes",
    "write_stage",
]
