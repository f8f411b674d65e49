"""Which part of each artifact weight a tensor-parallel rank holds (no vLLM import: tested on its own).

vLLM splits a linear layer across ``tp_size`` ranks in one of three ways, and fuses some checkpoint modules
into one layer (``q_proj, k_proj, v_proj`` -> ``qkv_proj``; ``gate_proj, up_proj`` -> ``gate_up_proj``):

* column-parallel (q/k/v, gate/up): each rank holds a contiguous block of OUTPUT rows of every fused
  shard. Key/value heads are replicated when there are fewer of them than ranks, so k and v shards use the
  rank ``tp_rank // kv_replicas``;
* row-parallel (o_proj, down_proj): each rank holds a block of INPUT columns; its partial outputs are
  summed by vLLM's all-reduce. Packed codes are re-packed at code boundaries and the sparse part filtered
  by column (:meth:`squeeze.quant.schemes.WeightFormat.col_slice`);
* replicated: every rank holds the whole weight.

A :class:`ShardPlan` is the rank's slice of one checkpoint module; :func:`take_shard` cuts it from the
module's weight, checked against the layer's sizes.

Two more layers are split here:

* a fused-MoE layer's routed experts (:func:`take_expert_shards`): squeeze stores each expert parameter as ONE
  matrix, ``gate_up_proj`` (E*2I, H) (expert e's gate rows then its up rows) and ``down_proj`` (E*H, I).
  Expert parallelism gives a rank a subset of the experts (vLLM's expert map); tensor parallelism gives it
  the intermediate channels ``[r*I/t, (r+1)*I/t)`` of each: those rows of the gate and of the up half, those
  input columns of down (its partial outputs summed by vLLM's all-reduce, as for a row-parallel linear);
* a vocab-parallel embedding / LM head (:func:`vocab_rows`): a contiguous block of vocabulary rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from squeeze.errors import FormatError
from squeeze.quant.schemes import WeightFormat

#: How a vLLM linear layer is split across tensor-parallel ranks.
Split = Literal["column", "row", "replicated"]
#: vLLM's id of one fused checkpoint module: "q" / "k" / "v" for QKV layers, 0, 1... for merged column
#: layers, None for a layer that is one checkpoint module.
ShardId = str | int | None

QKV_SHARD_IDS = ("q", "k", "v")


@dataclass(frozen=True)
class LayerGeometry:
    """What a rank's vLLM layer looks like: its split, the rank, and its local sizes.

    ``output_partition_sizes``: local output rows of each fused shard, in shard order; ``input_size``: local
    input columns; ``kv_replicas``: ranks sharing one key/value head (QKV layers; 1 elsewhere).
    """

    split: Split
    tp_rank: int
    tp_size: int
    output_partition_sizes: tuple[int, ...]
    input_size: int
    qkv: bool = False
    kv_replicas: int = 1

    def shard_ids(self, count: int) -> tuple[ShardId, ...]:
        """The ids vLLM's loaders pass for a layer fusing ``count`` checkpoint modules, in order."""
        if count == 1 and not self.qkv:
            return (None,)
        if self.qkv:
            return QKV_SHARD_IDS[:count]
        return tuple(range(count))


@dataclass(frozen=True)
class ShardPlan:
    """The rank's part of checkpoint module ``module``: ``[start, stop)`` along ``axis`` ("rows" or "cols"),
    or all of it (``axis`` None)."""

    module: str
    shard_id: ShardId
    axis: Literal["rows", "cols"] | None
    start: int
    stop: int
    #: output rows of this module on the rank
    rows: int


