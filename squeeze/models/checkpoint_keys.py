"""Which checkpoint tensor each of a model's parameters is read from, and what is missing or left over.

A checkpoint that does not match its config.json (a layer fewer, a layer more, ``num_hidden_layers`` left to
transformers' default of 32) is loaded by transformers with the missing weights freshly initialised and the
extra ones dropped, with a log line at most; squeeze would then seal random layers. :func:`match_checkpoint`
maps every parameter of the model (built from the config, on the meta device) to its tensor by name, from
the safetensors headers alone: under its state-dict name, a name transformers renames on load (Mixtral's
``block_sparse_moe``), or a fused expert parameter's per-expert tensors. A tied parameter (an LM head sharing
the input embedding) is found under any of its names, so a checkpoint that omits ``lm_head.weight`` of a
tied model misses nothing; persistent buffers and the model's own ignore patterns (rotary ``inv_freq``,
``position_ids``) are never unexpected. :func:`check_checkpoint_keys` is preflight's use of it;
:func:`mismatch_error` the one refusal (the loaders raise it too, from transformers' own loading report).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import safe_open
from torch import nn

from squeeze.errors import ModelError
from squeeze.models.config_bounds import defaulted_size_keys, describe_defaults, weight_files

if TYPE_CHECKING:  # a type only: squeeze.models.source imports this module when it loads a model
    from squeeze.models.source import ModelSource

#: module names transformers renames on load (checkpoint name, model name): Mixtral's MoE block
SAVED_RENAMES = ((".block_sparse_moe.", ".mlp."),)

#: a fused expert parameter -> the per-expert tensors it is made of, in order, under each naming in use
#: (gate/up/down: Qwen2/3-MoE, DeepSeek-V3, GLM-4-MoE; w1/w3/w2: Mixtral)
EXPERT_SOURCES = {
    "gate_up_proj": (("gate_proj", "up_proj"), ("w1", "w3")),
    "down_proj": (("down_proj",), ("w2",)),
    "gate_proj": (("gate_proj",), ("w1",)),
    "up_proj": (("up_proj",), ("w3",)),
}

#: Tensors old checkpoints hold that transformers drops on load for every model with such a buffer.
_ALWAYS_IGNORED = (r"rotary_emb\.inv_freq", r"(^|\.)position_ids$")

#: How many names a refusal lists.
_SHOWN = 4


@dataclass
class KeyMatch:
    """Every parameter of a model matched against a checkpoint's tensor names.

    ``keys``: meta parameter id -> the name it is read under (a tie: the first of its names the checkpoint
    holds); ``aliases``: parameter name -> the checkpoint name it is saved under; ``parts``: fused expert
    parameter name -> per expert, the tensors concatenated into it; ``missing`` / ``unexpected``: sorted names.
    """

    keys: dict[int, str] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    parts: dict[str, list[list[str]]] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)


def tensor_files(directory: Path) -> dict[str, Path]:
    """Every tensor name of the checkpoint's safetensors files (:func:`weight_files`) -> the file holding it
    (headers only)."""
    files: dict[str, Path] = {}
    for path in weight_files(directory):
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                files.setdefault(key, path)
    return files


def saved_names(key: str) -> list[str]:
    """``key`` and the names a checkpoint may store it under (transformers' renamings, undone)."""
    return [key] + [key.replace(model, saved) for saved, model in SAVED_RENAMES if model in key]


def expert_parts(key: str, meta: nn.Parameter, files: Collection[str]) -> list[list[str]] | None:
    """For a 3-D expert parameter ``key`` (``....experts.gate_up_proj``) absent from the checkpoint, the source
    keys of its per-expert 2-D tensors (expert e: ``....experts.{e}.gate_proj.weight``, then the up one), or None
    when the checkpoint has no complete such set."""
    prefix, _, attr = key.rpartition(".")
    if meta.ndim != 3 or attr not in EXPERT_SOURCES:
        return None
    for names in EXPERT_SOURCES[attr]:
        parts = [[f"{prefix}.{e}.{name}.weight" for name in names] for e in range(meta.shape[0])]
        if all(k in files for keys in parts for k in keys):
            return parts
    return None


def match_checkpoint(model: nn.Module, files: Collection[str]) -> KeyMatch:
    """Match ``model``'s parameters (meta or real) against the checkpoint tensor names ``files``."""
    match = KeyMatch()
    names: dict[int, list[str]] = {}  # every state-dict name of each parameter (a tie has several)
    metas: dict[int, nn.Parameter] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for attr, param in module._parameters.items():
            if param is None:
                continue
            pid, key = id(param), f"{module_name}.{attr}" if module_name else attr
            names.setdefault(pid, []).append(key)
            metas[pid] = param
            if pid not in match.keys or (match.keys[pid] not in files and key in files):
                match.keys[pid] = key
    for pid, key in match.keys.items():
        if key in files:
            continue
        for alias in saved_names(key):
            if alias in files:
                match.aliases[key] = alias
            elif (parts := expert_parts(alias, metas[pid], files)) is not None:
                match.parts[key] = parts
            if key in match.aliases or key in match.parts:
                break
    found = lambda key: key in files or key in match.aliases or key in match.parts  # noqa: E731
    ignore_missing = _patterns(getattr(model, "_keys_to_ignore_on_load_missing", None))
    match.missing = sorted(k for k in match.keys.values() if not found(k) and not _matches(ignore_missing, k))
    used = {n for group in names.values() for n in group}
    used.update(match.aliases.values())
    used.update(k for parts in match.parts.values() for keys in parts for k in keys)
    used.update(name for name, _ in model.named_buffers())  # persistent buffers are saved with the weights
    ignore_unexpected = _patterns(getattr(model, "_keys_to_ignore_on_load_unexpected", None)) + _ALWAYS_IGNORED
    match.unexpected = sorted(k for k in files if k not in used and not _matches(ignore_unexpected, k))
    return match


def _natural(key: str) -> list[tuple[int, str]]:
    """Sort key reading digit runs as numbers: ``layers.2`` before ``layers.10``."""
    return [(int(part), "") if part.isdigit() else (-1, part) for part in re.split(r"(\d+)", key)]


def _patterns(found: Iterable[str] | None) -> tuple[str, ...]:
    return tuple(found or ())


def _matches(patterns: tuple[str, ...], key: str) -> bool:
    return any(re.search(pattern, key) for pattern in patterns)


def mismatch_error(where: str, missing: Collection[str], unexpected: Collection[str], defaults: str = "") -> ModelError:
    """The refusal of a checkpoint whose weights do not match its config: a few names of each kind, and what
    to do (``defaults``: the size keys config.json left to transformers' defaults, when any)."""
    parts = []
    if missing:
        parts.append(f"{len(missing)} weight(s) missing from the checkpoint: {_some(missing)}")
    if unexpected:
        parts.append(f"{len(unexpected)} weight(s) in the checkpoint but not in the architecture: {_some(unexpected)}")
    fix = "use the complete checkpoint this config.json belongs to"
    if defaults:
        hint = f"config.json does not name {defaults}: add the checkpoint's values, or {fix}"
    else:
        hint = f"make config.json describe the checkpoint (num_hidden_layers and the other sizes), or {fix}"
    return ModelError(f"the checkpoint of {where} does not match its config.json: " + "; ".join(parts), hint=hint)


def _some(keys: Collection[str]) -> str:
    shown = ", ".join(sorted(keys, key=_natural)[:_SHOWN])
    return shown + (f" (and {len(keys) - _SHOWN} more)" if len(keys) > _SHOWN else "")


def has_unknown_renames(model: nn.Module) -> bool:
    """Whether transformers converts this model's checkpoint names in ways :func:`match_checkpoint` does not
    know (a conversion besides the per-expert fusion and Mixtral's rename it handles): then only transformers'
    own loading report (at load) can tell a missing weight."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:  # an older transformers: no conversions at all
        return False
    try:
        transforms: list[Any] = get_model_conversion_mapping(model, add_legacy=False)  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001 - an internal API: when it fails, leave the check to the loader
        return True
    for transform in transforms:
        for pattern in getattr(transform, "source_patterns", ()):
            if ".experts.*." not in pattern and "block_sparse_moe" not in pattern:
                return True
    return False


def check_checkpoint_keys(model: nn.Module, source: ModelSource, config: Any = None) -> None:
    """ModelError (:func:`mismatch_error`) when ``source``'s safetensors lack one of ``model``'s parameters or
    hold a tensor it has no place for; from the headers only, before any work. Sources this cannot read by name
    (GGUF, .bin checkpoints, a config without weights, a model with renames it does not know) pass: their
    loaders check transformers' own loading report."""
    if source.kind == "gguf":
        return
    files = tensor_files(source.directory)
    if not files or has_unknown_renames(model):
        return
    match = match_checkpoint(model, files)
    if match.missing or match.unexpected:
        raise source_mismatch(source, config, match.missing, match.unexpected)


def source_mismatch(
    source: ModelSource, config: Any, missing: Collection[str], unexpected: Collection[str]
) -> ModelError:
    """:func:`mismatch_error` for ``source``, its hint naming the size keys its config.json left to the defaults
    of the built ``config`` (None: none named)."""
    defaults = describe_defaults(defaulted_size_keys(source, config)) if config is not None else ""
    return mismatch_error(source.model_id, missing, unexpected, defaults)


__all__ = [
    "KeyMatch",
    "SAVED_RENAMES",
    "EXPERT_SOURCES",
    "check_checkpoint_keys",
    "expert_parts",
    "has_unknown_renames",
    "match_checkpoint",
    "mismatch_error",
    "saved_names",
    "source_mismatch",
    "tensor_files",
]
