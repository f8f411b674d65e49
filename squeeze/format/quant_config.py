"""config.json's ``quantization_config`` as one typed object: every reader and every writer goes through it.

Modelled on compressed-tensors' ``QuantizationConfig``: :meth:`QuantizationConfig.from_dict` builds it from the
section as stored, :meth:`QuantizationConfig.to_dict` gives back exactly what :func:`json.dumps` writes (the
same keys, the same values: an artifact's bytes do not change when a config goes through the type).

``strict=True`` (every loader): the section is squeeze's, its ``format_version`` is the one this squeeze reads
(:func:`check_format_version`, the one message all loaders give), ``modules`` maps module names to entries
with a string ``method``, ``embeddings`` and ``kv_cache`` are objects. Everything else a module entry holds is
its weight format's (squeeze.quant.schemes checks it when it rebuilds the weight). ``strict=False`` (inspect,
memory estimates: unverified input summarised, never refused): nothing raises, junk reads as absent.

Typed entries, each validated once here (a loader then iterates them and trusts their fields):
:class:`ModuleEntry` (one quantized module) and :class:`KVCacheEntry` (the calibrated KV cache; its per-layer
layout is squeeze.quant.kv_spec.KVSpec's, as this package imports nothing above it), both in
squeeze.format.quant_entries; :class:`EmbeddingsEntry` (quantized token embeddings and tied LM heads),
:class:`RecipeSummary` (the recipe's options and measured bits per weight that ``squeeze compress`` records).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from squeeze.errors import FormatError
from squeeze.format.quant_entries import KVCacheEntry, ModuleEntry
from squeeze.limits import is_int

#: Version of the layout of ``quantization_config`` and the tensors it names; readers refuse any other.
FORMAT_VERSION = 1
#: ``quantization_config.quant_method`` of every squeeze artifact: what transformers dispatches on.
QUANT_METHOD = "squeeze"
#: config.json's key of the section.
SECTION = "quantization_config"
#: ``method`` of an artifact whose weights are not quantized (calibrate-kv on a plain model).
UNQUANTIZED_METHOD = "none"


def check_format_version(version: object) -> None:
    """FormatError unless ``version`` is the :data:`FORMAT_VERSION` this squeeze reads: the one check (and the
    one message) of every loader."""
    if version != FORMAT_VERSION or isinstance(version, bool):
        shown = "missing" if version is None else f"{version!r}"[:40]
        raise FormatError(
            f"{SECTION}.format_version is {shown}; this squeeze reads {FORMAT_VERSION}",
            hint="install the squeeze version that wrote the artifact, or re-create it with this one",
        )


@dataclass(frozen=True)
class EmbeddingsEntry:
    """``quantization_config.embeddings``: the quantized token embeddings (``modules``), their width (``bits``:
    one int, or {module: bits} when an untied input embedding and LM head got different widths) and, for a
    tied model, which quantized embedding each LM head reads (``tied``: head name -> embedding name)."""

    bits: int | Mapping[str, int] | None
    modules: tuple[str, ...] = ()
    tied: Mapping[str, str] = field(default_factory=dict)
    #: the entry as stored, for an exact round trip (keys this squeeze does not name included)
    raw: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def build(cls, bits: int | Mapping[str, int], modules: list[str], tied: Mapping[str, str]) -> EmbeddingsEntry:
        """The entry ``squeeze compress`` writes."""
        raw = {"bits": copy.deepcopy(bits), "modules": list(modules), "tied": dict(tied)}
        return cls(bits=bits, modules=tuple(modules), tied=dict(tied), raw=raw)

    @classmethod
    def from_dict(cls, value: object, *, strict: bool = True) -> EmbeddingsEntry | None:
        if not isinstance(value, dict):
            if strict:
                raise FormatError(f"config.json: {SECTION}.embeddings must be an object")
            return None
        tied = value.get("tied", {})
        if not isinstance(tied, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in tied.items()):
            if strict:
                raise FormatError(f"config.json: {SECTION}.embeddings.tied must map module names to module names")
            tied = {}
        modules = value.get("modules")
        if (
            strict
            and modules is not None
            and not (isinstance(modules, list) and all(isinstance(name, str) for name in modules))
        ):
            raise FormatError(f"config.json: {SECTION}.embeddings.modules must be a list of module names")
        names = tuple(str(m) for m in modules) if isinstance(modules, list) else ()
        bits = value.get("bits")
        return cls(
            bits=bits if is_int(bits) or isinstance(bits, dict) else None,
            modules=names,
            tied=dict(tied),
            raw=copy.deepcopy(value),
        )

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(dict(self.raw))


@dataclass(frozen=True)
class RecipeSummary:
    """What ``squeeze compress`` records of its recipe (informational: no loader reads it). ``bits`` None for a
    bits-per-weight budget (``target_bpw``: each module entry carries its own width); ``bits_per_weight``: the
    measured average over the quantized modules (LUTs, sparse entries and packing counted)."""

    bits: int | None
    target_bpw: float | None
    sensitive_fraction: float | None
    outlier_fraction: float | None
    sensitivity: str | None
    group_size: int | None
    lut_dtype: str | None
    bits_per_weight: float | None

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_dict(cls, section: Mapping[str, Any]) -> RecipeSummary | None:
        """The summary when ``section`` has all its keys (as compress writes it), else None (they stay extra)."""
        if not all(key in section for key in cls.keys()):
            return None
        return cls(**{key: copy.deepcopy(section[key]) for key in cls.keys()})


#: The keys the typed fields own; any other key of a stored section is kept verbatim in ``extra``.
_OWN_KEYS = frozenset(
    {"quant_method", "format_version", "squeeze_version", "method", "modules", "embeddings", "kv_cache"}
    | {"unquantized_dtype"}
)


@dataclass(frozen=True)
class QuantizationConfig:
    """config.json's ``quantization_config`` of a squeeze artifact (see the module docstring).

    ``method``: the recipe's weight method ("lut", "rtn", ...; :data:`UNQUANTIZED_METHOD` when only the KV
    cache is quantized). ``modules``: module name -> :class:`ModuleEntry`. ``unquantized_dtype``: the dtype
    every unquantized tensor is stored in (None: float32, as older artifacts stored them). ``kv_cache``: the
    calibrated KV cache's entry (squeeze.quant.kv_spec.KVSpec.from_config reads it), None when uncalibrated.
    ``extra``: keys this squeeze does not name, kept for an exact round trip.
    """

    format_version: int = FORMAT_VERSION
    squeeze_version: str | None = None
    method: str | None = None
    modules: Mapping[str, ModuleEntry] = field(default_factory=dict)
    summary: RecipeSummary | None = None
    unquantized_dtype: str | None = None
    embeddings: EmbeddingsEntry | None = None
    kv_cache: KVCacheEntry | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    quant_method: str = QUANT_METHOD

    # -- reading ---------------------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, section: object, *, strict: bool = True) -> QuantizationConfig:
        """The typed section from its stored dict (see the module docstring for ``strict``)."""
        if not isinstance(section, dict):
            if strict:
                raise FormatError(f"config.json: {SECTION} must be an object")
            return cls(format_version=0, quant_method="")
        method_tag = section.get("quant_method")
        if strict:
            if method_tag != QUANT_METHOD:
                raise FormatError(f"{SECTION}.quant_method is {method_tag!r}, not {QUANT_METHOD!r}"[:200])
            check_format_version(section.get("format_version"))
        return cls(
            format_version=v if is_int(v := section.get("format_version")) else 0,
            squeeze_version=_str_or_none(section.get("squeeze_version")),
            method=_str_or_none(section.get("method")),
            modules=module_entries(section.get("modules", {}), strict=strict),
            summary=RecipeSummary.from_dict(section),
            unquantized_dtype=_str_or_none(section.get("unquantized_dtype")),
            embeddings=EmbeddingsEntry.from_dict(e, strict=strict)
            if (e := section.get("embeddings")) is not None
            else None,
            kv_cache=KVCacheEntry.from_dict(kv, strict=strict) if (kv := section.get("kv_cache")) is not None else None,
            extra=copy.deepcopy(_extra(section)),
            quant_method=method_tag if isinstance(method_tag, str) else "",
        )

    @classmethod
    def from_model_config(cls, config: Mapping[str, Any] | None, *, strict: bool = True) -> QuantizationConfig | None:
        """The section of a config.json dict, or None when it has none (or, ``strict=False``, when it is not
        squeeze's or not an object). With ``strict``, a section whose ``quant_method`` is not squeeze's is also
        None (another tool's checkpoint), while a squeeze section is checked in full."""
        section = config.get(SECTION) if isinstance(config, Mapping) else None
        if section is None:
            return None
        if not isinstance(section, dict):
            if strict:
                raise FormatError(f"config.json: {SECTION} must be an object")
            return None
        if section.get("quant_method") != QUANT_METHOD:
            return None
        return cls.from_dict(section, strict=strict)

    # -- writing ---------------------------------------------------------------------------------------------

    @classmethod
    def unquantized(cls, squeeze_version: str) -> QuantizationConfig:
        """The section of an artifact whose weights are not quantized (calibrate-kv on a plain model)."""
        return cls(squeeze_version=squeeze_version, method=UNQUANTIZED_METHOD)

    def with_kv_cache(self, entry: Mapping[str, Any]) -> QuantizationConfig:
        """This section with its ``kv_cache`` entry set (what calibrate-kv writes)."""
        return replace(self, kv_cache=KVCacheEntry.from_dict(dict(entry)))

    def to_dict(self) -> dict[str, Any]:
        """The section as config.json stores it: ``from_dict(d).to_dict() == d`` for every section a squeeze
        wrote (and every strict one), so rewriting a config through the type changes no byte."""
        out: dict[str, Any] = copy.deepcopy(dict(self.extra))
        out["quant_method"] = self.quant_method
        out["format_version"] = self.format_version
        if self.squeeze_version is not None:
            out["squeeze_version"] = self.squeeze_version
        if self.method is not None:
            out["method"] = self.method
        if self.summary is not None:
            out.update({key: copy.deepcopy(getattr(self.summary, key)) for key in RecipeSummary.keys()})
        out["modules"] = {name: entry.to_dict() for name, entry in self.modules.items()}
        if self.unquantized_dtype is not None:
            out["unquantized_dtype"] = self.unquantized_dtype
        if self.embeddings is not None:
            out["embeddings"] = self.embeddings.to_dict()
        if self.kv_cache is not None:
            out["kv_cache"] = self.kv_cache.to_dict()
        return out

    # -- what loaders ask --------------------------------------------------------------------------------------

    @property
    def tied_heads(self) -> dict[str, str]:
        """LM head name -> the quantized embedding it reads (empty unless a tied embedding is quantized)."""
        return dict(self.embeddings.tied) if self.embeddings is not None else {}


def _str_or_none(value: object) -> str | None:
    return value if isinstance(value, str) else None


def module_entries(value: object, *, strict: bool = True) -> Mapping[str, ModuleEntry]:
    """``quantization_config.modules`` (name -> entry dict) as typed entries, read-only."""
    if not isinstance(value, dict):
        if strict:
            raise FormatError(f"{SECTION}.modules must map module names to objects")
        return {}
    return {str(name): ModuleEntry.from_dict(str(name), spec, strict=strict) for name, spec in value.items()}


def _extra(section: Mapping[str, Any]) -> dict[str, Any]:
    """The keys no typed field owns (the summary's, when it is incomplete, included)."""
    summary = set(RecipeSummary.keys()) if RecipeSummary.from_dict(section) is not None else set()
    return {key: value for key, value in section.items() if key not in _OWN_KEYS and key not in summary}


__all__ = [
    "FORMAT_VERSION",
    "QUANT_METHOD",
    "SECTION",
    "UNQUANTIZED_METHOD",
    "check_format_version",
    "QuantizationConfig",
    "ModuleEntry",
    "KVCacheEntry",
    "EmbeddingsEntry",
    "RecipeSummary",
    "module_entries",
]
