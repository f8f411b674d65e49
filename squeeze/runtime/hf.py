"""transformers integration: ``AutoModelForCausalLM.from_pretrained(artifact_dir)`` loads a squeeze artifact.

``squeeze.register()`` (not ``import squeeze`` alone) registers the "squeeze" quantization method (config class
and quantizer) with transformers' quantizer registry (see :mod:`squeeze.runtime.hf_hook` for when).
transformers then reads ``config.json``, finds ``quantization_config.quant_method == "squeeze"`` and hands the
model skeleton to :class:`SqueezeHfQuantizer`, which

1. verifies the whole artifact against its manifest (size and SHA-256 of every file; IntegrityError on any
   mismatch) before a single weight is read, and checks the config's dimensions against the verified
   tensor shapes (FormatError). When ``from_pretrained`` is given the artifact directory, both happen
   before transformers builds the skeleton (``update_attn_implementation`` is its one hook that sees the
   config then), so a config asking for a million layers fails at once instead of hanging;
2. replaces each quantized ``nn.Linear`` named in ``quantization_config.modules`` by a :class:`SqueezeLinear`
   (each quantized 3-D expert parameter by a :class:`~squeeze.runtime.experts.SqueezeExperts`, with the
   "squeeze" experts forward) whose buffers (``weight_packed``, ``weight_lut``, ...) have the shapes and dtypes
   of the artifact's tensors, read from the verified safetensors headers, so transformers' ordinary
   state-dict loading fills them by name;
3. after loading, rebuilds every module's quantized weight from its filled buffers with the full format
   checks (FormatError on malformed data).

This path *verifies, then loads*: transformers re-reads (memory-maps) the files after they were hashed, so
a file rewritten in between would not be caught. :func:`squeeze.load` instead builds tensors from exactly
the bytes it hashed; prefer it when that guarantee matters.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.quantizers.auto import (
    AUTO_QUANTIZATION_CONFIG_MAPPING,
    AUTO_QUANTIZER_MAPPING,
    register_quantization_config,
    register_quantizer,
)
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from squeeze.errors import ConfigError, FormatError
from squeeze.format.dtypes import torch_dtype
from squeeze.format.paths import resolve_root
from squeeze.format.quant_config import QUANT_METHOD, ModuleEntry, QuantizationConfig
from squeeze.format.safetensors_header import TensorInfo
from squeeze.format.signature import check_signature
from squeeze.format.verify import VerifyReport
from squeeze.quant.schemes import WeightFormat, stored_roles
from squeeze.runtime.activations import DEFAULT_ACTIVATIONS
from squeeze.runtime.config_shapes import check_config_shapes
from squeeze.runtime.dense_linear import stabilise_dense_linears
from squeeze.runtime.embedding import SqueezeEmbedding, tie_quantized_heads
from squeeze.runtime.experts import (
    SqueezeExperts,
    replace_expert_parameter,
)
from squeeze.runtime.experts_forward import experts_implementation, use_squeeze_experts
from squeeze.runtime.linear import SqueezeLinear
from squeeze.runtime.loader import (
    is_artifact,
    quantized_weight_from,
    swap_in_quantized,
    verified_report,
)
from squeeze.runtime.options import LoadOptions
from squeeze.runtime.stored_dtype import compute_dtype, restore_stored_dtype, set_compute_dtype, stored_dtype_names
from squeeze.runtime.weight_paths import set_activations


class SqueezeQuantConfig(QuantizationConfigMixin):
    """``config.json``'s ``quantization_config`` of a squeeze artifact as transformers holds it: its keys as
    attributes (``to_dict`` round-trips them), checked once by :class:`QuantizationConfig` (the same checks,
    and the same FormatError for an unknown ``format_version``, as every other squeeze loader).

    Only pre-quantized artifacts load this way: squeeze compresses offline (``squeeze compress``).
    """

    def __init__(self, **kwargs: Any) -> None:
        kwargs["quant_method"] = QUANT_METHOD  # transformers passes it, or drops it, depending on the path
        parsed = QuantizationConfig.from_dict(kwargs)
        for key, value in parsed.to_dict().items():
            setattr(self, key, value)
        # transformers types quant_method as its own enum; registered out-of-tree methods are plain strings
        self.quant_method = QUANT_METHOD  # type: ignore[assignment]
        self._parsed = parsed

    @property
    def squeeze(self) -> QuantizationConfig:
        """The typed section."""
        return self._parsed

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy({key: value for key, value in self.__dict__.items() if not key.startswith("_")})


#: The load options of the ``from_pretrained`` calls inside :func:`loading` (None: the defaults).
_LOAD_OPTIONS: ContextVar[LoadOptions | None] = ContextVar("squeeze_load_options", default=None)


@contextlib.contextmanager
def loading(options: LoadOptions | None = None, **keywords: Any) -> Iterator[LoadOptions]:
    """The :class:`LoadOptions` ``AutoModelForCausalLM.from_pretrained(artifact)`` loads with inside the block
    (a context variable: per thread and per task). transformers has no way to hand a quantizer options of
    its own, so::

        with squeeze.api.loading(public_key="signer.pub.pem"):
            model = AutoModelForCausalLM.from_pretrained(artifact)  # IntegrityError unless signed by it

    ``public_key``: the artifact's ``model.sig`` must verify with it, checked right after the manifest (before
    any weight is read). ``activations``: the LUT kernels' activation precision. ``dense_cache`` /
    ``low_memory``: the weights' path, as in :func:`squeeze.load`. ``verify=False`` is refused: this path
    always verifies. The options are checked once, when built."""
    options = LoadOptions.build(options, keywords)
    if not options.verify:
        raise ConfigError(
            "from_pretrained always verifies a squeeze artifact; verify=False does not apply",
            hint="drop verify=False, or use squeeze.load(path, verify=False)",
        )
    token = _LOAD_OPTIONS.set(options)
    try:
        yield options
    finally:
        _LOAD_OPTIONS.reset(token)


def _options() -> LoadOptions:
    options = _LOAD_OPTIONS.get()
    return options if options is not None else LoadOptions()


class SqueezeHfQuantizer(HfQuantizer):
    """Loads squeeze artifacts through ``from_pretrained``: verify (and check the signature when
    :func:`loading` names a public key), swap in SqueezeLinear, fill, validate."""

    requires_calibration = True  # pre-quantized only: there is no on-the-fly "quantize while loading"
    quantization_config: SqueezeQuantConfig
    _verified: VerifyReport | None = None  # set before the skeleton is built, when the directory is known
    _stored_dtypes: dict[str, torch.dtype]  # the embedding / LM head weights' dtypes in the artifact

    def update_attn_implementation(self, config: Any) -> Any:
        """Before transformers builds the skeleton: verify a local artifact and check its config's dimensions."""
        name = getattr(config, "name_or_path", None)
        if isinstance(name, str) and name and is_artifact(name):
            self._verified = _verified(resolve_root(name))
            _check_shapes(config.to_dict(), self._verified, self.quantization_config.squeeze.modules)
        if any(entry.is_experts for entry in self.quantization_config.squeeze.modules.values()):
            # quantized experts run one routed expert at a time (squeeze_experts_forward; transformers' default
            # grouped forward reads whole 3-D tensors); set before the skeleton checks it
            config._experts_implementation = experts_implementation()
        return super().update_attn_implementation(config)

    def _process_model_before_weight_loading(
        self, model: nn.Module, checkpoint_files: list[str] | None = None, **kwargs: Any
    ) -> nn.Module:
        directory = _artifact_directory(checkpoint_files)
        report = self._verified
        if report is None or Path(report.artifact_dir) != directory:
            report = _verified(directory)
        config: Any = model.config  # a PreTrainedModel's config (nn.Module's typing knows no such attribute)
        specs = self.quantization_config.squeeze.modules  # typed entries (mappings of the stored keys)
        _check_shapes(config.to_dict(), report, specs)
        infos = {name: info for header in report.headers.values() for name, info in header.tensors.items()}
        options = _options()
        for name, entry in specs.items():
            _swap_in_squeeze_linear(model, name, entry, infos, options)
        _untie_quantized_heads(model, self.quantization_config.squeeze.tied_heads)
        self._stored_dtypes = {  # the embedding and LM head go back to these after loading (stored_dtype)
            name: torch_dtype(infos[name].dtype) for name in stored_dtype_names(model) if name in infos
        }
        return model

    def _process_model_after_weight_loading(self, model: nn.Module, **kwargs: Any) -> nn.Module:
        for name, module in model.named_modules():
            if isinstance(module, SqueezeEmbedding):
                if any(t.is_meta for t in module.buffers()):
                    raise FormatError(f"artifact lacks tensors of the quantized embedding {name!r}")
                module.rebind(name)
        tie_quantized_heads(model, self.quantization_config.squeeze.tied_heads)  # over the loaded embedding
        for name, module in model.named_modules():
            if not isinstance(module, (SqueezeLinear, SqueezeExperts)):
                continue
            if any(t.is_meta for t in list(module.buffers()) + list(module.parameters())):
                what = "expert parameter" if isinstance(module, SqueezeExperts) else "linear"
                raise FormatError(f"artifact lacks tensors of the quantized {what} {name!r}")
            module.rebind(name)  # the full dtype / shape / value checks of the format, on the loaded tensors
        use_squeeze_experts(model)
        if _options().activations != DEFAULT_ACTIVATIONS:
            set_activations(model, _options().activations)  # every quantized module, tied heads included
        stabilise_dense_linears(model)  # the LM head as squeeze.load runs it
        # the dtype the layers were loaded in, taken before the embedding and head go back to their stored one
        dtype = compute_dtype(model)
        restore_stored_dtype(model, getattr(self, "_stored_dtypes", {}))  # their memory as squeeze.load holds it
        set_compute_dtype(model, dtype)
        return model

    def is_serializable(self, *args: Any, **kwargs: Any) -> bool:
        return False  # an artifact is written (and sealed with its manifest) only by `squeeze compress`

    @property
    def is_trainable(self) -> bool:
        return False


