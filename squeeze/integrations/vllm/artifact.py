"""The artifact as the vLLM plugin reads it (no vLLM import): its quantization config checked, its files
verified, its tensors served from exactly the bytes that were hashed.

Everything goes through squeeze's own hardened readers (:mod:`squeeze.format`): no link followed, regular
files only, sizes capped before reading, nothing built from a byte before its file's SHA-256 matched.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from squeeze.errors import FormatError
from squeeze.format.paths import short_repr
from squeeze.format.quant_config import QuantizationConfig
from squeeze.format.signature import check_signature
from squeeze.format.verify import VerifyReport
from squeeze.limits import check_weight_bits, is_int
from squeeze.models import resolve_model
from squeeze.quant.kv_file import KV_FILE
from squeeze.quant.kv_spec import KV_FP8_E4M3, KVSpec, LayerFP8
from squeeze.quant.schemes import formats_of, methods, stored_roles
from squeeze.runtime.artifact_tensors import tensors_from_captured
from squeeze.runtime.experts import experts_layout
from squeeze.runtime.loader import verified_report
from squeeze.runtime.options import LoadOptions


@dataclass(frozen=True)
class ModuleSpecs:
    """``quantization_config.modules`` (checkpoint module name -> its entry), checked once, and for each
    module the roles its tensors store (role -> torch dtype name), read from the verified headers."""

    modules: Mapping[str, Mapping[str, Any]]
    roles: Mapping[str, Mapping[str, str]]


def parse_quant_config(config: Mapping[str, Any]) -> QuantizationConfig:
    """A squeeze ``quantization_config`` checked for vLLM: the checks every loader makes (squeeze's section, a
    format version this squeeze reads, well-formed embeddings: :class:`QuantizationConfig`), then every module
    entry's method registered, its sizes integers and an expert parameter's layout readable. FormatError naming
    the module otherwise."""
    quant = QuantizationConfig.from_dict(dict(config))
    for name, entry in quant.modules.items():
        where = f"quantization_config.modules[{name!r}]"
        spec = entry  # a mapping of the stored keys (ModuleEntry checked their types when it was built)
        if not formats_of(entry.method):
            raise FormatError(
                f"{where}.method is {short_repr(entry.method, 60)}, which this squeeze cannot run",
                hint="this squeeze runs methods " + ", ".join(repr(m) for m in methods()) + "; upgrade squeeze",
            )
        for key in ("bits", "in_features", "out_features"):
            if not is_int(spec.get(key)) or spec[key] < 0:
                raise FormatError(f"{where}.{key} must be an integer >= 0, found {short_repr(spec.get(key))}")
        check_weight_bits(spec["bits"], f"{where}.bits", FormatError, hint=None)
        experts_layout(spec, name)  # an expert parameter's "experts" / "transposed", when present
    return quant


def check_quant_config(config: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The ``modules`` of a squeeze ``quantization_config`` (module name -> entry), checked by
    :func:`parse_quant_config`."""
    return {name: entry.to_dict() for name, entry in parse_quant_config(config).modules.items()}


def embedding_modules(quant: QuantizationConfig) -> list[str]:
    """``quantization_config.embeddings.modules``: the quantized embeddings and untied LM heads (empty when the
    artifact keeps them); :class:`QuantizationConfig` checked their form when it was built."""
    return list(quant.embeddings.modules) if quant.embeddings is not None else []


def checkpoint_renames(model_type: object) -> tuple[tuple[str, str], ...]:
    """(part of an artifact's tensor name, what vLLM's model calls it) pairs for ``model_type``.

    transformers >= 5 renames some modules of a checkpoint as it loads it (Mixtral's ``.block_sparse_moe.``
    becomes ``.mlp.``) and squeeze's artifacts name tensors as the loaded model does, while vLLM's models
    read the names checkpoints have on disk: these pairs are transformers' plain renamings reversed (none
    without transformers' conversion table, or for a model it does not rename)."""
    try:
        from transformers.conversion_mapping import WeightRenaming, get_checkpoint_conversion_mapping
    except ImportError:  # pragma: no cover - transformers < 5 loads checkpoints under their own names
        return ()
    if not isinstance(model_type, str):
        return ()
    pairs = []
    for transform in get_checkpoint_conversion_mapping(model_type) or ():
        if not isinstance(transform, WeightRenaming):
            continue
        sources, targets = list(transform.source_patterns), list(transform.target_patterns)
        plain = len(sources) == len(targets) == 1 and all(_PLAIN.fullmatch(p) for p in (*sources, *targets))
        if plain:  # patterns are regular expressions: only literal ones are reversed
            pairs.append((targets[0], sources[0]))
    return tuple(pairs)


