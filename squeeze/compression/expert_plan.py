"""Budgets in expert groups: the peak of a bounded (``--max-memory``) run as a function of how many routed experts
of a MoE block are resident at once, and the group size a run uses.

A bounded run keeps one decoder block resident; in a MoE block (squeeze.calibrate.expert_groups) only the
attention, router, norms and shared experts stay resident while the routed experts are streamed ``group`` at a
time (Fisher or activation pass, and the k-means of a format whose rows are quantized independently). The peak
is the largest of its phases (host bytes, on top of the process itself, STREAMING_BASE_BYTES):

* Fisher: the embedding and LM head (fp32), the block's resident weights and one group's (fp32 weights, float64
  sums, one gradient), the experts' fp32 Fisher assembled on the host (4 bytes per routed weight of the block,
  when streamed in groups), one window's activations, its logits with log-probabilities and two gradients, two
  block boundaries and the per-window experts tensors (one row per token and slot);
* quantize: the block's Fisher read back (fp32), one group's weights and the k-means scratch of the largest
  matrix quantized at once (a group's rows of an expert parameter when rows are quantized independently);
* write: one artifact shard and the largest unquantized source tensor in its own dtype and in fp32.

With ``--device cuda`` the device holds one step's share: :func:`device_peak_bytes`. :func:`plan_expert_groups`
picks the largest group that keeps the host peak within the budget (and the device peak within the device's
memory); the smallest admissible budget is the peak with the smallest group (MIN_GROUP experts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from squeeze.calibrate.block_walk import model_parts
from squeeze.calibrate.expert_streaming import MIN_GROUP, group_bounds, streamable_experts
from squeeze.config import Recipe
from squeeze.errors import ResourceError
from squeeze.models.expert_params import ExpertWeight

#: Python, torch, transformers, squeeze and the tokenizer, before any tensor (about 520 MB RSS measured), plus
#: allocator slack: a SmolLM2-135M 32 x 512 run peaked at 1.158 GB against an estimate of 1.139 GB without it.
STREAMING_BASE_BYTES = 576 * 2**20
#: CUDA context, cuBLAS workspace and the caching allocator's slack on a device, before any tensor of the run.
DEVICE_BASE_BYTES = 1 * 2**30
#: The device memory a plan assumes for ``--device cuda`` when no GPU is visible (an 80 GB H100).
DEFAULT_DEVICE_BYTES = 80 * 10**9


@dataclass(frozen=True)
class BlockShape:
    """One decoder block's weights: all of them, and its routed experts' (0 when it streams none)."""

    numel: int
    routed: int = 0
    experts: int = 0
    expert_rows: int = 0  # the largest expert parameter's (out, in) per expert: out * in

    def largest_group(self, group: int | None) -> int:
        """Experts resident at once with groups of at most ``group`` (None: every expert)."""
        if not self.experts or group is None:
            return self.experts
        return max(stop - start for start, stop in group_bounds(self.experts, group))

    def resident(self, group: int | None) -> int:
        """Weights resident at once: the block's own plus one group's routed experts."""
        if not self.experts:
            return self.numel
        return self.numel - self.routed + -(-self.routed * self.largest_group(group) // self.experts)


@dataclass(frozen=True)
class ExpertPlan:
    """The group size a bounded run uses and what it costs.

    ``group``: experts per group (None: no block streams its experts; every MoE block runs whole);
    ``experts``: routed experts of the largest MoE block (0: a dense model); ``peak_bytes``: the host peak with
    ``group``; ``minimum_bytes``: the smallest admissible budget (one group of MIN_GROUP experts plus the rest);
    ``device_peak_bytes``: with ``--device cuda``, the device's peak with ``group`` (None otherwise)."""

    group: int | None
    experts: int
    peak_bytes: int
    minimum_bytes: int
    device_peak_bytes: int | None = None


def block_shapes(skeleton: nn.Module) -> list[BlockShape]:
    """Every decoder block's :class:`BlockShape` (the routed experts of a block squeeze can stream in groups)."""
    _embed, blocks, _norm, _head = model_parts(skeleton)
    shapes = []
    for block in blocks:
        numel = _numel(block)
        experts = streamable_experts(block)
        if experts is None:
            shapes.append(BlockShape(numel))
            continue
        count = int(getattr(experts, "num_experts"))  # noqa: B009 - an int attribute
        params = [p for p in experts.parameters(recurse=False) if p.ndim >= 2 and p.shape[0] == count]
        rows = max((p[0].numel() for p in params if p.ndim == 3), default=0)
        shapes.append(BlockShape(numel, sum(p.numel() for p in params), count, rows))
    return shapes


