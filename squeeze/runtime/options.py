"""Load and KV-cache options: checked once, when built (ConfigError naming the CLI flag), trusted afterwards.

:class:`LoadOptions` is what every loader takes (``squeeze.load`` and so ``run`` / ``eval`` / ``serve``, the
transformers ``from_pretrained`` integration through :func:`squeeze.runtime.hf.loading`, the vLLM plugin
through ``$SQUEEZE_PUBLIC_KEY``): verification, the weights' path (dense cache, low memory, activation
precision), the memory check, the public key a signature must verify with, and the device. :class:`KVOptions`
says which KV cache a run uses. The CLI builds them from its flags, ``squeeze.api`` passes them on, the
runtime reads their fields without checking them again. (Sampling: squeeze.runtime.sampling_params.)

Torch-free at import: the checks that need torch or the key file import them when an object is built.
"""

from __future__ import annotations

import copy
import inspect
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from squeeze.errors import ConfigError
from squeeze.runtime.activations import DEFAULT_ACTIVATIONS, Activations, check_activations

if TYPE_CHECKING:
    import torch
    from torch import nn

    from squeeze.quant.kv_spec import KVSpec

#: Environment variable naming the public key (PEM) loaders outside squeeze's own calls check signatures with.
PUBLIC_KEY_ENV = "SQUEEZE_PUBLIC_KEY"

_T = TypeVar("_T")


@dataclass(frozen=True)
class LoadOptions:
    """How an artifact is loaded. ``verify``: hash every byte against the manifest while loading (default).
    ``dense_cache``: cache every weight dequantized (fastest prefill, ~8x the memory at 4 bits);
    ``low_memory``: never build dense weights (contradicts ``dense_cache``). ``check_memory``: refuse a load
    that does not fit the available memory. ``public_key`` (PEM, EC): the artifact's ``model.sig`` must be a
    signature by this key over the verified bytes (needs ``verify``). ``activations``: the native LUT
    kernels' activation precision ("float32" or "int8"). ``device``: "cpu", "cuda" or "cuda:N"."""

    verify: bool = True
    dense_cache: bool = False
    low_memory: bool = False
    check_memory: bool = True
    public_key: str | os.PathLike[str] | None = None
    activations: Activations = DEFAULT_ACTIVATIONS
    device: str = "cpu"
    #: ``device`` resolved (set when built)
    torch_device: torch.device = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_load(self)

    @classmethod
    def build(cls, options: LoadOptions | None = None, keywords: Mapping[str, Any] | None = None) -> LoadOptions:
        """``options`` as given, or built from ``keywords`` (the loaders' keyword arguments); not both."""
        return _build(cls, options, keywords or {})

    @classmethod
    def from_env(cls, **keywords: Any) -> LoadOptions:
        """Options for a loader squeeze does not call itself (the vLLM plugin): ``public_key`` from
        ``$SQUEEZE_PUBLIC_KEY`` when it is set and not given."""
        key = os.environ.get(PUBLIC_KEY_ENV)
        if key and "public_key" not in keywords:
            keywords["public_key"] = key
        return cls(**keywords)

    def staged_on_host(self) -> LoadOptions:
        """These options for the host-side load of a model that then moves to ``device`` (a GPU): the CPU, no
        memory check of their own (the loader checked the host already), and the dense (or, with ``low_memory``,
        chunked) weights a device runs, since the native CPU kernels do not run there. A copy of options that
        were checked when built: not checked again."""
        staged = copy.copy(self)
        for name, value in (
            ("dense_cache", self.dense_cache or not self.low_memory),
            ("check_memory", False),
            ("device", "cpu"),
        ):
            object.__setattr__(staged, name, value)
        import torch

        object.__setattr__(staged, "torch_device", torch.device("cpu"))
        return staged


