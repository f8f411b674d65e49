"""Strict config values: YAML that refuses a repeated key, a mapping turned into a frozen dataclass (unknown
keys and wrong types rejected, recursively) and back, the canonical hash of the plain form, and byte sizes.

The generic machinery that squeeze.config's recipes and calibration specs are built with.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import fields
from types import UnionType
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

from squeeze.errors import ConfigError

T = TypeVar("T")
#: A dataclass field left out of ``to_plain`` (recipe.yaml, hashes, fingerprints) while it holds its default: a
#: key added later then leaves every older recipe's hash, and the artifacts built from it, byte-identical.
OMIT_DEFAULT = {"omit_default": True}


#: A recipe or calibration spec is a few hundred bytes; this only bounds a wrong file's read.
MAX_YAML_BYTES = 4 * 2**20


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml's SafeLoader, refusing a mapping that repeats a key (``bits: 3`` then ``bits: 4``): plain yaml
    keeps the last one silently, so a recipe would not do what one of its lines says."""


def _construct_unique_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        line = key_node.start_mark.line + 1
        try:
            first = seen.setdefault(key, line)
        except TypeError:  # an unhashable key: construct_mapping reports it
            continue
        if first != line:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} on line {line} (first given on line {first})", key_node.start_mark
            )
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping)


def load_yaml_unique(text: str) -> Any:
    """``yaml.safe_load`` that raises yaml.YAMLError for a duplicate key in any mapping, naming its line."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """The first line of a yaml error, or its problem (which names the line) for a duplicate key."""
    problem = getattr(exc, "problem", None)
    if isinstance(problem, str) and problem.startswith("duplicate key"):
        return problem
    return str(exc).splitlines()[0]


# ----------------------------------------------------------------------------------------------------------
# Generic dict <-> frozen dataclass conversion (strict)


def from_dict(cls: type[T], data: Any, where: str) -> T:
    """Build dataclass ``cls`` from a mapping, rejecting unknown keys and wrong types, recursively."""
    if not isinstance(data, dict):
        raise ConfigError(
            f"{where} must be a mapping, found {type(data).__name__}",
            hint=f"write {where} as indented key: value lines",
        )
    hints = get_type_hints(cls)
    known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(
            f"{where} has unknown key(s) {', '.join(map(repr, unknown))}",
            hint=f"allowed keys: {', '.join(sorted(known))}",
        )
    kwargs = {key: _coerce(hints[key], value, f"{where}.{key}") for key, value in data.items()}
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, where: str) -> Any:
    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where)  # type: ignore[arg-type]
    if origin is Literal:
        allowed = get_args(tp)
        if value not in allowed:
            raise ConfigError(
                f"{where} must be one of {list(allowed)}, found {value!r}",
                hint=f"set {where} to one of {', '.join(map(repr, allowed))}",
            )
        return value
    if origin is tuple:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise ConfigError(
                f"{where} must be a list of strings, found {value!r}", hint=f"write {where} as a list, e.g. [q_proj]"
            )
        return tuple(value)
    if origin in (Union, UnionType):  # Optional[X], or a union (``int | Literal["auto"] | None``)
        args = get_args(tp)
        if type(None) in args and value is None:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _coerce(inner[0], value, where)
        for alternative in inner:  # the first alternative the value is
            try:
                return _coerce(alternative, value, where)
            except ConfigError:
                continue
        wanted = " or ".join(map(_type_name, inner))
        raise ConfigError(f"{where} must be {wanted}, found {value!r}", hint=f"set {where} to {wanted}")
    if tp is bool and isinstance(value, bool):
        return value
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if tp is str and isinstance(value, (str, int)) and not isinstance(value, bool):
        return str(value)
    wanted = getattr(tp, "__name__", str(tp))
    raise ConfigError(
        f"{where} must be of type {wanted}, found {value!r}",
        hint=f"write {where} as a {wanted} (no quotes for numbers)",
    )


def _type_name(tp: Any) -> str:
    """``int``, or the values of a Literal (``'auto'``), for an error message."""
    if get_origin(tp) is Literal:
        return " or ".join(map(repr, get_args(tp)))
    return str(getattr(tp, "__name__", tp))


def to_plain(obj: Any) -> Any:
    """A dataclass tree as plain dicts/lists (for YAML, JSON and hashing)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {
            f.name: to_plain(getattr(obj, f.name))
            for f in fields(obj)
            if not (f.metadata.get("omit_default") and getattr(obj, f.name) == f.default)
        }
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    return obj


def canonical_hash(data: Any) -> str:
    """SHA-256 of the canonical JSON form (sorted keys, no whitespace) of ``data``."""
    blob = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    return hashlib.sha256(blob).hexdigest()


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
    "K": 10**3,
    "M": 10**6,
    "G": 10**9,
}


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string like ``"2GB"``, ``"500MB"``, ``"1GiB"`` (decimal units as transformers)."""
    if isinstance(size, int) and not isinstance(size, bool):
        if size <= 0:
            raise ConfigError(f"a size must be positive, found {size}", hint="write it like 2GB, 500MB or 1GiB")
        return size
    match = _SIZE_RE.match(str(size))
    unit = (match.group(2) or "").upper() if match else None
    if not match or unit not in _UNITS:
        raise ConfigError(f"cannot read size {size!r}", hint="write it like 2GB, 500MB or 1GiB")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ConfigError(
            f"a size must be positive, found {size!r}", hint="write a size above zero, like 2GB, 500MB or 1GiB"
        )
    return value