def rows_independent(recipe: Recipe) -> bool:
    """Whether the format quantizes each row on its own (no sparse part chosen over the whole matrix), so an
    expert parameter's k-means can run a group of experts' rows at a time with the same bits."""
    weights = recipe.weights
    return not (weights.sensitive_fraction or weights.outlier_fraction)


def bounded_peak_bytes(
    skeleton: nn.Module,
    recipe: Recipe,
    targets: dict[str, Any],
    seq_len: int | None,
    artifact_bytes: int,
    group: int | None = None,
) -> int:
    """Estimated peak resident bytes of a bounded run (module docstring) with routed experts streamed ``group`` at
    a time (None: each MoE block whole)."""
    embed, blocks, _norm, head = model_parts(skeleton)
    vocab, hidden, inter, top_k = _widths(skeleton)
    shapes = block_shapes(skeleton)
    streamed = group is not None and any(s.experts for s in shapes)
    edges = _numel(embed) + (0 if _tied(embed, head) else _numel(head))
    block = max((s.numel for s in shapes), default=0)
    resident = max((s.resident(group) for s in shapes), default=0)
    largest = _largest_matrix(targets, shapes, group if streamed and rows_independent(recipe) else None)
    # the group's Fisher read back (a whole block's, or the largest target's), one group's weights, k-means scratch
    quantize = max(block, largest) * 4 + max(resident, largest) * 4 + largest * 4 * 8
    unquantized = _largest_unquantized(skeleton, targets) if streamed else _largest_param(skeleton)
    write = min(recipe.output.max_shard_bytes, artifact_bytes) + unquantized * (4 + 2)
    fisher = 0
    if seq_len is not None:
        one_window = seq_len * 4 * (12 * hidden + 4 * inter)
        logits = seq_len * vocab * 4 * 4  # logits, log-probabilities and two gradients of their size
        boundaries = 2 * seq_len * hidden * 4
        expert_fisher = max((s.routed for s in shapes), default=0) * 4 if streamed else 0
        slots = 4 * max(top_k, 1) * seq_len * hidden * 4 if streamed else 0  # rows, their gradients, inputs
        fisher = edges * 4 + resident * (4 + 8 + 4) + expert_fisher + one_window + logits + boundaries + slots
    return STREAMING_BASE_BYTES + max(quantize, write, fisher)


def device_peak_bytes(
    skeleton: nn.Module,
    targets: dict[str, Any],
    seq_len: int | None,
    group: int | None = None,
    recipe: Recipe | None = None,
) -> int:
    """Device bytes at the peak of a ``--device cuda`` run: the largest of the Fisher's block step (the resident
    weights and one group's in fp32, their float64 sums, one gradient, one window's activations and two
    boundaries), its head step (the LM head and final norm, one window's logits with log-probabilities and two
    gradients), and the k-means of the largest matrix quantized at once (weight, Fisher, about eight copies)."""
    embed, _blocks, _norm, head = model_parts(skeleton, option="--device")
    vocab, hidden, inter, top_k = _widths(skeleton)
    shapes = block_shapes(skeleton)
    by_rows = recipe is None or rows_independent(recipe)
    largest = _largest_matrix(targets, shapes, group if by_rows else None)
    quantize = largest * 4 * (1 + 1 + 8)
    if seq_len is None:
        return DEVICE_BASE_BYTES + quantize
    resident = max((s.resident(group) for s in shapes), default=0)
    one_window = seq_len * 4 * (12 * hidden + 4 * inter)
    boundaries = 2 * seq_len * hidden * 4
    slots = 4 * max(top_k, 1) * seq_len * hidden * 4 if group is not None else 0
    fisher_block = resident * (4 + 8 + 4) + one_window + boundaries + slots
    fisher_head = (_numel(head) + _numel(embed)) * 4 + seq_len * vocab * 4 * 4 + boundaries
    return DEVICE_BASE_BYTES + max(quantize, fisher_block, fisher_head)


