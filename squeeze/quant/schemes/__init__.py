"""The weight-format registry: every on-disk format of a quantized linear, one class each.

Built in: ``lut`` (SqueezeLLM, fp16 LUT), ``lut8`` (8-bit LUT on a per-row affine grid), ``rtn``
(round-to-nearest baseline). A new format is one :class:`WeightFormat` subclass passed to
:func:`register_format`; recipes (``weights.method``), compress, preflight, inspect, both loaders and the
runtime then handle it with no other change.

Lookups:
* :func:`format_for_recipe` - the format a recipe's weights section selects (``method`` plus the
  format's ``recipe_match``, e.g. ``lut_dtype``);
* :func:`format_for_module` - the format of an artifact's module entry (its ``method``, told apart by
  the dtypes of the stored roles where several formats share a method).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from squeeze.quant.schemes.base import QuantOptions, WeightFormat
from squeeze.quant.schemes.lut import Lut8Weight, LutWeight
from squeeze.quant.schemes.roles import Role
from squeeze.quant.schemes.rtn import RtnWeight

_FORMATS: dict[str, type[WeightFormat]] = {}


def register_format(cls: type[WeightFormat]) -> type[WeightFormat]:
    """Add a format (usable as a class decorator). ValueError if its name is taken by another class."""
    existing = _FORMATS.get(cls.name)
    if existing is not None and existing is not cls:
        raise ValueError(f"weight format {cls.name!r} is already registered ({existing.__qualname__})")
    _FORMATS[cls.name] = cls
    return cls


def unregister_format(name: str) -> None:
    """Remove a format (tests that register a toy format clean up with this)."""
    _FORMATS.pop(name, None)


def formats() -> tuple[type[WeightFormat], ...]:
    """Every registered format, in registration order."""
    return tuple(_FORMATS.values())


def methods() -> tuple[str, ...]:
    """The method names recipes and artifacts may use, in registration order."""
    return tuple(dict.fromkeys(cls.method for cls in _FORMATS.values()))


def recipe_options() -> frozenset[str]:
    """Every recipe key some format uses (a key no format of the chosen method uses must keep its default)."""
    return frozenset().union(*(cls.recipe_options for cls in _FORMATS.values()))


def stored_roles() -> tuple[str, ...]:
    """Every tensor-name suffix a quantized weight may store, over all formats."""
    return tuple(dict.fromkeys(role.name for cls in _FORMATS.values() for role in cls.roles))


def formats_of(method: str) -> tuple[type[WeightFormat], ...]:
    return tuple(cls for cls in _FORMATS.values() if cls.method == method)


def format_for_recipe(options: Any) -> type[WeightFormat] | None:
    """The format ``options`` (a recipe's weights: ``method`` and the keys of ``recipe_match``) selects."""
    method = getattr(options, "method", None)
    for cls in formats_of(method) if isinstance(method, str) else ():
        if all(getattr(options, key, None) == value for key, value in cls.recipe_match.items()):
            return cls
    return None


def format_for_module(method: object, dtypes: Mapping[str, torch.dtype]) -> type[WeightFormat] | None:
    """The format of an artifact module entry: its ``method``; among several formats of one method, the one
    whose always-stored roles best match ``dtypes`` (role -> dtype of the stored tensors): fewest dtype
    mismatches, then fewest missing roles (its checks then name what is wrong). None for an unknown method."""
    candidates = formats_of(method) if isinstance(method, str) else ()
    if not candidates:
        return None

    def mismatch(cls: type[WeightFormat]) -> tuple[int, int]:
        fixed = [role for role in cls.roles if not role.part and isinstance(role.dtype, torch.dtype)]
        wrong = sum(1 for role in fixed if role.name in dtypes and dtypes[role.name] != role.dtype)
        missing = sum(1 for role in cls.roles if not role.part and role.name not in dtypes)
        return wrong, missing

    return min(candidates, key=mismatch)  # min keeps the first of equals: registration order decides ties


for _cls in (LutWeight, Lut8Weight, RtnWeight):
    register_format(_cls)

QuantizedWeight = WeightFormat

__all__ = [
    "WeightFormat",
    "Role",
    "QuantOptions",
    "QuantizedWeight",
    "LutWeight",
    "Lut8Weight",
    "RtnWeight",
    "register_format",
    "unregister_format",
    "formats",
    "methods",
    "recipe_options",
    "stored_roles",
    "formats_of",
    "format_for_recipe",
    "format_for_module",
]
