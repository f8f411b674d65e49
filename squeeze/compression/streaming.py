"""What a compress run within a memory budget (``--max-memory``) can do, and the peak it reaches.

The bounded run itself (one decoder block resident at a time) is the "bounded" pipeline
(pipelines/bounded.py). Here, for preflight: :func:`check_streamable` refuses, before any work, what a
bounded run cannot do (GGUF sources, error compensation, a bits-per-weight budget, a model not shaped like
Llama); :func:`streaming_peak_bytes` is the estimated peak that preflight compares with the budget.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from squeeze.calibrate.block_walk import model_parts
from squeeze.compression.job import RecipeNeeds
from squeeze.config import Recipe
from squeeze.errors import ConfigError
from squeeze.models.lazy import LazyModel
from squeeze.models.source import ModelSource

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


__all__ = [
    "STREAMING_BASE_BYTES",
    "check_source",
    "check_streamable",
    "spill_bytes",
    "streaming_peak_bytes",
]
