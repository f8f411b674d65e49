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


__all__ = ["Split", "ShardId", "LayerGeometry", "ShardPlan", "plan_shards", "take_shard", "QKV_SHARD_IDS"]
