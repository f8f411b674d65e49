"""Load an artifact into a transformers model with SqueezeLinear modules (reference path).

The artifact is verified against its manifest first (unless ``verify=False``); then the model skeleton is
built from config.json, each quantized linear named in ``quantization_config.modules`` becomes a
SqueezeLinear holding its packed codes and LUT (or RTN scales), and every other tensor is loaded as is.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from squeeze.errors import FormatError, IntegrityError
from squeeze.format.manifest import strict_json_loads
from squeeze.format.shards import INDEX_NAME
from squeeze.format.paths import open_inside
from squeeze.format.verify import VerifyReport, read_manifest, verify_artifact
from squeeze.quant.kv import KV_FILE, KVSpec
from squeeze.quant.qweight import LutWeight, QuantizedWeight, RtnWeight
from squeeze.runtime.linear import SqueezeLinear
from squeeze.runtime.memory import check_load_memory

QUANT_METHOD = "squeeze"


@dataclass
class LoadedModel:
    """A loaded artifact: the model (eval mode), its tokenizer, and what verification found."""

    model: nn.Module
    tokenizer: Any
    quantization: dict[str, Any]
    report: VerifyReport | None
    #: The calibrated KV-cache quantizers (``squeeze calibrate-kv``), or None when the artifact has none.
    kv_spec: KVSpec | None = None


def parse_config(data: bytes, where: str) -> dict[str, Any]:
    """config.json bytes as a dict (strict JSON)."""
    config = strict_json_loads(data, where)
    if not isinstance(config, dict):
        raise FormatError(f"{where} must hold a JSON object")
    return config


def is_artifact(path: str | Path) -> bool:
    """True if ``path`` is a squeeze artifact directory (it has a manifest)."""
    from squeeze.format.manifest import MANIFEST_NAME

    return (Path(path) / MANIFEST_NAME).is_file()


def build_skeleton(config_dict: dict[str, Any]) -> nn.Module:
    """The artifact's architecture on the meta device: no memory, no weight init (filled in by the loader)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    plain = {k: v for k, v in config_dict.items() if k != "quantization_config"}
    model_type = plain.pop("model_type", None)
    if not model_type:
        raise FormatError("config.json lacks 'model_type'")
    try:
        config = AutoConfig.for_model(model_type, **plain)
        # no weight init: on the meta device it computes nothing, yet torch runs kaiming_uniform_ through its
        # Python decompositions for every linear (0.5 s of a 1.4 s SmolLM2 load, measured)
        with torch.device("meta"), _no_init_weights(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    except Exception as exc:  # noqa: BLE001 - unknown model types and bad configs raise many kinds
        raise FormatError(f"config.json describes no model this transformers can build: {type(exc).__name__}: {exc}") from None
    return model.eval()


def _no_init_weights() -> contextlib.AbstractContextManager[Any]:
    """transformers' context that skips weight initialisation (a no-op context if this version lacks it)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # pragma: no cover - older transformers
        return contextlib.nullcontext()
    return no_init_weights()


def _torch_dtype(name: str) -> torch.dtype:
    dtypes = {
        "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
        "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    }
    if name not in dtypes:
        raise FormatError(f"tensor dtype {name} is not supported by the squeeze loader")
    return dtypes[name]


def tensors_from_captured(report: VerifyReport) -> dict[str, torch.Tensor]:
    """Every tensor of every shard, as views into the bytes that verification hashed (no second read)."""
    tensors: dict[str, torch.Tensor] = {}
    for path, header in sorted(report.headers.items()):
        data = report.captured[path].data
        if data is None:
            raise FormatError(f"{path} was verified without keeping its bytes")
        base = header.data_start
        for name, info in header.tensors.items():
            raw = data[base + info.begin : base + info.end]  # uint8 view, shares the hashed buffer
            tensors[name] = raw.view(_torch_dtype(info.dtype)).reshape(info.shape)
    return tensors


def _read_unverified(directory: Path) -> tuple[dict[str, torch.Tensor], dict[str, bytes]]:
    """Tensors and small files read straight from disk (``verify=False``: the caller warned the user)."""
    index_path = directory / INDEX_NAME
    if index_path.is_file():
        index = strict_json_loads(index_path.read_bytes(), str(index_path))
        shards = sorted(set(index.get("weight_map", {}).values()) | ({KV_FILE} if (directory / KV_FILE).is_file() else set()))
    else:
        shards = sorted(p.name for p in directory.glob("*.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    for shard in shards:
        with safe_open(str(directory / shard), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensors[name] = handle.get_tensor(name)
    files = {p.name: p.read_bytes() for p in directory.iterdir()
             if p.is_file() and not p.is_symlink() and not p.name.endswith(".safetensors")}
    return tensors, files


def quantized_weight_from(tensors: dict[str, torch.Tensor], name: str, spec: dict[str, Any]) -> QuantizedWeight:
    """Rebuild one module's quantized weight from artifact tensors and its quantization_config entry."""
    method, bits, in_features = spec.get("method"), spec.get("bits"), spec.get("in_features")
    if not isinstance(bits, int) or not isinstance(in_features, int):
        raise FormatError(f"quantization_config.modules[{name!r}] lacks integer 'bits' / 'in_features'")
    if method == "squeeze":
        return LutWeight.from_tensors(tensors, name, bits=bits, in_features=in_features)
    if method == "rtn":
        return RtnWeight.from_tensors(tensors, name, bits=bits, in_features=in_features,
                                      group_size=spec.get("group_size") or in_features)
    raise FormatError(f"quantization_config.modules[{name!r}] has unknown method {method!r}")


def load_artifact(path: str | Path, *, verify: bool = True, dense_cache: bool = True,
                  check_memory: bool = True) -> LoadedModel:
    """Load a squeeze artifact on CPU, hashing exactly the bytes it loads (unless ``verify=False``).

    Every file is read once into private memory while it is hashed; tensors are views of those bytes,
    and the config and tokenizer are read from them too, so a file swapped or rewritten after any earlier
    ``squeeze verify`` is caught here (IntegrityError) before a single output is produced.
    ``check_memory``: first estimate the memory the load will hold (artifact bytes, plus the dense cache
    when ``dense_cache``) from the manifest and config, and raise ResourceError if it is not available.
    """
    directory = Path(path)
    if check_memory:
        check_load_memory(directory, dense_cache=dense_cache)
    report = None
    if verify:
        report, early = _verify_while_building(directory)
        if not report.ok:
            raise IntegrityError(
                f"artifact {directory} failed verification: {report.first_error()}",
                hint="run `squeeze verify` for the full report; re-create or re-download the artifact",
            )
        tensors = tensors_from_captured(report)
        files = {p: bytes(h.data.numpy()) for p, h in report.captured.items()
                 if h.data is not None and not p.endswith(".safetensors")}
        if early is not None and early.files != files:
            early = None  # a small file changed between the two reads: build from the verified bytes
    else:
        tensors, files = _read_unverified(directory)
        early = None
    kv_tensors = {k: tensors.pop(k) for k in _kv_tensor_names(report, directory) if k in tensors}
    if "config.json" not in files:
        raise FormatError(f"{directory / 'config.json'} is missing",
                          hint="an artifact needs the config.json written by squeeze compress")
    config = parse_config(files["config.json"], str(directory / "config.json"))
    quant = config.get("quantization_config") or {}
    modules = quant.get("modules", {}) if quant.get("quant_method") == QUANT_METHOD else {}
    model = early.model if early is not None else build_skeleton(config)
    for name, spec in modules.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, child, None)
        if not isinstance(old, nn.Linear):
            raise FormatError(f"quantization_config names {name!r}, which is not a linear layer of this architecture")
        bias = tensors.pop(f"{name}.bias", None)
        qweight = quantized_weight_from(tensors, name, spec)
        for key in qweight.to_tensors(name):  # exactly the tensors it consumed (a prefix scan is O(n^2))
            del tensors[key]
        setattr(parent, child, SqueezeLinear(qweight, bias, dense_cache=dense_cache))
    missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    missing = [k for k in missing if k not in tied and not _is_quantized_param(model, k)]
    if unexpected:
        raise FormatError(f"artifact holds tensors this architecture does not have: {sorted(unexpected)[:3]}")
    if missing:
        raise FormatError(f"artifact lacks tensors the architecture needs: {sorted(missing)[:3]}")
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    _materialise_computed_buffers(model)
    model.eval()
    kv_spec = KVSpec.from_config(quant["kv_cache"], kv_tensors) if quant.get("kv_cache") else None
    return LoadedModel(model=model, tokenizer=_tokenizer_for(files, early), quantization=quant, report=report,
                       kv_spec=kv_spec)


