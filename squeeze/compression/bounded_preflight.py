"""What a compress run within a memory budget (``--max-memory``) can do, and the peak it reaches.

The bounded run itself (one decoder block resident at a time) is the "bounded" pipeline
(pipelines/bounded.py). Here, for preflight (runner.py): :func:`check_streamable` refuses, before any work, what a
bounded run cannot do (GGUF sources, error compensation, a bits-per-weight budget, a model not shaped like
Llama); :func:`streaming_peak_bytes` is the estimated peak that preflight compares with the budget.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from squeeze.calibrate.block_walk import model_parts
from squeeze.compression import expert_plan
from squeeze.compression.job import RecipeNeeds
from squeeze.config import Recipe
from squeeze.errors import ConfigError
from squeeze.models.lazy import LazyModel
from squeeze.models.source import ModelSource

STREAMING_BASE_BYTES = expert_plan.STREAMING_BASE_BYTES


def check_source(source: ModelSource) -> None:
    """ConfigError for a source ``--max-memory`` cannot read block by block: a GGUF file (hint: convert it)."""
    if source.kind == "gguf":
        LazyModel(source)  # raises the GGUF ConfigError with its conversion hint


def check_streamable(source: ModelSource, recipe: Recipe, skeleton: nn.Module, targets: dict[str, Any]) -> None:
    """ConfigError for what ``--max-memory`` cannot stream: a GGUF source, error compensation, a
    ``target_bpw`` budget (both need every layer at once), end-to-end distillation (the whole model trains),
    a model not shaped like Llama. Linears and MoE
    expert parameters (squeeze.models.expert_params) both stream with their decoder block."""
    weights = recipe.weights
    option = "--max-memory"
    check_source(source)
    if weights.target_bpw is not None:
        raise ConfigError(
            f"{option} cannot plan a bits-per-weight budget (target_bpw {weights.target_bpw}): the plan weighs every "
            "layer against all the others at once",
            hint="use a fixed-width recipe (e.g. w4, w3-s045) with --max-memory, or drop --max-memory",
        )
    if RecipeNeeds.of(recipe).hessians:
        raise ConfigError(
            f"{option} does not stream error compensation (the input Hessians of every layer)",
            hint="use a recipe without error compensation, or drop --max-memory",
        )
    if weights.distill is not None:
        raise ConfigError(
            f"{option} does not stream weights.distill (it trains the whole model end to end, every block resident)",
            hint="remove weights.distill (weights.tuning streams block by block), or drop --max-memory",
        )
    model_parts(skeleton)  # ConfigError for a model that is not lm_head(norm(blocks(embed(ids))))


def streaming_peak_bytes(
    skeleton: nn.Module,
    recipe: Recipe,
    targets: dict[str, Any],
    seq_len: int | None,
    artifact_bytes: int,
    expert_group: int | None = None,
) -> int:
    """Estimated peak resident bytes of a bounded run of ``skeleton`` (meta), its MoE blocks' routed experts
    streamed ``expert_group`` at a time (None: each block whole): squeeze.compression.expert_plan."""
    return expert_plan.bounded_peak_bytes(skeleton, recipe, targets, seq_len, artifact_bytes, expert_group)


def spill_bytes(skeleton: nn.Module, n_windows: int, seq_len: int) -> int:
    """Disk the Fisher pass of a bounded run spills at most (its work area's ``activations/``): every block's
    input for every window (kept until that block's backward) plus one boundary's carried gradients, fp32."""
    _embed, blocks, _norm, _head = model_parts(skeleton)
    hidden = int(getattr(getattr(skeleton, "config", None), "hidden_size", 0) or 0)
    return (len(blocks) + 2) * n_windows * seq_len * hidden * 4


__all__ = [
    "STREAMING_BASE_BYTES",
    "check_source",
    "check_streamable",
    "spill_bytes",
    "streaming_peak_bytes",
]