def plan_shards(modules: tuple[str, ...], geometry: LayerGeometry) -> dict[ShardId, ShardPlan]:
    """shard id -> the rank's slice of each checkpoint module fused into the layer (in ``modules`` order)."""
    ids = geometry.shard_ids(len(modules))
    if len(geometry.output_partition_sizes) != len(modules):
        raise FormatError(
            f"vLLM's layer fuses {len(geometry.output_partition_sizes)} weights, but the artifact maps "
            f"{len(modules)} modules to it ({', '.join(modules)})"
        )
    plans: dict[ShardId, ShardPlan] = {}
    for module, shard_id, local in zip(modules, ids, geometry.output_partition_sizes, strict=True):
        if geometry.split == "column":
            rank = geometry.tp_rank
            if geometry.qkv and shard_id in ("k", "v"):
                rank //= geometry.kv_replicas  # replicated key/value heads: ranks share a slice
            plans[shard_id] = ShardPlan(module, shard_id, "rows", rank * local, (rank + 1) * local, local)
        elif geometry.split == "row":
            cols = geometry.input_size
            rank = geometry.tp_rank
            plans[shard_id] = ShardPlan(module, shard_id, "cols", rank * cols, (rank + 1) * cols, local)
        else:
            plans[shard_id] = ShardPlan(module, shard_id, None, 0, local, local)
    return plans


