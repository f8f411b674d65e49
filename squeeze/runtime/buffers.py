"""Rebuild the buffers a meta-device skeleton could not compute (rotary tables, embedding scales...).

The loader builds the architecture on the meta device and fills parameters and persistent buffers from the
artifact. Non-persistent buffers are in no checkpoint: their constructors compute them from the config
(each rotary embedding's ``inv_freq`` for its rope type, Gemma's ``embed_scale``...), and on meta they
computed nothing. Rather than knowing how each module class is built, a second skeleton of the same class
and config is built with its parameters on meta but its buffers computed on CPU, and every buffer the model
still holds on meta is taken from it by name.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import warnings
from typing import Any, cast

import torch
from torch import nn

from squeeze.errors import FormatError


def meta_buffer_bytes(model: nn.Module) -> int:
    """Bytes the buffers ``model`` still holds on the meta device would take once materialised."""
    return sum(b.numel() * b.element_size() for _, b in model.named_buffers(remove_duplicate=False) if b.is_meta)


def materialise_computed_buffers(model: nn.Module, limit: int) -> None:
    """Give every non-persistent buffer still on meta its value, computed on CPU as the constructor does.

    ``model``: a transformers model (``model.config``) built on the meta device whose parameters and
    persistent buffers were then loaded. FormatError, before anything is allocated, when the meta buffers
    would take more than ``limit`` bytes (a config can ask for tables sized by e.g. max_position_embeddings
    that no tensor of the artifact bounds); FormatError too when any parameter or buffer is still on meta
    afterwards (a persistent one belongs in the artifact). Each buffer keeps the dtype it has in ``model``.
    """
    wanted = {
        name: buffer
        for name, buffer in model.named_buffers(remove_duplicate=False)
        if buffer.is_meta and _is_non_persistent(model, name)
    }
    size = meta_buffer_bytes(model)
    if size > limit:
        raise FormatError(f"config.json asks for {size} bytes of computed buffers, more than the {limit} allowed")
    if wanted:
        fresh = dict(buffer_skeleton(model).named_buffers(remove_duplicate=False))
        for name, meta in wanted.items():
            value = fresh.get(name)
            if value is None or value.is_meta:
                continue  # reported with the other leftovers below
            if value.shape != meta.shape:
                raise ValueError(f"{name}: the rebuilt buffer is {tuple(value.shape)}, the model's {tuple(meta.shape)}")
            module_name, _, leaf = name.rpartition(".")
            model.get_submodule(module_name)._buffers[leaf] = value.to(meta.dtype)  # stays non-persistent
    leftovers = [
        n
        for n, t in (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False))
        if t.is_meta
    ]
    if leftovers:
        raise FormatError(f"artifact lacks tensors the architecture needs: {leftovers[:3]}")


def buffer_skeleton(model: nn.Module) -> nn.Module:
    """A second ``type(model)`` built from a copy of ``model.config``: parameters on meta, buffers on CPU.

    Parameters are moved to meta as each is registered (accelerate's ``init_empty_weights`` without
    buffers, with weight initialisation off), so the build allocates only the architecture's buffers.
    The patch of ``nn.Module.register_parameter`` is process-wide while the skeleton is built.
    """
    from accelerate import init_empty_weights

    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(f"{type(model).__name__} has no config: only transformers models can be rebuilt")
    cls: Any = type(model)
    build = cls._from_config if hasattr(cls, "_from_config") else cls
    with torch.device("cpu"), init_empty_weights(include_buffers=False), no_init_weights(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build(copy.deepcopy(config))  # a copy: _from_config writes the resolved dtype into it


def no_init_weights() -> contextlib.AbstractContextManager[Any]:
    """transformers' context that skips weight initialisation (a no-op context if this version lacks it)."""
    for where in ("transformers.initialization", "transformers.modeling_utils"):  # 5.x, then 4.x
        try:
            skip = getattr(importlib.import_module(where), "no_init_weights", None)
        except ImportError:
            continue
        if skip is not None:
            return cast(contextlib.AbstractContextManager[Any], skip())
    return contextlib.nullcontext()


def _is_non_persistent(model: nn.Module, name: str) -> bool:
    module_name, _, leaf = name.rpartition(".")
    return leaf in model.get_submodule(module_name)._non_persistent_buffers_set


__all__ = ["materialise_computed_buffers", "buffer_skeleton", "meta_buffer_bytes", "no_init_weights"]