_PLAIN = re.compile(r"\.[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*\.")


def renamed(name: str, renames: tuple[tuple[str, str], ...]) -> str:
    """``name`` with each (squeeze's, vLLM's) part of :func:`checkpoint_renames` replaced."""
    for ours, theirs in renames:
        name = name.replace(ours, theirs)
    return name


def artifact_directory(model: str) -> Path:
    """The local directory of the artifact vLLM was given (a path, or a model in the local HF cache)."""
    return resolve_model(model).directory


def verify(directory: Path, *, capture: bool = False, options: LoadOptions | None = None) -> VerifyReport:
    """The artifact verified against its manifest (IntegrityError otherwise); ``capture`` keeps every file's
    hashed bytes in memory for :func:`verified_tensors`, else only those of the small KV-cache file.

    ``options``: the load options (default: :meth:`LoadOptions.from_env`, since vLLM hands a plugin no options
    of its own: ``$SQUEEZE_PUBLIC_KEY`` names the key). With a ``public_key``, the artifact's ``model.sig``
    must verify with it (IntegrityError otherwise), checked from the digests just computed, before any weight
    is read."""
    options = options if options is not None else LoadOptions.from_env()
    report = verified_report(directory, capture=True if capture else (lambda path: path == KV_FILE))
    if options.public_key is not None:
        check_signature(report, options.public_key)
    return report


def fp8_kv_scales(report: VerifyReport, section: object) -> dict[str, tuple[float, float]]:
    """Attention module -> (k_scale, v_scale) of an artifact calibrated with ``calibrate-kv --bits fp8`` (vLLM's
    ``kv_cache_dtype="fp8"`` reads exactly these), from the verified KV-cache file; empty for any other KV
    calibration (squeeze's int8 / int4 grids, which vLLM cannot use) or none."""
    if not isinstance(section, dict) or section.get("format") != KV_FP8_E4M3:
        return {}
    if KV_FILE not in report.captured:
        raise FormatError(f"quantization_config.kv_cache names fp8 scales, but the artifact has no {KV_FILE}")
    others = [path for path in report.headers if path != KV_FILE]
    spec = KVSpec.from_config(section, tensors_from_captured(report, exclude=others))
    return {
        name: (float(layer.k_scale), float(layer.v_scale))
        for name, layer in zip(spec.names, spec.layers, strict=True)
        if isinstance(layer, LayerFP8)
    }


def module_specs(report: VerifyReport, modules: Mapping[str, Mapping[str, Any]]) -> ModuleSpecs:
    """The module entries with the roles each module stores, from ``report``'s (verified) headers."""
    suffixes = stored_roles()
    roles: dict[str, dict[str, str]] = {name: {} for name in modules}
    for header in report.headers.values():
        for tensor, info in header.tensors.items():
            module, _, role = tensor.rpartition(".")
            if role in suffixes and module in roles:
                roles[module][role] = info.dtype
    missing = [name for name, found in roles.items() if not found]
    if missing:
        raise FormatError(f"quantization_config names module {missing[0]!r}, but the artifact has no tensors of it")
    return ModuleSpecs(modules=dict(modules), roles=roles)


def verified_tensors(report: VerifyReport) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every weight shard, as views into the bytes verification hashed. The KV-cache file
    holds squeeze's own per-channel KV scales, which vLLM's attention does not read: it is left out."""
    yield from tensors_from_captured(report, exclude=(KV_FILE,)).items()


def checkpoint_modules(prefix: str, packed: Mapping[str, list[str]]) -> tuple[str, ...]:
    """The checkpoint modules vLLM's layer ``prefix`` holds: ``model.layers.0.self_attn.qkv_proj`` ->
    its q/k/v projections by the model's ``packed_modules_mapping``; any other layer is itself."""
    parent, _, leaf = prefix.rpartition(".")
    subs = packed.get(leaf)
    if not subs:
        return (prefix,)
    return tuple(f"{parent}.{sub}" if parent else sub for sub in subs)


__all__ = [
    "ModuleSpecs",
    "parse_quant_config",
    "check_quant_config",
    "artifact_directory",
    "verify",
    "module_specs",
    "verified_tensors",
    "fp8_kv_scales",
    "checkpoint_modules",
    "checkpoint_renames",
    "embedding_modules",
    "renamed",
]
