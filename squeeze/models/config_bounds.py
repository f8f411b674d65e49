"""A model's config.json sizes, checked against its checkpoint's tensor headers before anything is built.

transformers builds whatever config.json describes: ``num_hidden_layers: 1e12`` (or 1e5) makes
``from_config`` run for minutes and gigabytes before any check of ours could run on the model, and a size key
the file does not name takes the config class's default (32 layers for Llama) without a word. Here, from
config.json and the safetensors headers alone (a few KB read, no tensor): every size key must be a
non-negative integer, a layer count at most the number of tensors in the checkpoint (each layer has at least
one), a width at most the largest dimension of any tensor; without a checkpoint (a plan made from a config
alone) the generous absolute bounds below apply. :func:`defaulted_size_keys` names the size keys the file left
to the defaults (``--plan`` prints them; a checkpoint mismatch names them in its hint).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from squeeze.errors import FormatError, ModelError
from squeeze.format.safetensors_header import parse_safetensors_header, read_header_prefix
from squeeze.models.remote_code import read_small_json

if TYPE_CHECKING:  # a type only: squeeze.models.source imports this module when it loads a model
    from squeeze.models.source import ModelSource

#: Layer counts (each layer holds at least one tensor of the checkpoint).
LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
#: Widths and counts that are some tensor's dimension, or smaller than one (heads, experts).
WIDTH_KEYS = (
    "hidden_size",
    "n_embd",
    "d_model",
    "intermediate_size",
    "n_inner",
    "ffn_dim",
    "moe_intermediate_size",
    "vocab_size",
    "head_dim",
    "num_attention_heads",
    "n_head",
    "num_key_value_heads",
)
#: Expert counts: a fused 3-D expert parameter has them as a dimension, per-expert tensors as a tensor count.
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
#: Context lengths: rotary models hold no tensor of that size, so only the absolute bound applies.
CONTEXT_KEYS = ("max_position_embeddings", "n_positions")

#: Absolute bounds (any checkpoint or none): far past every released model (126 layers, 262k vocabularies,
#: 10M-token contexts), close enough that building the architecture on the meta device stays instant.
MAX_LAYERS = 2048
MAX_WIDTH = 2**22
MAX_EXPERTS = 2**14
MAX_CONTEXT = 2**27

#: The size keys --plan reports when config.json leaves them to transformers' defaults.
REPORTED_DEFAULTS = ("num_hidden_layers", "hidden_size", "intermediate_size", "vocab_size", "num_attention_heads")


@dataclass(frozen=True)
class CheckpointShape:
    """What the safetensors headers of a checkpoint directory say: how many tensors, the largest dimension."""

    tensors: int
    largest_dim: int


#: The checkpoint files transformers loads, as it looks for them: the sharded index, else the one file.
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files transformers loads from ``directory``: those ``model.safetensors.index.json``
    names, else ``model.safetensors``, else every ``*.safetensors`` (a directory only squeeze reads). Other
    safetensors beside an index (Mistral's ``consolidated.safetensors``) are not the model's and are left out."""
    index = read_small_json(directory / INDEX_NAME)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if isinstance(weight_map, dict):
        names = sorted({name for name in weight_map.values() if isinstance(name, str) and "/" not in name})
        return [directory / name for name in names if (directory / name).is_file()]
    if (directory / SINGLE_NAME).is_file():
        return [directory / SINGLE_NAME]
    return sorted(directory.glob("*.safetensors"))


def checkpoint_shape(directory: Path) -> CheckpointShape | None:
    """The tensor count and largest dimension over ``directory``'s safetensors headers (headers only, never a
    tensor); None when it holds no readable safetensors file (a config alone, a .bin checkpoint)."""
    tensors, largest = 0, 0
    for path in weight_files(directory):
        try:
            with path.open("rb") as handle:
                header = parse_safetensors_header(read_header_prefix(handle), path.stat().st_size, path.name)
        except (OSError, FormatError):
            continue  # transformers reports an unreadable checkpoint when it loads it
        tensors += len(header.tensors)
        largest = max([largest, *(d for info in header.tensors.values() for d in info.shape)])
    return CheckpointShape(tensors, largest) if tensors else None


