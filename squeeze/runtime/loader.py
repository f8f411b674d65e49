"""Load an artifact into a transformers model with SqueezeLinear modules (reference path).

The artifact is verified against its manifest first (unless ``verify=False``); nothing whose size comes
from the artifact is built before that succeeded. Then config.json's dimensions are checked against the
verified tensor shapes (``check_config_shapes``), the model skeleton is built from it, each quantized linear
named in ``quantization_config.modules`` becomes a SqueezeLinear holding its packed codes and LUT (or RTN
scales), each quantized 3-D expert parameter of a MoE layer (an entry with ``experts``) a SqueezeExperts
(squeeze.runtime.experts), and every other tensor is loaded as is.
"""

from __future__ import annotations

import os
import stat
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from squeeze.errors import ConfigError, FormatError, IntegrityError
from squeeze.format.manifest import MANIFEST_NAME
from squeeze.format.paths import (
    path_error,
    resolve_root,
    short_path,
    short_repr,
)
from squeeze.format.quant_config import SECTION, ModuleEntry, QuantizationConfig
from squeeze.format.quant_entries import COMMON_KEYS
from squeeze.format.signature import SignatureInfo, check_signature
from squeeze.format.strict_json import strict_json_loads
from squeeze.format.verify import VerifyReport, verify_artifact
from squeeze.quant.kv_spec import KVSpec
from squeeze.quant.schemes import WeightFormat, format_for_module, methods, stored_roles
from squeeze.runtime.activations import DEFAULT_ACTIVATIONS, Activations
from squeeze.runtime.artifact_tensors import read_unverified, read_verified
from squeeze.runtime.artifact_tokenizer import tokenizer_from_files
from squeeze.runtime.buffers import materialise_computed_buffers, no_init_weights
from squeeze.runtime.config_shapes import check_config_shapes
from squeeze.runtime.dense_linear import stabilise_dense_linears
from squeeze.runtime.embedding import SqueezeEmbedding, replace_embedding, tie_quantized_heads
from squeeze.runtime.experts import (
    SqueezeExperts,
    replace_expert_parameter,
)
from squeeze.runtime.experts_forward import use_squeeze_experts
from squeeze.runtime.linear import SqueezeLinear, replace_linear
from squeeze.runtime.memory import check_load_memory
from squeeze.runtime.options import LoadOptions
from squeeze.runtime.stored_dtype import (
    KEPT_DTYPES,
    set_compute_dtype,
    stored_dtype_names,
    upcast_embedding_output,
)
from squeeze.system import release_free_heap


@dataclass
class LoadedModel:
    """A loaded artifact: the model (eval mode), its tokenizer, and what verification found."""

    model: nn.Module
    tokenizer: Any
    #: config.json's ``quantization_config``, checked (None: the artifact has none)
    quantization: QuantizationConfig | None
    report: VerifyReport | None
    #: The calibrated KV-cache quantizers (``squeeze calibrate-kv``), or None when the artifact has none.
    kv_spec: KVSpec | None = None
    #: The signature checked while loading (``public_key``), or None when none was asked for.
    signature: SignatureInfo | None = None


def parse_config(data: bytes, where: str) -> dict[str, Any]:
    """config.json bytes as a dict (strict JSON)."""
    config = strict_json_loads(data, where)
    if not isinstance(config, dict):
        raise FormatError(f"{where} must hold a JSON object")
    return config


def is_artifact(path: str | Path) -> bool:
    """True if ``path`` is a squeeze artifact directory: it holds a manifest entry (not a directory).

    Only lstat: a manifest that is a link, FIFO or device still makes ``path`` an artifact, so that loading
    it reports the problem instead of treating the directory as a plain model. ``path`` itself may be a
    link to the artifact. A path that cannot be looked at (too long for the OS, no permission) is a
    FormatError: no caller could open it as anything else.
    """
    try:
        return not stat.S_ISDIR(os.lstat(resolve_root(path) / MANIFEST_NAME).st_mode)
    except (FileNotFoundError, NotADirectoryError):  # no manifest there: a model directory, a file, a hub id
        return False
    except OSError as exc:
        raise path_error("cannot read", path, exc) from None


