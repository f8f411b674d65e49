"""The one artifact writer: compress and calibrate-kv build their artifacts with these functions.

An artifact is written into a staging directory in a fixed order: tensors into size-capped shards (each
storage once: tied weights share it), then config.json with its ``quantization_config`` header, the
generation config, the tokenizer and (for compress) the recipe, and sealed last: the manifest hashes
every file, and an artifact without one is not an artifact. Where the staging directory lives and how it
replaces an older artifact is the caller's (see publish.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as safetensors_save
from torch import nn

from squeeze.format.atomic import atomic_write_bytes, atomic_write_text
from squeeze.format.manifest import Manifest, Provenance
from squeeze.format.quant_config import FORMAT_VERSION, QUANT_METHOD, SECTION, QuantizationConfig
from squeeze.format.shards import SHARD_METADATA, ShardIndex, ShardWriter
from squeeze.format.verify import seal_artifact
from squeeze.version import __version__

CONFIG_NAME = "config.json"


def quantization_header() -> dict[str, Any]:
    """The keys every squeeze ``quantization_config`` starts with: method tag, format and writer version."""
    header = QuantizationConfig(squeeze_version=__version__).to_dict()
    del header["modules"]
    return header


def with_quantization(config: Mapping[str, Any], quant: QuantizationConfig) -> dict[str, Any]:
    """A config.json dict (a copy) carrying ``quant`` as its ``quantization_config``: the one place a writer
    puts the section into a config."""
    return {**config, SECTION: quant.to_dict()}


def unique_tensors(state: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """``state`` (a state dict) in its order, each storage once: a tied weight goes under its first name.

    Empty tensors are always kept: they own no storage, so their data pointers say nothing.
    """
    seen: set[int] = set()
    for key, tensor in state.items():
        if tensor.numel() and tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        yield key, tensor


def state_bytes(model: nn.Module, dtype: torch.dtype | None = None) -> int:
    """Bytes of ``model``'s state dict, tied weights once: as held in memory, or with every floating tensor
    in ``dtype`` (e.g. the source checkpoint's bfloat16)."""
    return sum(
        t.numel() * (dtype.itemsize if dtype is not None and t.is_floating_point() else t.element_size())
        for _, t in unique_tensors(model.state_dict())
    )


def write_tensors(staging: Path, tensors: Iterable[tuple[str, torch.Tensor]], max_shard_bytes: int) -> ShardIndex:
    """Stream ``(name, tensor)`` pairs into shards plus their index; on any error no shard is left behind."""
    with ShardWriter(staging, max_shard_bytes) as writer:
        for name, tensor in tensors:
            writer.add(name, tensor)
        return writer.close()


def write_tensor_file(staging: Path, name: str, tensors: dict[str, torch.Tensor]) -> None:
    """One small safetensors file outside the shards (e.g. the KV scales), with the shards' metadata."""
    atomic_write_bytes(staging / name, safetensors_save(tensors, metadata=dict(SHARD_METADATA)))


def config_json(config: Mapping[str, Any]) -> str:
    """config.json's text: sorted keys, so the same config always gives the same bytes."""
    return json.dumps(config, indent=2, sort_keys=True, default=str) + "\n"


def write_config(staging: Path, config: Mapping[str, Any]) -> None:
    atomic_write_text(staging / CONFIG_NAME, config_json(config))


def write_model_files(staging: Path, model: nn.Module, tokenizer: Any) -> None:
    """The generation config (when the model has one) and the tokenizer's files, as transformers saves them."""
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        atomic_write_text(staging / "generation_config.json", generation.to_json_string(use_diff=True))
    tokenizer.save_pretrained(str(staging))


def write_recipe(staging: Path, recipe_yaml: str) -> None:
    atomic_write_text(staging / "recipe.yaml", recipe_yaml)


def seal(staging: Path, provenance: Provenance) -> Manifest:
    """Hash every file in ``staging`` and write its manifest: the artifact's commit point."""
    return seal_artifact(staging, provenance)


__all__ = [
    "FORMAT_VERSION",
    "QUANT_METHOD",
    "quantization_header",
    "with_quantization",
    "unique_tensors",
    "state_bytes",
    "write_tensors",
    "write_tensor_file",
    "config_json",
    "write_config",
    "write_model_files",
    "write_recipe",
    "seal",
]