def _sections(config: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """The config and its nested text / language-model sections (multimodal configs), with a prefix each."""
    yield "", config
    for name in ("text_config", "language_config", "llm_config"):
        nested = config.get(name)
        if isinstance(nested, dict):
            yield f"{name}.", nested


def check_config_sizes(source: ModelSource) -> None:
    """ModelError, before any architecture is built, for a size in ``source``'s config.json that is not a
    non-negative integer or is out of bounds (see the module doc). GGUF sources (no config.json) pass."""
    if source.kind == "gguf":
        return
    config = read_small_json(source.directory / "config.json")
    if not isinstance(config, dict):
        return  # transformers reports what is wrong with the file
    shape = checkpoint_shape(source.directory)
    where = f"{source.model_id}'s config.json"
    for prefix, section in _sections(config):
        for key, value in section.items():
            bound = _bound(key, shape)
            if bound is None or value is None:  # null: the config class derives it (GPT-2's n_inner, head_dim)
                continue
            limit, what = bound
            name = prefix + key
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ModelError(
                    f"{where} gives {name} = {value!r}: expected a non-negative integer",
                    hint=f"write {name} as a whole number (the checkpoint's own value), e.g. {name}: 6",
                )
            if value > limit:
                raise ModelError(
                    f"{where} gives {name} = {value:,}, more than {what} ({limit:,})",
                    hint=f"fix {name} in config.json to match the checkpoint's weights",
                )


def _bound(key: str, shape: CheckpointShape | None) -> tuple[int, str] | None:
    """(the largest value ``key`` may take, what that is), or None for a key that is not a size."""
    if key in LAYER_KEYS:
        if shape is not None and shape.tensors < MAX_LAYERS:
            return shape.tensors, "the number of tensors in the checkpoint"
        return MAX_LAYERS, "the most layers squeeze builds"
    if key in WIDTH_KEYS:
        if shape is not None and shape.largest_dim < MAX_WIDTH:
            return shape.largest_dim, "the largest dimension of any tensor in the checkpoint"
        return MAX_WIDTH, "the widest dimension squeeze builds"
    if key in EXPERT_KEYS:
        if shape is not None and max(shape.tensors, shape.largest_dim) < MAX_EXPERTS:
            return max(shape.tensors, shape.largest_dim), "the tensors or largest dimension in the checkpoint"
        return MAX_EXPERTS, "the most experts squeeze builds"
    if key in CONTEXT_KEYS:
        return MAX_CONTEXT, "the longest context squeeze builds"
    return None


def defaulted_size_keys(source: ModelSource, config: Any) -> list[tuple[str, Any]]:
    """The size keys (:data:`REPORTED_DEFAULTS`) ``source``'s config.json does not name, with the value the
    built ``config`` took for each (transformers' default); empty for GGUF sources (sizes from the file)."""
    if source.kind == "gguf":
        return []
    raw = read_small_json(source.directory / "config.json")
    if not isinstance(raw, dict):
        return []
    named = {key for _prefix, section in _sections(raw) for key in section}
    return [
        (key, getattr(config, key))
        for key in REPORTED_DEFAULTS
        if key not in named and getattr(config, key, None) is not None
    ]


def describe_defaults(defaults: list[tuple[str, Any]]) -> str:
    """``num_hidden_layers (default 32), ...`` for a message."""
    return ", ".join(f"{key} (default {value})" for key, value in defaults)


__all__ = [
    "CheckpointShape",
    "check_config_sizes",
    "checkpoint_shape",
    "weight_files",
    "defaulted_size_keys",
    "describe_defaults",
    "MAX_LAYERS",
    "MAX_WIDTH",
    "MAX_EXPERTS",
    "MAX_CONTEXT",
]