def build_skeleton(config_dict: dict[str, Any]) -> nn.Module:
    """The artifact's architecture on the meta device: no memory, no weight init (filled in by the loader)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    plain = {k: v for k, v in config_dict.items() if k != SECTION}
    model_type = plain.pop("model_type", None)
    if not model_type:
        raise FormatError("config.json lacks 'model_type'")
    try:
        config = AutoConfig.for_model(model_type, **plain)
        # no weight init: on the meta device it computes nothing, yet torch runs kaiming_uniform_ through its
        # Python decompositions for every linear (0.5 s of a 1.4 s SmolLM2 load, measured)
        with torch.device("meta"), no_init_weights(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    except Exception as exc:  # noqa: BLE001 - unknown model types and bad configs raise many kinds
        raise FormatError(f"config.json describes no model this transformers can build: {_reason(exc)}") from None
    return model.eval()


def _reason(exc: BaseException, limit: int = 300) -> str:
    """``exc`` as one line for a message. A multi-line message (a validator wrapping the real error, as
    ``Class validation error for validator ...:`` then ``ValueError: The hidden size ...``) gives its last
    line, the innermost reason, which a one-line error would otherwise cut off."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    text = lines[-1] if len(lines) > 1 else f"{type(exc).__name__}: {lines[0]}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def quantized_weight_from(
    tensors: Mapping[str, torch.Tensor], name: str, spec: Mapping[str, Any], *, check_values: bool = True
) -> WeightFormat:
    """One module's quantized weight, rebuilt by its registered format from artifact tensors (or meta
    tensors shaped like them, with ``check_values=False``) and its ``quantization_config.modules`` entry."""
    dtypes = {role: t.dtype for role in stored_roles() if (t := tensors.get(f"{name}.{role}")) is not None}
    cls = format_for_module(spec.get("method"), dtypes)
    if cls is None:
        raise FormatError(
            f"quantization_config.modules[{name!r}] has unknown method {short_repr(spec.get('method'), 60)}",
            hint="this squeeze reads methods " + ", ".join(repr(m) for m in methods()),
        )
    # the entry's common keys were checked when the config was read (ModuleEntry); the rest are the format's own
    if unknown := sorted(set(spec) - {*COMMON_KEYS, *cls.module_params}):
        raise FormatError(
            f"quantization_config.modules[{name!r}] has keys {unknown} that method {cls.method} does not define "
            f"(it defines {[*COMMON_KEYS, *cls.module_params]})"[:300],
            hint="the artifact's config.json was edited, or written by a newer squeeze: re-create it with this one",
        )
    return cls.from_spec(tensors, name, spec, check_values=check_values)


def swap_in_quantized(
    model: nn.Module,
    name: str,
    qweight: WeightFormat,
    bias: torch.Tensor | None,
    *,
    dense_cache: bool = False,
    low_memory: bool = False,
    activations: Activations = DEFAULT_ACTIVATIONS,
) -> None:
    """Replace the linear ``name`` of ``model`` by a SqueezeLinear holding ``qweight`` (FormatError when the
    model has no such linear, or one of another size): the module swap of both loaders. ``dense_cache``,
    ``low_memory`` and ``activations``: as in SqueezeLinear."""

    def build(old: nn.Linear) -> SqueezeLinear:
        if (old.out_features, old.in_features) != (qweight.out_features, qweight.in_features):
            raise FormatError(
                f"{name}: config.json builds a {old.out_features} x {old.in_features} linear, but the "
                f"artifact's weight is {qweight.out_features} x {qweight.in_features}",
                hint="config.json does not belong to these tensors; re-create the artifact",
            )
        return SqueezeLinear(qweight, bias, dense_cache=dense_cache, low_memory=low_memory, activations=activations)

    def build_embedding(old: nn.Embedding) -> SqueezeEmbedding:
        if (old.num_embeddings, old.embedding_dim) != (qweight.out_features, qweight.in_features):
            raise FormatError(
                f"{name}: config.json builds a {old.num_embeddings} x {old.embedding_dim} embedding, but the "
                f"artifact's weight is {qweight.out_features} x {qweight.in_features}",
                hint="config.json does not belong to these tensors; re-create the artifact",
            )
        if bias is not None:
            raise FormatError(f"{name}: an embedding has no bias, found {name}.bias")
        return SqueezeEmbedding(qweight, old.padding_idx)

    if _is_embedding(model, name):  # a quantized token embedding (weights.embedding_bits)
        replace_embedding(model, name, build_embedding)
    else:
        replace_linear(model, name, build)


def _is_embedding(model: nn.Module, name: str) -> bool:
    try:
        return isinstance(model.get_submodule(name), nn.Embedding)
    except AttributeError:
        return False


def verified_report(directory: Path, *, capture: bool | Callable[[str], bool] = False) -> VerifyReport:
    """``directory``'s verification report (every file's bytes kept when ``capture`` is True, those of the files
    it selects when it is a function of the path); IntegrityError if not intact."""
    select = capture if callable(capture) else (lambda _path: True) if capture else None
    report = verify_artifact(directory, capture=select)
    if not report.ok:
        raise IntegrityError(
            f"artifact {short_path(directory)} failed verification: {report.first_error()}",
            hint="run `squeeze verify` for the full report; re-create or re-download the artifact",
        )
    return report