def _check_load(options: LoadOptions) -> None:
    """What :class:`LoadOptions` checks when built (ConfigError; the messages name the CLI's flags)."""
    from squeeze.runtime.checks import resolve_device

    object.__setattr__(options, "activations", check_activations(options.activations))
    if options.dense_cache and options.low_memory:
        raise ConfigError(
            "--dense and --low-memory contradict each other: --dense caches every weight dequantized, "
            "--low-memory never builds dense weights",
            hint="pass one of them (neither: the weights stay compressed and run the native kernels)",
        )
    if options.public_key is not None:
        if not options.verify:
            raise ConfigError(
                "--public-key needs verification: a signature vouches for the bytes only once they are hashed",
                hint="drop --no-verify (squeeze.load(..., verify=True)) or drop --public-key",
            )
        from squeeze.format.signature import check_public_key

        check_public_key(options.public_key)
    object.__setattr__(options, "torch_device", resolve_device(options.device))


@dataclass(frozen=True)
class KVOptions:
    """Which KV cache a run uses. ``kv_bits``: None takes what the artifact was calibrated for (else full
    precision), 8 / 4 its calibrated int cache, 16 full precision. ``kv_dynamic``: with 8 / 4, uncalibrated
    per-token scales (no ``calibrate-kv`` needed)."""

    kv_bits: int | None = None
    kv_dynamic: bool = False

    def __post_init__(self) -> None:
        _check_kv(self)

    @classmethod
    def build(cls, options: KVOptions | None = None, keywords: Mapping[str, Any] | None = None) -> KVOptions:
        """``options`` as given, or built from ``keywords`` (``kv_bits``, ``kv_dynamic``); not both."""
        return _build(cls, options, keywords or {})

    def spec_for(self, model: nn.Module, calibrated: KVSpec | None) -> KVSpec | None:
        """The KV spec ``model`` runs with (None: an ordinary full-precision cache); ConfigError when these
        options need calibrated scales ``model`` lacks."""
        from squeeze.runtime.kv_selection import kv_spec_for

        return kv_spec_for(model, calibrated, self.kv_bits, dynamic=self.kv_dynamic, checked=True)


def _check_kv(options: KVOptions) -> None:
    """What :class:`KVOptions` checks when built."""
    from squeeze.runtime.kv_selection import check_kv_options

    check_kv_options(options.kv_bits, options.kv_dynamic)


def _build(cls: type[_T], options: _T | None, keywords: Mapping[str, Any]) -> _T:
    if options is not None:
        if keywords:
            raise ConfigError(
                f"pass {cls.__name__} or its keywords, not both (found {', '.join(sorted(keywords))})",
                hint=f"set them on the {cls.__name__}",
            )
        return options
    return cls(**keywords)


def split_keywords(keywords: Mapping[str, Any], *builders: type | Callable[..., Any]) -> list[dict[str, Any]]:
    """``keywords`` dealt to the option builders whose parameters they name (one dict per builder, in order): an
    options dataclass (its fields) or a builder function such as ``SamplingParams.for_generate`` (its
    parameters); TypeError for a keyword none of them has, as for any unexpected keyword argument."""
    names = [_parameter_names(builder) for builder in builders]
    dealt: list[dict[str, Any]] = [{} for _ in builders]
    for key, value in keywords.items():
        index = next((i for i, own in enumerate(names) if key in own), None)
        if index is None:
            raise TypeError(f"unexpected keyword argument {key!r}")
        dealt[index][key] = value
    return dealt


def _parameter_names(builder: type | Callable[..., Any]) -> set[str]:
    if isinstance(builder, type) and is_dataclass(builder):
        return {f.name for f in fields(builder) if f.init}
    return set(inspect.signature(builder).parameters)


def load_and_kv(
    keywords: Mapping[str, Any], load: LoadOptions | None = None, kv: KVOptions | None = None
) -> tuple[LoadOptions, KVOptions]:
    """The load and KV options of a call that takes both: as given, or built once from ``keywords`` (their
    fields' names; TypeError for any other)."""
    load_keywords, kv_keywords = split_keywords(keywords, LoadOptions, KVOptions)
    return LoadOptions.build(load, load_keywords), KVOptions.build(kv, kv_keywords)


__all__ = ["LoadOptions", "KVOptions", "PUBLIC_KEY_ENV", "split_keywords", "load_and_kv"]