def _kv_tensor_names(report: VerifyReport | None, directory: Path) -> list[str]:
    """Names of the tensors in the KV-scales file (kept out of the model's state dict)."""
    if report is not None:
        header = report.headers.get(KV_FILE)
        return list(header.tensors) if header is not None else []
    if not (directory / KV_FILE).is_file():
        return []
    with safe_open(str(directory / KV_FILE), framework="pt") as handle:
        return list(handle.keys())


#: Small files are read a second time (privately) to build the skeleton and tokenizer early; above this
#: total the overlap is skipped rather than holding them twice.
EARLY_READ_LIMIT = 64 * 2**20


@dataclass
class _Early:
    """What was built, while the shards were being hashed, from a private unverified read of the small files."""

    files: dict[str, bytes]
    model: nn.Module
    tokenizer: Any


def _verify_while_building(directory: Path) -> tuple[VerifyReport, _Early | None]:
    """Verify every file (capturing its bytes) in a worker thread while the skeleton and tokenizer are built.

    hashlib releases the GIL, so hashing a large shard overlaps with building the model skeleton and the
    tokenizer (about half of a SmolLM2 load, measured). Those are built from a private read of the small
    files done before they are verified; the caller keeps them only if those bytes are identical to the
    bytes verification hashed, which makes them exactly what building from the verified bytes gives.
    """
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="squeeze-verify") as pool:
        pending = pool.submit(verify_artifact, directory, capture=lambda _path: True)
        try:
            early = _build_early(directory)
        except Exception:  # noqa: BLE001 - whatever failed here fails again, and is reported, on verified bytes
            early = None
        return pending.result(), early