def load_artifact(path: str | Path, options: LoadOptions | None = None) -> LoadedModel:
    """Load a squeeze artifact on ``options.device`` (default the CPU), hashing exactly the bytes it loads
    (unless ``options.verify`` is False).

    ``options``: :class:`~squeeze.runtime.options.LoadOptions` (checked when built: trusted here; default
    ``LoadOptions()``). Off the CPU (``device="cuda[:N]"``) the host memory the load holds is checked first,
    the model is built on the host for the dense (or, with ``low_memory``, chunked) weights a GPU runs (the
    native kernels are CPU code), then moved to the device.
    Every file is read once into private memory while it is hashed; tensors are views of those bytes,
    and the config and tokenizer are read from them too, so a file swapped or rewritten after any earlier
    ``squeeze verify`` is caught here (IntegrityError) before a single output is produced. Nothing sized
    by the artifact (skeleton, tokenizer) is built before verification succeeded, and config.json must
    agree with the tensors' shapes (FormatError) before the skeleton is built; its ``quantization_config``
    is read by :class:`QuantizationConfig` (FormatError for a ``format_version`` this squeeze cannot read).
    ``dense_cache`` / ``low_memory`` / ``activations``: the weights' path, as in SqueezeLinear. ``check_memory``:
    first estimate the memory the load will hold from the manifest and config (ResourceError if it is not
    available). ``public_key``: the artifact's ``model.sig`` must be a signature by this key over exactly the
    verified bytes (IntegrityError otherwise, before anything is built), from verification's own digests.
    ``path`` may be a symlink to the artifact (``current -> v3``); it is resolved once, here.
    """
    options = options if options is not None else LoadOptions()
    if options.torch_device.type != "cpu":
        return _load_on_device(path, options)
    verify, dense_cache, low_memory = options.verify, options.dense_cache, options.low_memory
    public_key = options.public_key
    directory = resolve_root(path)
    if options.check_memory:
        check_load_memory(directory, dense_cache=dense_cache, low_memory=low_memory)
    report = verified_report(directory, capture=True) if verify else None
    signature = check_signature(report, public_key) if report is not None and public_key is not None else None
    tensors, files, kv_names = read_verified(report) if report is not None else read_unverified(directory)
    kv_tensors = {k: tensors.pop(k) for k in kv_names if k in tensors}
    tensor_bytes = sum(t.nbytes for t in tensors.values())
    if "config.json" not in files:
        raise FormatError(
            f"{short_path(directory / 'config.json')} is missing",
            hint="an artifact needs the config.json written by squeeze compress",
        )
    config = parse_config(files["config.json"], "config.json")
    quant = QuantizationConfig.from_model_config(config)  # FormatError for a format_version it cannot read
    modules = quant.modules if quant is not None else {}  # typed entries, checked when the config was read
    check_config_shapes(config, {name: tuple(t.shape) for name, t in tensors.items()}, modules)
    model = build_skeleton(config)
    _swap_in_modules(model, tensors, modules, options)
    _finish_model(model, tensors, tensor_bytes, quant, options)
    kv_entry = quant.kv_cache if quant is not None else None
    kv_spec = KVSpec.from_config(kv_entry.to_dict(), kv_tensors) if kv_entry else None
    loaded = LoadedModel(
        model=model,
        tokenizer=tokenizer_from_files(files),
        quantization=quant,
        report=report,
        kv_spec=kv_spec,
        signature=signature,
    )
    release_free_heap()  # the load's temporaries, freed but still resident: 36 MB of a SmolLM2 load
    return loaded


def _swap_in_modules(
    model: nn.Module, tensors: dict[str, torch.Tensor], modules: Mapping[str, ModuleEntry], options: LoadOptions
) -> None:
    """Each entry of ``quantization_config.modules`` rebuilt from ``tensors`` (its tensors, and a linear's
    bias, taken out of them) and swapped into ``model``: a SqueezeLinear, or a 3-D expert parameter."""
    dense_cache, low_memory, activations = options.dense_cache, options.low_memory, options.activations
    for name, entry in modules.items():
        layout = entry.layout  # (E, transposed) of a 3-D expert parameter, None for a linear
        qweight = quantized_weight_from(tensors, name, entry.format_spec())
        for key in qweight.to_tensors(name):  # exactly the tensors it consumed (a prefix scan is O(n^2))
            del tensors[key]
        if layout is not None:  # the runtime computes in float32 (unquantized tensors are upcast below)
            replace_expert_parameter(model, name, qweight, *layout, dtype=torch.float32, activations=activations)
            continue
        bias = tensors.pop(f"{name}.bias", None)
        swap_in_quantized(
            model, name, qweight, bias, dense_cache=dense_cache, low_memory=low_memory, activations=activations
        )