def _check_shapes(config: dict[str, Any], report: VerifyReport, modules: Mapping[str, ModuleEntry]) -> None:
    """The loader's config-vs-tensor check (``check_config_shapes``) against the verified headers."""
    shapes = {name: info.shape for header in report.headers.values() for name, info in header.tensors.items()}
    check_config_shapes(config, shapes, modules)


def _artifact_directory(checkpoint_files: list[str] | None) -> Path:
    """The one directory holding every checkpoint file: the artifact root, whose manifest gets verified.

    Only the directory is resolved (``current -> v3``), never the file: a shard that is itself a link must
    fail verification in this directory, not send it to the link target's.
    """
    parents = {resolve_root(Path(f).parent) for f in checkpoint_files or []}
    if len(parents) != 1:
        raise FormatError(
            f"a squeeze artifact's shards live in one directory, found {sorted(map(str, parents))}",
            hint="load the artifact directory written by `squeeze compress`",
        )
    return parents.pop()


def _meta(infos: dict[str, TensorInfo], name: str) -> torch.Tensor | None:
    info = infos.get(name)
    return None if info is None else torch.empty(info.shape, dtype=torch_dtype(info.dtype), device="meta")


def meta_qweight(name: str, spec: dict[str, Any], infos: dict[str, TensorInfo]) -> WeightFormat:
    """One module's quantized weight with meta tensors shaped like the artifact's (values checked after loading)."""
    tensors = {f"{name}.{role}": t for role in stored_roles() if (t := _meta(infos, f"{name}.{role}")) is not None}
    return quantized_weight_from(tensors, name, spec, check_values=False)