def _build_early(directory: Path) -> _Early | None:
    files = _read_small_files(directory)
    if files is None or "config.json" not in files:
        return None
    model = build_skeleton(parse_config(files["config.json"], str(directory / "config.json")))
    return _Early(files=files, model=model, tokenizer=_tokenizer_from_files(files))


def _read_small_files(directory: Path) -> dict[str, bytes] | None:
    """Every non-safetensors file the manifest lists, read without following symlinks (unverified)."""
    entries = [e for e in read_manifest(directory).files if not e.path.endswith(".safetensors")]
    if sum(e.size for e in entries) > EARLY_READ_LIMIT:
        return None
    root_fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        files = {}
        for entry in entries:
            with os.fdopen(open_inside(root_fd, entry.path), "rb") as handle:
                files[entry.path] = handle.read()
        return files
    finally:
        os.close(root_fd)


def _materialise_computed_buffers(model: nn.Module) -> None:
    """Buffers computed from the config at init (rotary ``inv_freq``) are still on meta: rebuild them on CPU."""
    for name, module in model.named_modules():
        if not any(b.is_meta for b in module.buffers(recurse=False)):
            continue
        try:
            fresh = type(module)(config=model.config)
        except Exception as exc:  # noqa: BLE001
            raise FormatError(f"cannot rebuild the computed buffers of {name or type(module).__name__}: {exc}") from None
        for buffer_name, buffer in fresh.named_buffers(recurse=False):
            persistent = buffer_name not in module._non_persistent_buffers_set
            module.register_buffer(buffer_name, buffer, persistent=persistent)
    leftovers = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if leftovers:
        raise FormatError(f"artifact lacks tensors the architecture needs: {leftovers[:3]}")


def _tokenizer_for(files: dict[str, bytes], early: _Early | None) -> Any:
    return early.tokenizer if early is not None else _tokenizer_from_files(files)


def _tokenizer_from_files(files: dict[str, bytes]) -> Any:
    """The tokenizer, built from the verified bytes (copied to a private temp dir, never re-read in place)."""
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="squeeze-tokenizer-") as tmp:
        for name, data in files.items():
            if "/" not in name:
                (Path(tmp) / name).write_bytes(data)
        return AutoTokenizer.from_pretrained(tmp, local_files_only=True, trust_remote_code=False)


def _is_quantized_param(model: nn.Module, key: str) -> bool:
    parent, _, _ = key.rpartition(".")
    try:
        return isinstance(model.get_submodule(parent), SqueezeLinear)
    except AttributeError:
        return False


__all__ = ["LoadedModel", "load_artifact", "is_artifact", "parse_config", "build_skeleton", "tensors_from_captured"]
