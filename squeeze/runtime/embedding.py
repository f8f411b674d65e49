"""SqueezeEmbedding: a token embedding stored quantized, dequantized one looked-up row at a time.

The table (V, d) is held as a registered format's weight (:mod:`squeeze.quant.schemes`: the per-row LUT,
or RTN int8 rows), as buffers named as in the artifact (``weight_packed``, ``weight_lut``...). ``forward``
gathers the packed codes (and per-row LUT / scales) of the requested token ids and dequantizes only those
rows: the full (V, d) table is never expanded. A tied LM head is a :class:`SqueezeLinear` over the very same
weight (:func:`tied_head`): one stored copy serves both.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from squeeze.errors import FormatError
from squeeze.quant.schemes import WeightFormat
from squeeze.runtime.activations import DEFAULT_ACTIVATIONS, Activations
from squeeze.runtime.linear import SqueezeLinear, replace_module
from squeeze.runtime.qmodule import QuantizedModule


def gather_rows(qweight: WeightFormat, index: torch.Tensor) -> WeightFormat:
    """Rows ``index`` (int64 (n,), each in [0, R)) of ``qweight`` as a weight of the same format, (n, N).

    ``dequantize()`` of the result equals ``qweight.dequantize()[index]`` bit for bit: every stored tensor
    of a dense per-row format is indexed by row. ValueError for a format with tensors not indexed by row
    (a sparse part); IndexError for an id outside the table.
    """
    found: dict[str, torch.Tensor] = {}
    tensors = qweight.tensors_by_role()
    for role in type(qweight).roles:
        if role.name not in tensors:
            continue
        if not role.shape or role.shape[0] != "rows":
            raise ValueError(f"{type(qweight).__name__}.{role.name} is not stored by row: rows cannot be gathered")
        found[role.name] = tensors[role.name].index_select(0, index)
    return type(qweight).from_roles(qweight.bits, qweight.in_features, qweight.params(), found)


def check_embedding_weight(qweight: WeightFormat, name: str) -> None:
    """FormatError when ``qweight`` cannot serve as an embedding table (a tensor not stored by row)."""
    for role in type(qweight).roles:
        if role.name in qweight.tensors_by_role() and (not role.shape or role.shape[0] != "rows"):
            raise FormatError(
                f"{name}: a quantized embedding stores every tensor by row, found {name}.{role.name}",
                hint="squeeze compress writes embeddings without a sparse part; re-create the artifact",
            )


class SqueezeEmbedding(QuantizedModule):
    """ids (...) int64 -> (..., embedding_dim) float32, rows dequantized from the quantized (V, d) table."""

    unnamed = "embedding"

    def __init__(self, qweight: WeightFormat, padding_idx: int | None = None):
        check_embedding_weight(qweight, self.unnamed)
        super().__init__(qweight)
        self.num_embeddings = qweight.out_features
        self.embedding_dim = qweight.in_features
        self.padding_idx = padding_idx  # kept for code that reads it; the stored row is what is returned

    def check_weight(self, qweight: WeightFormat, name: str) -> None:
        check_embedding_weight(qweight, name)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).to(torch.int64)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"token id out of range: the embedding has {self.num_embeddings} rows")
        rows = gather_rows(self._qweight, flat).dequantize(torch.float32)  # (n, d)
        return rows.reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.format_repr()}"


def replace_embedding(model: nn.Module, name: str, build: Callable[[nn.Embedding], nn.Module]) -> None:
    """Replace the ``nn.Embedding`` called ``name`` in ``model`` by ``build(old)`` (FormatError if there is none)."""
    error = f"quantization_config names {name!r} as an embedding, but this architecture has none there"
    replace_module(model, name, nn.Embedding, build, error)


def tie_quantized_heads(
    model: nn.Module,
    tied: Mapping[str, str],
    *,
    low_memory: bool = False,
    activations: Activations = DEFAULT_ACTIVATIONS,
) -> None:
    """Make each tied LM head of ``model`` a SqueezeLinear over its quantized embedding's weight (the same
    buffers: one stored copy serves both); FormatError when a name does not fit the architecture.
    ``low_memory`` / ``activations``: as in SqueezeLinear.

    The head found there may be the ``nn.Linear`` of the skeleton or a SqueezeLinear placed earlier (the
    ``from_pretrained`` path places one before loading and rebuilds it over the loaded embedding after).
    """
    for head, source in tied.items():
        embedding = _submodule(model, source)
        if not isinstance(embedding, SqueezeEmbedding):
            raise FormatError(
                f"quantization_config.embeddings.tied names {source!r} for the LM head {head!r}, which is not a "
                "quantized embedding of this artifact"
            )
        weight = embedding.qweight
        parent_name, _, child = head.rpartition(".")
        parent = _submodule(model, parent_name)
        old = getattr(parent, child, None) if parent is not None else None
        if not isinstance(old, (nn.Linear, SqueezeLinear)):
            raise FormatError(f"quantization_config.embeddings.tied names {head!r}, which is not an LM head here")
        if (old.out_features, old.in_features) != (weight.out_features, weight.in_features):
            raise FormatError(
                f"{head}: config.json builds a {old.out_features} x {old.in_features} LM head, but the tied "
                f"embedding is {weight.out_features} x {weight.in_features}",
                hint="config.json does not belong to these tensors; re-create the artifact",
            )
        setattr(parent, child, SqueezeLinear(weight, low_memory=low_memory, activations=activations))


def _submodule(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name) if name else model
    except AttributeError:
        return None


__all__ = [
    "SqueezeEmbedding",
    "gather_rows",
    "check_embedding_weight",
    "replace_embedding",
    "tie_quantized_heads",
]
