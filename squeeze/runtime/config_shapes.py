"""config.json against the artifact's tensors: the loaders' check before any skeleton is built.

The skeleton's size comes from the config alone, so a config that disagrees with the tensors (resealed, or
from another model) must fail cheaply here, not after building (or hanging on) a million layers.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from squeeze.errors import FormatError
from squeeze.format.paths import short_repr

_HINT = "config.json does not belong to these tensors; re-create the artifact"
#: Integer dimensions of a config that size what the skeleton builds (checked before building it).
_DIMENSION_KEYS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
)
#: ``<prefix>.layers.<i>.`` (Llama, Qwen, Mistral, Gemma, NeoX, OPT...) or ``<prefix>.h.<i>.`` (GPT-2, Falcon).
_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)\.")
_EMBEDDING_SUFFIXES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embed_in.weight")


def check_config_shapes(
    config: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], modules: Mapping[str, Mapping[str, Any]]
) -> None:
    """FormatError unless config.json's dimensions agree with the (verified) tensors, before any skeleton.

    ``shapes``: every tensor's name -> shape; ``modules``: quantization_config.modules (name -> spec with
    ``out_features`` / ``in_features``). The skeleton's size comes from the config alone, so a config that
    disagrees with the tensors (resealed, or from another model) must fail here, cheaply, not after
    building (or hanging on) a million layers: layers must be exactly those the tensor names hold, the
    embedding and a dense MLP must have the config's vocab / hidden / intermediate sizes.
    """
    for key in _DIMENSION_KEYS:
        value = config.get(key)
        if isinstance(value, (list, dict)):  # per-layer sizes (a few architectures): the shapes below decide
            continue
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise FormatError(f"config.json: {key} must be a non-negative integer, found {short_repr(value, 60)}")
    _check_layers(config, shapes, modules)
    _check_tensor_dims(config, shapes, modules)


def _check_layers(
    config: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], modules: Mapping[str, Mapping[str, Any]]
) -> None:
    """num_hidden_layers must be exactly the layers the tensor names hold."""
    layers = config.get("num_hidden_layers")
    layers = layers if isinstance(layers, int) else None
    indices = {int(m.group(1)) for name in (*shapes, *modules) if (m := _LAYER_RE.search(name))}
    if layers is not None and indices:
        present = sum(1 for i in indices if i < layers)
        if present != layers:
            raise FormatError(
                f"config.json: num_hidden_layers is {layers}, but the tensors hold {present} of those "
                f"layers (indices {min(indices)}..{max(indices)})",
                hint=_HINT,
            )
    elif layers is not None and layers > len(shapes) + len(modules):  # every layer holds some tensor
        raise FormatError(
            f"config.json: num_hidden_layers is {layers}, more than the artifact's {len(shapes)} tensors could fill",
            hint=_HINT,
        )


def _check_tensor_dims(
    config: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], modules: Mapping[str, Mapping[str, Any]]
) -> None:
    """The embedding, a dense MLP and the LM head must have the config's vocab / hidden / intermediate sizes."""
    for name, shape in shapes.items():
        if name.endswith(_EMBEDDING_SUFFIXES) and len(shape) == 2:
            _expect(config, "vocab_size", shape[0], f"{name} has {shape[0]} rows", _HINT)
            if "word_embed_proj_dim" not in config:  # OPT-style projected embeddings are narrower
                _expect(config, "hidden_size", shape[1], f"{name} has {shape[1]} columns", _HINT)
        elif re.search(r"(?:^|\.)layers\.\d+\.mlp\.down_proj\.weight$", name) and len(shape) == 2:
            _expect(config, "intermediate_size", shape[1], f"{name} has {shape[1]} columns", _HINT)
    for name, spec in modules.items():
        if "experts" in spec:  # a 3-D expert parameter stored as one (E*out, in) matrix
            _check_experts(config, name, spec)
        elif re.search(r"(?:^|\.)layers\.\d+\.mlp\.down_proj$", name):
            _expect(
                config,
                "intermediate_size",
                spec.get("in_features"),
                f"{name} has in_features {short_repr(spec.get('in_features'), 60)}",
                _HINT,
            )
        # a quantized token embedding (embedding_bits) or LM head: one row per token of the vocabulary
        elif f"{name}.weight".endswith(_EMBEDDING_SUFFIXES) or name == "lm_head" or name.endswith(".lm_head"):
            _expect(
                config,
                "vocab_size",
                spec.get("out_features"),
                f"{name} has out_features {short_repr(spec.get('out_features'), 60)}",
                _HINT,
            )
    head = shapes.get("lm_head.weight")
    if head is not None and len(head) == 2:
        _expect(config, "vocab_size", head[0], f"lm_head.weight has {head[0]} rows", _HINT)


#: The config keys of a MoE layer's routed-expert count and of one expert's intermediate size, by family
#: (Qwen2/3-MoE: num_experts; Mixtral, gpt-oss: num_local_experts; DeepSeek-V3, GLM-4-MoE: n_routed_experts).
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
_EXPERT_SIZE_KEYS = ("moe_intermediate_size", "intermediate_size")


def _check_experts(config: Mapping[str, Any], name: str, spec: Mapping[str, Any]) -> None:
    """An expert parameter's entry: E must be the config's expert count, its rows E * out and its columns in,
    with (out, in) = (2 * I, hidden) for ``gate_up_proj`` and (hidden, I) for ``down_proj`` (I: one expert's
    intermediate size). Parameters of other names are checked for E only."""
    found = [spec.get(key) for key in ("experts", "out_features", "in_features")]
    where = f"quantization_config.modules[{short_repr(name, 120)}]"
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in found):
        raise FormatError(
            f"{where}: experts, out_features and in_features must be integers >= 1, found "
            + ", ".join(short_repr(v, 30) for v in found),
            hint=_HINT,
        )
    experts, rows, cols = (int(v or 0) for v in found)  # all ints >= 1 (checked above)
    count_key = next((k for k in _EXPERT_COUNT_KEYS if isinstance(config.get(k), int)), None)
    if count_key is not None and config[count_key] != experts:
        raise FormatError(
            f"config.json: {count_key} is {config[count_key]}, but {where} holds {experts} experts", hint=_HINT
        )
    if rows % experts:
        raise FormatError(f"{where}: out_features {rows} is not a multiple of its {experts} experts", hint=_HINT)
    hidden = config.get("hidden_size")
    size_key = next((k for k in _EXPERT_SIZE_KEYS if isinstance(config.get(k), int)), None)
    if not isinstance(hidden, int) or size_key is None:
        return
    size = config[size_key]
    leaf = name.rpartition(".")[2]
    expected = {"gate_up_proj": (2 * size, hidden), "down_proj": (hidden, size)}.get(leaf)
    if expected is not None and (rows // experts, cols) != expected:
        raise FormatError(
            f"config.json: hidden_size {hidden} and {size_key} {size} make each of {name}'s experts "
            f"{expected[0]} x {expected[1]}, but the artifact's are {rows // experts} x {cols}",
            hint=_HINT,
        )


def _expect(config: Mapping[str, Any], key: str, found: object, what: str, hint: str) -> None:
    value = config.get(key)
    if isinstance(value, int) and value != found:  # absent or per-layer (a list): nothing to compare
        raise FormatError(f"config.json: {key} is {short_repr(value, 60)}, but {what}", hint=_HINT)


__all__ = ["check_config_shapes"]