def _verified(directory: Path) -> VerifyReport:
    """``directory`` verified against its manifest, and its signature checked when the load options name a
    public key (IntegrityError either way), before the skeleton is built."""
    report = verified_report(directory)
    public_key = _options().public_key
    if public_key is not None:
        check_signature(report, public_key)
    return report


def _swap_in_squeeze_linear(
    model: nn.Module, name: str, entry: ModuleEntry, infos: dict[str, TensorInfo], options: LoadOptions
) -> None:
    layout = entry.layout
    if layout is not None:  # a 3-D expert parameter: a SqueezeExperts in the parameter's dtype
        replace_expert_parameter(model, name, meta_qweight(name, entry.format_spec(), infos), *layout)
        return
    qweight, bias = meta_qweight(name, entry.format_spec(), infos), _meta(infos, f"{name}.bias")
    swap_in_quantized(model, name, qweight, bias, dense_cache=options.dense_cache, low_memory=options.low_memory)


def _untie_quantized_heads(model: nn.Module, tied: dict[str, str]) -> None:
    """Before loading: a tied LM head reads its quantized embedding (rebuilt after loading), so transformers
    must neither tie ``head.weight`` to an embedding weight that no longer exists nor expect the head's own
    tensors: its tie entry is dropped and it becomes a SqueezeLinear whose buffers are not loaded by name."""
    keys = getattr(model, "all_tied_weights_keys", None)  # transformers >= 5: {target: source} used while loading
    for head in tied:
        if isinstance(keys, dict):
            keys.pop(f"{head}.weight", None)
    tie_quantized_heads(model, tied)
    for head in tied:
        module = model.get_submodule(head)
        module._non_persistent_buffers_set.update(name for name, _ in module.named_buffers(recurse=False))


def register() -> None:
    """Register the "squeeze" method with transformers (idempotent; ``squeeze.register()`` arranges the call)."""
    # the registry refuses a second registration of a name: drop a stale one (this module re-imported) first
    if AUTO_QUANTIZATION_CONFIG_MAPPING.get(QUANT_METHOD) is not SqueezeQuantConfig:
        AUTO_QUANTIZATION_CONFIG_MAPPING.pop(QUANT_METHOD, None)
        register_quantization_config(QUANT_METHOD)(SqueezeQuantConfig)
    if AUTO_QUANTIZER_MAPPING.get(QUANT_METHOD) is not SqueezeHfQuantizer:
        AUTO_QUANTIZER_MAPPING.pop(QUANT_METHOD, None)
        register_quantizer(QUANT_METHOD)(SqueezeHfQuantizer)


register()  # importing the integration registers it (also when this import is what loaded transformers)

__all__ = ["SqueezeQuantConfig", "SqueezeHfQuantizer", "register", "meta_qweight", "loading"]