def plan_expert_groups(
    skeleton: nn.Module,
    recipe: Recipe,
    targets: dict[str, Any],
    seq_len: int | None,
    artifact_bytes: int,
    max_memory: int | None,
    device_bytes: int | None = None,
) -> ExpertPlan:
    """The group size of a bounded run within ``max_memory`` host bytes (and ``device_bytes`` on a CUDA device,
    None: no device): every expert at once when that fits, else the largest group that fits, else the smallest
    (MIN_GROUP; the run is then refused, naming ``minimum_bytes``). A dense model: no groups."""
    shapes = block_shapes(skeleton)
    experts = max((s.experts for s in shapes), default=0)

    def plan(size: int | None) -> ExpertPlan:
        # the size the groups really have (group_bounds balances them): what the run holds and reports
        group = None if size is None else max(stop - start for start, stop in group_bounds(experts, size))
        host = bounded_peak_bytes(skeleton, recipe, targets, seq_len, artifact_bytes, group)
        device = device_peak_bytes(skeleton, targets, seq_len, group, recipe) if device_bytes is not None else None
        return ExpertPlan(group, experts, host, minimum, device)

    def fits(candidate: ExpertPlan) -> bool:
        host_ok = max_memory is None or candidate.peak_bytes <= max_memory
        device = candidate.device_peak_bytes
        return host_ok and (device is None or device_bytes is None or device <= device_bytes)

    if not experts:
        peak = bounded_peak_bytes(skeleton, recipe, targets, seq_len, artifact_bytes)
        device = device_peak_bytes(skeleton, targets, seq_len, None, recipe) if device_bytes is not None else None
        return ExpertPlan(None, 0, peak, peak, device)
    minimum = bounded_peak_bytes(skeleton, recipe, targets, seq_len, artifact_bytes, MIN_GROUP)
    whole = plan(None)
    if fits(whole):
        return whole
    low, high = MIN_GROUP, experts - 1  # the largest group that fits: peaks grow with the group
    if not fits(plan(low)):
        return plan(low)
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(plan(middle)) else (low, middle - 1)
    return plan(low)


def check_expert_budget(plan: ExpertPlan, max_memory: int, force: bool = False) -> None:
    """Refuse (ResourceError, unless ``force``) a budget below the smallest admissible one of a model whose MoE
    blocks stream their experts in groups, naming it."""
    if plan.experts and max_memory < plan.minimum_bytes and not force:
        raise ResourceError(
            f"--max-memory {_size(max_memory)} is below the minimum of {_size(plan.minimum_bytes)} for this model: "
            f"the resident part of its largest MoE block (attention, router, shared experts) plus one group of "
            f"{MIN_GROUP} of its {plan.experts} routed experts, their activations, the embedding and LM head, and "
            "the process itself",
            hint=f"pass --max-memory {-(-plan.minimum_bytes // 10**6)}MB or more (shorter calibration windows lower "
            "it), or --force to try anyway",
        )


def _widths(skeleton: nn.Module) -> tuple[int, int, int, int]:
    """(vocab, hidden, MLP width, routed experts per token) from the skeleton's config; the MLP width is the
    larger of the dense one and a token's routed experts together (0 where the config names none)."""
    config = getattr(skeleton, "config", None)
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    inter = int(getattr(config, "intermediate_size", 0) or 4 * hidden)
    top_k = int(getattr(config, "num_experts_per_tok", 0) or 0)
    inter = max(inter, top_k * int(getattr(config, "moe_intermediate_size", 0) or inter))
    return vocab, hidden, inter, top_k


def _size(n: int) -> str:
    """A byte count as GB / MB / KB / B, as preflight writes budgets."""
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if n >= scale:
            return f"{n / scale:.2f}GB" if unit == "GB" else f"{round(n / scale)}{unit}"
    return f"{n}B"


def _largest_matrix(targets: dict[str, Any], shapes: list[BlockShape], group: int | None) -> int:
    """Weights of the largest matrix quantized at once: a target's, an expert parameter's group of rows when the
    experts are quantized a group at a time (``group``)."""
    most = 0
    per_group = max((s.largest_group(group) for s in shapes if s.experts), default=0)
    for target in targets.values():
        numel = target.weight.numel()
        if group is not None and isinstance(target, ExpertWeight) and per_group:
            numel = min(numel, numel // target.experts * per_group)
        most = max(most, numel)
    return most


def _largest_unquantized(skeleton: nn.Module, targets: dict[str, Any]) -> int:
    quantized = {id(t.weight) for t in targets.values()}
    return max((p.numel() for p in skeleton.parameters() if id(p) not in quantized), default=0)


def _largest_param(skeleton: nn.Module) -> int:
    return max((p.numel() for p in skeleton.parameters()), default=0)


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _tied(embed: nn.Module, head: nn.Module) -> bool:
    return getattr(embed, "weight", None) is getattr(head, "weight", None)


__all__ = [
    "DEFAULT_DEVICE_BYTES",
    "DEVICE_BASE_BYTES",
    "STREAMING_BASE_BYTES",
    "BlockShape",
    "ExpertPlan",
    "block_shapes",
    "bounded_peak_bytes",
    "check_expert_budget",
    "device_peak_bytes",
    "plan_expert_groups",
    "rows_independent",
]
