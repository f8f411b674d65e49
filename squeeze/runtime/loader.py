"""Load an artifact into a transformers model with SqueezeLinear modules (reference path).

The artifact is verified against its manifest first (unless ``verify=False``); then the model skeleton is
built from config.json, each quantized linear named in ``quantization_config.modules`` becomes a
SqueezeLinear holding its packed codes and LUT (or RTN scales), and every other tensor is loaded as is.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from squeeze.errors import FormatError, IntegrityError
from squeeze.format.manifest import strict_json_loads
from squeeze.format.shards import INDEX_NAME
from squeeze.format.verify import VerifyReport, verify_artifact
from squeeze.quant.qweight import LutWeight, QuantizedWeight, RtnWeight
from squeeze.runtime.linear import SqueezeLinear

QUANT_METHOD = "squeeze"


@dataclass
class LoadedModel:
    """A loaded artifact: the model (eval mode), its tokenizer, and what verification found."""

    model: nn.Module
    tokenizer: Any
    quantization: dict[str, Any]
    report: VerifyReport | None


def read_config(directory: Path) -> dict[str, Any]:
    """config.json of an artifact as a dict (strict JSON)."""
    path = directory / "config.json"
    if not path.is_file():
        raise FormatError(f"{path} is missing", hint="an artifact needs the config.json written by squeeze compress")
    config = strict_json_loads(path.read_bytes(), str(path))
    if not isinstance(config, dict):
        raise FormatError(f"{path} must hold a JSON object")
    return config


def is_artifact(path: str | Path) -> bool:
    """True if ``path`` is a squeeze artifact directory (it has a manifest)."""
    from squeeze.format.manifest import MANIFEST_NAME

    return (Path(path) / MANIFEST_NAME).is_file()


def _no_init_weights() -> Any:
    try:  # transformers >= 5
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4.x
        from transformers.modeling_utils import no_init_weights
    return no_init_weights()


def build_skeleton(config_dict: dict[str, Any]) -> nn.Module:
    """An uninitialised model of the artifact's architecture (fp32, CPU), without running weight init."""
    from transformers import AutoConfig, AutoModelForCausalLM

    plain = {k: v for k, v in config_dict.items() if k != "quantization_config"}
    model_type = plain.pop("model_type", None)
    if not model_type:
        raise FormatError("config.json lacks 'model_type'")
    config = AutoConfig.for_model(model_type, **plain)
    with _no_init_weights(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config, **{"dtype": torch.float32} if _wants_dtype() else {})
    return model.eval()


def _wants_dtype() -> bool:
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__).release >= (4, 56)


def _read_all_tensors(directory: Path) -> dict[str, torch.Tensor]:
    index_path = directory / INDEX_NAME
    if index_path.is_file():
        index = strict_json_loads(index_path.read_bytes(), str(index_path))
        shards = sorted(set(index.get("weight_map", {}).values()))
    else:
        shards = sorted(p.name for p in directory.glob("*.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    for shard in shards:
        with safe_open(str(directory / shard), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensors[name] = handle.get_tensor(name)
    return tensors


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


def load_artifact(path: str | Path, *, verify: bool = True, dense_cache: bool = True) -> LoadedModel:
    """Verify and load a squeeze artifact (or any HF directory with a manifest) on CPU, fp32."""
    from transformers import AutoTokenizer

    directory = Path(path)
    report = None
    if verify:
        report = verify_artifact(directory)
        if not report.ok:
            raise IntegrityError(
                f"artifact {directory} failed verification: {report.first_error()}",
                hint="run `squeeze verify` for the full report; re-create or re-download the artifact",
            )
    config = read_config(directory)
    quant = config.get("quantization_config") or {}
    modules = quant.get("modules", {}) if quant.get("quant_method") == QUANT_METHOD else {}
    model = build_skeleton(config)
    tensors = _read_all_tensors(directory)
    for name, spec in modules.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, child, None)
        if not isinstance(old, nn.Linear):
            raise FormatError(f"quantization_config names {name!r}, which is not a linear layer of this architecture")
        bias = tensors.pop(f"{name}.bias", None)
        qweight = quantized_weight_from(tensors, name, spec)
        for key in [k for k in tensors if k.startswith(f"{name}.weight_")]:
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
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    return LoadedModel(model=model, tokenizer=tokenizer, quantization=quant, report=report)


def _is_quantized_param(model: nn.Module, key: str) -> bool:
    parent, _, _ = key.rpartition(".")
    try:
        return isinstance(model.get_submodule(parent), SqueezeLinear)
    except AttributeError:
        return False


__all__ = ["LoadedModel", "load_artifact", "is_artifact", "read_config", "build_skeleton"]
