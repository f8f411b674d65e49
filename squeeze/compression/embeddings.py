"""How compress quantizes the token embedding and an untied LM head (``weights.embedding_bits``).

An embedding row is read whole (one token's vector), so the formats are per row: 8 and 6 bits as RTN rows
(one float16 scale and zero per row: 8.06 / 6.06 bits per weight at d = 576; a 256- or 64-entry LUT per row
would cost more than the codes save), 4 bits as the recipe's per-row LUT (Fisher-weighted k-means when the
recipe is, no sparse part). A tied embedding / LM head is one weight, quantized once. With
``embedding_bits: auto`` a ``target_bpw`` budget gives each embedding its width, or keeps it
(squeeze.compression.bit_plan).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

from torch import nn

from squeeze.config import EMBEDDING_AUTO, Recipe, WeightsConfig
from squeeze.limits import EMBEDDING_ONLY_BITS
from squeeze.models.targets import embedding_modules

#: Embedding widths stored as RTN rows whatever the recipe's method (the rest take the recipe's LUT).
RTN_ROW_BITS = (8, *EMBEDDING_ONLY_BITS)


def embedding_recipe(recipe: Recipe, bits: int | None = None) -> Recipe:
    """The recipe an embedding weight is quantized with: ``recipe`` with its weights section set to ``bits``
    (default ``weights.embedding_bits``; with ``auto``, the width the budget planned) (8, 6: RTN per row; 4: the
    recipe's LUT format, dense only; a recipe of another method: that method per row). ValueError when there is
    no width: the recipe quantizes no embedding, or says ``auto`` and no planned width is given."""
    w = recipe.weights
    if bits is None:
        if w.embedding_bits is None or w.embedding_bits == EMBEDDING_AUTO:
            raise ValueError(f"no embedding width: weights.embedding_bits is {w.embedding_bits!r}")
        bits = w.embedding_bits
    # every other option back to its default (sparse fractions, error compensation, a bits budget...): they
    # are the linears' and mean nothing for a table of rows; the sensitivity (Fisher or not) is kept
    if bits in RTN_ROW_BITS or w.method == "rtn":
        weights = _rtn_rows(bits, w)
    else:  # the recipe's LUT (float16 or int8 entries), dense only: a gathered row needs nothing else
        weights = WeightsConfig(
            method="squeeze",
            bits=bits,
            lut_dtype=w.lut_dtype,
            sensitivity=w.sensitivity,
            targets=w.targets,
            ignore=w.ignore,
            embedding_bits=bits,
        )
    return dataclasses.replace(recipe, weights=weights)


def _rtn_rows(bits: int, w: WeightsConfig) -> WeightsConfig:
    """The weights section quantizing an embedding as ``bits``-bit RTN rows (one group per row).

    WeightsConfig checks ``bits`` against the linears' widths (squeeze.limits.WEIGHT_BITS), which an
    embedding-only width (6) is not: the section is built and checked at 8 bits, then given its width. It
    only reaches the RTN quantizer, which takes every width of squeeze.limits.CODE_BITS.
    """
    checked_bits = 8 if bits in EMBEDDING_ONLY_BITS else bits
    weights = WeightsConfig(
        method="rtn",
        bits=checked_bits,
        sensitivity=w.sensitivity,
        targets=w.targets,
        ignore=w.ignore,
        embedding_bits=bits,
    )
    if checked_bits != bits:
        object.__setattr__(weights, "bits", bits)  # frozen: set once, before anyone reads it
    return weights


def embedding_names(model: nn.Module, recipe: Recipe, linears: Collection[str] = ()) -> tuple[str, ...]:
    """Names of the embeddings ``recipe`` quantizes in ``model`` (meta or loaded): none unless
    ``weights.embedding_bits`` is set (``auto`` too: the budget's candidates); else the input embedding and
    an untied LM head (a tied one is the embedding's weight), less any the recipe already quantizes as a
    linear target (``linears``).
    ModelError when the recipe asks for it and the model has no token embedding."""
    if recipe.weights.embedding_bits is None:
        return ()
    found, _tied = embedding_modules(model)
    return tuple(name for name in found if name not in linears)


def embedding_targets(model: nn.Module, names: Collection[str]) -> dict[str, nn.Linear | nn.Embedding]:
    """``names`` (from :func:`embedding_names` on the same architecture) -> the modules of ``model``."""
    found: dict[str, nn.Linear | nn.Embedding] = {}
    for name in names:
        module = model.get_submodule(name)
        if not isinstance(module, (nn.Embedding, nn.Linear)):
            raise TypeError(f"{name} is an embedding on the meta device but a {type(module).__name__} once loaded")
        found[name] = module
    return found


__all__ = ["embedding_recipe", "embedding_names", "embedding_targets"]
