"""The typed entries of ``quantization_config``: one quantized module (:class:`ModuleEntry`) and the calibrated
KV cache (:class:`KVCacheEntry`). squeeze.format.quant_config builds them and re-exports them.

Both are validated once, when built from the stored section (``strict=True``: every loader); the runtime then
trusts their fields. Both are also read-only mappings of the entry as stored (``entry["bits"]``, ``"experts" in
entry``), so code that reads an entry's keys, e.g. a weight format's ``from_spec``, takes them as they are, and
``to_dict()`` gives back exactly the stored object (an artifact's config.json does not change by a byte).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from squeeze.errors import FormatError
from squeeze.limits import is_int

SECTION = "quantization_config"
#: A module entry's keys every weight format shares (``WeightFormat.module_spec``) and those of a 3-D expert
#: parameter; any other key is the format's own (``module_params``, e.g. RTN's ``group_size``).
COMMON_KEYS = ("method", "bits", "in_features", "out_features")
EXPERTS_KEY, TRANSPOSED_KEY = "experts", "transposed"
_HINT = "the artifact's config.json is damaged or not squeeze's: re-create it with squeeze compress"


def _positive(value: object) -> int:
    """An integer dimension from (possibly junk) JSON: the value when a positive integer, else 0."""
    return value if is_int(value) and value > 0 else 0


@dataclass(frozen=True, eq=False)
class ModuleEntry(Mapping[str, Any]):
    """One ``quantization_config.modules`` entry: a quantized linear, embedding, or 3-D expert parameter.

    ``method`` (the format's name), ``bits``, ``in_features``, ``out_features`` (0 when absent: older entries
    may lack it), ``experts`` (E of an expert parameter stored as one (E*out, in) matrix, else 0) and
    ``transposed`` (its (E, in, out) layout; None when the entry does not say); ``params``: the format's own
    keys, which the format checks when it rebuilds the weight. With ``strict=False`` (summaries of unverified
    input) junk reads as 0 / "" and nothing raises.
    """

    method: str = ""
    bits: int = 0
    in_features: int = 0
    out_features: int = 0
    experts: int = 0
    transposed: bool | None = None
    params: Mapping[str, Any] = field(default_factory=dict)
    #: keys present in the stored entry (so a written entry keeps exactly its keys)
    stored: tuple[str, ...] = ()

    @property
    def is_experts(self) -> bool:
        """True for a 3-D expert parameter of a MoE layer (the entry carries ``experts``)."""
        return EXPERTS_KEY in self.stored

    @property
    def n_weights(self) -> int:
        """Weights of this module (out x in; for an expert parameter the entry's sizes cover all its experts)."""
        return self.in_features * self.out_features

    @property
    def layout(self) -> tuple[int, bool] | None:
        """(E, transposed) of a 3-D expert parameter, None for a linear or an embedding."""
        return (self.experts, bool(self.transposed)) if self.is_experts else None

    def format_spec(self) -> dict[str, Any]:
        """The entry without the experts keys: what the weight format's ``from_spec`` reads."""
        return {k: v for k, v in self.to_dict().items() if k not in (EXPERTS_KEY, TRANSPOSED_KEY)}

    @classmethod
    def from_dict(cls, name: str, value: object, *, strict: bool = True) -> ModuleEntry:
        """The typed entry; with ``strict``, FormatError (naming the key, what was expected and found) for a
        missing or mistyped common key."""
        if not isinstance(value, dict):
            if strict:
                raise FormatError(
                    f"{SECTION}.modules must map module names to objects, found {name!r}: {value!r}"[:200]
                )
            return cls()
        if strict:
            _check_module(name, value)
        transposed = value.get(TRANSPOSED_KEY)
        return cls(
            method=method if isinstance(method := value.get("method"), str) else "",
            bits=_positive(value.get("bits")),
            in_features=_positive(value.get("in_features")),
            out_features=_positive(value.get("out_features")),
            experts=_positive(value.get(EXPERTS_KEY)),
            transposed=transposed if isinstance(transposed, bool) else None,
            params={
                k: copy.deepcopy(v) for k, v in value.items() if k not in (*COMMON_KEYS, EXPERTS_KEY, TRANSPOSED_KEY)
            },
            stored=tuple(str(k) for k in value),
        )

    def to_dict(self) -> dict[str, Any]:
        """The entry as stored (its keys, in their order; nested values copied)."""
        fields = {
            "method": self.method,
            "bits": self.bits,
            "in_features": self.in_features,
            "out_features": self.out_features,
            EXPERTS_KEY: self.experts,
            TRANSPOSED_KEY: self.transposed,
        }
        return {key: copy.deepcopy(self.params[key]) if key in self.params else fields[key] for key in self.stored}

    # a read-only mapping of the stored entry
    def __getitem__(self, key: str) -> Any:
        if key not in self.stored:
            raise KeyError(key)
        return self.to_dict()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.stored)

    def __len__(self) -> int:
        return len(self.stored)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mapping) and self.to_dict() == dict(other)

    __hash__ = None  # type: ignore[assignment]