def _finish_model(
    model: nn.Module,
    tensors: dict[str, torch.Tensor],
    tensor_bytes: int,
    quant: QuantizationConfig | None,
    options: LoadOptions,
) -> None:
    """After the quantized modules: experts and tied heads wired, the remaining (unquantized) tensors loaded,
    computed buffers made, and the model set for inference."""
    use_squeeze_experts(model)  # quantized experts run one routed expert at a time, on the packed codes
    # a tied LM head reads the embedding's buffers
    tied = quant.tied_heads if quant is not None else {}
    tie_quantized_heads(model, tied, low_memory=options.low_memory, activations=options.activations)
    _load_other_tensors(model, tensors)
    stabilise_dense_linears(model)  # the LM head's rows then do not depend on the batch (squeeze serve)
    materialise_computed_buffers(model, limit=max(COMPUTED_BUFFER_BYTES, tensor_bytes))
    # an inference runtime: no parameter wants gradients, so a plain model(ids) call (outside no_grad)
    # still runs the kernels, which have no backward, instead of falling back to dense weights
    model.requires_grad_(False)
    model.eval()


def _load_on_device(path: str | Path, options: LoadOptions) -> LoadedModel:
    """The load for a GPU: host memory checked for the compressed weights alone (a dense cache, if any, is
    built on the device), the model built on the host, then moved to ``options.torch_device``."""
    directory = resolve_root(path)
    if options.check_memory:
        check_load_memory(directory, dense_cache=False, low_memory=True)
    loaded = load_artifact(directory, options.staged_on_host())
    loaded.model.to(options.torch_device)
    return loaded


def load_or_place(model: str | Path | LoadedModel, options: LoadOptions) -> tuple[LoadedModel, float]:
    """``model`` loaded as :func:`load_artifact` does (a path), or a LoadedModel taken as it is and moved to
    ``options.device``; with the seconds loading took (0 for a LoadedModel). ConfigError for a
    ``public_key`` with a LoadedModel: the signature is checked while loading, which is over."""
    if isinstance(model, LoadedModel):
        if options.public_key is not None:
            raise ConfigError(
                "public_key applies while loading an artifact, and this model is already loaded",
                hint="pass public_key to squeeze.load(), or pass the artifact's path here",
            )
        if options.torch_device.type != "cpu":
            model.model.to(options.torch_device)
        return model, 0.0
    start = time.perf_counter()
    loaded = load_artifact(model, options)
    return loaded, time.perf_counter() - start


def _load_other_tensors(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Every tensor that is not a quantized weight, assigned by name; FormatError for extra or missing ones.

    Floating tensors stored in another dtype (an artifact keeps its source's bfloat16 / float16) are upcast
    to float32, the dtype the runtime computes in, except the token embedding and the LM head, which stay
    as stored (squeeze.runtime.stored_dtype: half their memory, the same bits).
    """
    kept = stored_dtype_names(model)
    tensors = {name: t if name in kept and t.dtype in KEPT_DTYPES else _runtime_dtype(t) for name, t in tensors.items()}
    try:
        missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    except RuntimeError as exc:  # shape mismatches: the config and the tensors disagree
        first = next((line.strip() for line in str(exc).splitlines() if "size mismatch" in line), str(exc))
        raise FormatError(
            f"artifact tensors do not fit the architecture config.json describes: {first[:300]}",
            hint="config.json does not belong to these tensors; re-create the artifact",
        ) from None
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    missing = [k for k in missing if k not in tied and not _is_quantized_param(model, k)]
    if unexpected:
        raise FormatError(f"artifact holds tensors this architecture does not have: {sorted(unexpected)[:3]}")
    if missing:
        raise FormatError(f"artifact lacks tensors the architecture needs: {sorted(missing)[:3]}")
    if getattr(model.config, "tie_word_embeddings", False) and isinstance(model.get_input_embeddings(), nn.Embedding):  # type: ignore[operator]
        model.tie_weights()  # type: ignore[operator]  # (a quantized embedding's head was tied above)
    upcast_embedding_output(model)  # a table kept in float16 / bfloat16 still gives the layers float32 rows
    set_compute_dtype(model, torch.float32)  # what every other floating tensor was upcast to above


def _runtime_dtype(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in float32 when it is a floating tensor of another dtype, else as is (no copy)."""
    return tensor.float() if tensor.is_floating_point() and tensor.dtype != torch.float32 else tensor


#: Buffers computed at init (rotary tables...) may take this much, or as much as the artifact's tensors.
COMPUTED_BUFFER_BYTES = 256 * 2**20


def _is_quantized_param(model: nn.Module, key: str) -> bool:
    parent, _, _ = key.rpartition(".")
    try:
        return isinstance(model.get_submodule(parent), (SqueezeLinear, SqueezeEmbedding, SqueezeExperts))
    except AttributeError:
        return False


__all__ = [
    "LoadedModel",
    "load_artifact",
    "verified_report",
    "load_or_place",
    "is_artifact",
    "parse_config",
    "build_skeleton",
]