def take_shard(qweight: WeightFormat, plan: ShardPlan, geometry: LayerGeometry) -> WeightFormat:
    """The rank's part of ``qweight`` (the whole module's weight) per ``plan``; FormatError when the weight's
    shape does not fit the layer vLLM built, or its format cannot be split that way."""
    rows, cols = qweight.out_features, qweight.in_features
    ranks = geometry.tp_size
    if plan.axis == "rows":
        if geometry.qkv and plan.shard_id in ("k", "v"):
            ranks = max(1, geometry.tp_size // geometry.kv_replicas)
        want = (plan.rows * ranks, geometry.input_size)
    elif plan.axis == "cols":
        want = (plan.rows, geometry.input_size * ranks)
    else:
        want = (plan.rows, geometry.input_size)
    if (rows, cols) != want:
        raise FormatError(
            f"{plan.module}: the artifact's weight is {rows} x {cols}, but vLLM's layer at tensor parallel size "
            f"{geometry.tp_size} needs {want[0]} x {want[1]}",
            hint="config.json does not match the tensors; re-create the artifact with squeeze compress",
        )
    whole = rows if plan.axis == "rows" else cols
    if plan.axis is None or (plan.start, plan.stop) == (0, whole):
        return qweight
    if plan.axis == "rows":
        return qweight.row_slice(plan.start, plan.stop)
    if plan.axis == "cols":
        try:
            return qweight.col_slice(plan.start, plan.stop)
        except NotImplementedError:
            raise FormatError(
                f"{plan.module}: weight format {qweight.name!r} cannot be split by input columns, which "
                f"tensor parallel size {geometry.tp_size} needs for this layer",
                hint="serve it with tensor_parallel_size 1, or re-compress with a LUT recipe",
            ) from None
        except ValueError as exc:
            raise FormatError(
                f"{plan.module}: cannot split columns [{plan.start}, {plan.stop}) of its {qweight.name!r} weight "
                f"for tensor parallel size {geometry.tp_size}: {exc}",
                hint="choose a tensor parallel size whose column split falls on the format's group boundaries",
            ) from None
    raise AssertionError(f"unknown axis {plan.axis!r}")


@dataclass(frozen=True)
class ExpertGeometry:
    """What a rank's vLLM fused-MoE layer holds: ``experts`` (the global ids of its local experts, in local
    order), its tensor-parallel rank and size, and the model's ``hidden`` and full ``intermediate`` sizes."""

    experts: tuple[int, ...]
    tp_rank: int
    tp_size: int
    hidden: int
    intermediate: int


def take_expert_shards(
    gate_up: WeightFormat, down: WeightFormat, num_experts: int, geometry: ExpertGeometry, name: str
) -> tuple[WeightFormat, WeightFormat]:
    """The rank's part of a MoE layer's two expert weights (the layout in the module docstring):
    ``gate_up`` (E*2I, H) -> (L*2i, H) and ``down`` (E*H, I) -> (L*H, i), for its L local experts and
    i = I / tp_size channels, local expert l's rows at ``l*2i`` (gate, then up) and ``l*H``. FormatError when
    the weights do not have the sizes vLLM's layer was built with, or tp_size does not divide I."""
    hidden, inter, tp = geometry.hidden, geometry.intermediate, geometry.tp_size
    want = {"gate_up_proj": (num_experts * 2 * inter, hidden), "down_proj": (num_experts * hidden, inter)}
    for role, weight in (("gate_up_proj", gate_up), ("down_proj", down)):
        if (weight.out_features, weight.in_features) != want[role]:
            raise FormatError(
                f"{name}.{role}: the artifact's weight is {weight.out_features} x {weight.in_features}, but "
                f"vLLM's MoE layer of {num_experts} experts (hidden {hidden}, intermediate {inter}) needs "
                f"{want[role][0]} x {want[role][1]}",
                hint="config.json does not match the tensors; re-create the artifact with squeeze compress",
            )
    if inter % tp:
        raise FormatError(
            f"{name}: {inter} intermediate channels per expert cannot be split over tensor parallel size {tp}",
            hint="choose a tensor parallel size that divides the experts' intermediate size",
        )
    bad = [e for e in geometry.experts if not 0 <= e < num_experts]
    if bad:
        raise FormatError(f"{name}: vLLM places expert {bad[0]} on this rank, but the layer has {num_experts}")
    if tp == 1 and geometry.experts == tuple(range(num_experts)):  # the rank holds the layer as stored
        return gate_up, down
    local = inter // tp
    lo = geometry.tp_rank * local
    gate_up_parts, down_parts = [], []
    cut = down if tp == 1 else _col_slice(down, lo, lo + local, name, tp)
    for e in geometry.experts:
        base = e * 2 * inter
        gate_up_parts.append(gate_up.row_slice(base + lo, base + lo + local))  # gate channels
        gate_up_parts.append(gate_up.row_slice(base + inter + lo, base + inter + lo + local))  # up channels
        down_parts.append(cut.row_slice(e * hidden, (e + 1) * hidden))
    return type(gate_up).cat_rows(gate_up_parts), type(down).cat_rows(down_parts)


def _col_slice(weight: WeightFormat, start: int, stop: int, name: str, tp: int) -> WeightFormat:
    try:
        return weight.col_slice(start, stop)
    except NotImplementedError:
        raise FormatError(
            f"{name}.down_proj: weight format {weight.name!r} cannot be split by input columns, which tensor "
            f"parallel size {tp} needs for MoE experts",
            hint="serve it with tensor_parallel_size 1 (or expert parallelism), or re-compress with a LUT recipe",
        ) from None
    except ValueError as exc:
        raise FormatError(
            f"{name}.down_proj: cannot split columns [{start}, {stop}) of its {weight.name!r} weight for tensor "
            f"parallel size {tp}: {exc}",
            hint="choose a tensor parallel size whose column split falls on the format's group boundaries",
        ) from None


def vocab_rows(weight: WeightFormat, start: int, stop: int, name: str) -> WeightFormat:
    """Vocabulary rows ``[start, stop)`` of an embedding / LM head weight (V, d): a vocab-parallel rank's shard
    (vLLM pads each shard after these rows). FormatError when the table has fewer rows."""
    if not 0 <= start <= stop <= weight.out_features:
        raise FormatError(
            f"{name}: vLLM's vocab-parallel shard is rows [{start}, {stop}), but the artifact's table has "
            f"{weight.out_features} rows",
            hint="config.json's vocab_size does not match the tensors; re-create the artifact",
        )
    return weight if (start, stop) == (0, weight.out_features) else weight.row_slice(start, stop)


__all__ = [
    "Split",
    "ShardId",
    "LayerGeometry",
    "ShardPlan",
    "plan_shards",
    "take_shard",
    "QKV_SHARD_IDS",
    "ExpertGeometry",
    "take_expert_shards",
    "vocab_rows",
]