def _check_module(name: str, value: Mapping[str, Any]) -> None:
    where = f"{SECTION}.modules[{name!r}]"
    if not isinstance(value.get("method"), str) or not value.get("method"):
        raise FormatError(
            f"{where}.method must be a string, found {value.get('method')!r} (a weight format's name)"[:200], hint=_HINT
        )
    for key in ("bits", "in_features"):
        if key not in value:
            raise FormatError(f"{where} lacks '{key}' (every module entry has method, bits, in_features)", hint=_HINT)
    for key in ("bits", "in_features", "out_features", EXPERTS_KEY):
        if key in value and not (is_int(value[key]) and value[key] >= 1):
            raise FormatError(f"{where}.{key} must be an integer >= 1, found {value[key]!r}"[:200], hint=_HINT)
    if TRANSPOSED_KEY in value and not isinstance(value[TRANSPOSED_KEY], bool):
        raise FormatError(
            f"{where}.transposed must be true or false, found {value[TRANSPOSED_KEY]!r}"[:200], hint=_HINT
        )
    if TRANSPOSED_KEY in value and EXPERTS_KEY not in value:
        raise FormatError(
            f"{where} has 'transposed' but no 'experts': only an expert parameter has a layout", hint=_HINT
        )


@dataclass(frozen=True, eq=False)
class KVCacheEntry(Mapping[str, Any]):
    """``quantization_config.kv_cache``: the calibrated KV cache. ``format`` ("int", or "fp8_e4m3" for vLLM's
    scales), ``bits`` (8 / 4, or "fp8"), the calibration text's name and spec hash, and the file of its
    tensors; the per-layer layout is squeeze.quant.kv_spec.KVSpec's (``KVSpec.from_config(entry.to_dict(),
    ...)``), read from the entry as stored."""

    format: str = "int"
    bits: int | str | None = None
    calibration: str | None = None
    calibration_hash: str | None = None
    file: str | None = None
    raw: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, value: object, *, strict: bool = True) -> KVCacheEntry | None:
        """The typed entry (None for a non-object with ``strict=False``); with ``strict``, FormatError for a
        non-object or a mistyped key."""
        if not isinstance(value, dict):
            if strict:
                raise FormatError(f"config.json: {SECTION}.kv_cache must be an object", hint=_HINT)
            return None
        strings = ("format", "calibration", "calibration_hash", "file")
        bad = [key for key in strings if key in value and not isinstance(value[key], str)]
        bits = value.get("bits")
        if strict and (bad or not (bits is None or is_int(bits) or isinstance(bits, str))):
            key = bad[0] if bad else "bits"
            raise FormatError(
                f"config.json: {SECTION}.kv_cache.{key} has the wrong type: {value[key]!r}"[:200], hint=_HINT
            )
        text = {key: value[key] if isinstance(value.get(key), str) else None for key in strings}
        return cls(
            format=text["format"] or "int",
            bits=bits if is_int(bits) or isinstance(bits, str) else None,
            calibration=text["calibration"],
            calibration_hash=text["calibration_hash"],
            file=text["file"],
            raw=copy.deepcopy(value),
        )

    def to_dict(self) -> dict[str, Any]:
        """The entry as stored."""
        return copy.deepcopy(dict(self.raw))

    def __getitem__(self, key: str) -> Any:
        return self.raw[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.raw)

    def __len__(self) -> int:
        return len(self.raw)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mapping) and dict(self.raw) == dict(other)

    __hash__ = None  # type: ignore[assignment]


__all__ = ["COMMON_KEYS", "EXPERTS_KEY", "TRANSPOSED_KEY", "KVCacheEntry", "ModuleEntry"]
