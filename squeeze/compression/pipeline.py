"""The compress pipeline: checkpoint -> calibration -> Fisher -> per-layer quantization -> sealed artifact.

Work happens in a hidden staging directory next to the output; the output appears (or replaces the old
one, with ``overwrite``) by rename only once the artifact is complete and sealed, so a failed or killed
run never leaves a half artifact under the output's name, and never destroys the previous one.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from squeeze import __version__
from squeeze.calibrate.fisher import fisher_information
from squeeze.calibrate.windows import calibration_windows
from squeeze.compression.preflight import check_disk, check_output_dir, estimate_size, meta_model
from squeeze.config import CalibrationSpec, Recipe
from squeeze.errors import ConfigError
from squeeze.format.atomic import atomic_write_text, fsync_directory
from squeeze.format.manifest import Provenance
from squeeze.format.shards import ShardWriter
from squeeze.format.verify import seal_artifact
from squeeze.models.source import ModelSource, load_model, load_tokenizer, resolve_model, source_digest
from squeeze.models.targets import find_target_linears
from squeeze.quant.nuq import quantize_lut
from squeeze.quant.qweight import QuantizedWeight
from squeeze.quant.rtn import rtn_quantize
from squeeze.quant.sparse import select_sparse

FORMAT_VERSION = 1
#: progress(stage, done, total); stages: "fisher", "quantize".
StageProgress = Callable[[str, int, int], None]


@dataclass
class CompressResult:
    """What a compress run produced, and how long each stage took."""

    output: str
    model: str
    recipe: str
    bits_per_weight: float
    seconds: float
    timings: dict[str, float] = field(default_factory=dict)
    quantized_modules: int = 0
    quantized_weights: int = 0
    artifact_bytes: int = 0
    original_bytes: int = 0  # the loaded model's tensors (fp32), tied weights once
    root_digest: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "output": self.output, "model": self.model, "recipe": self.recipe,
            "bits_per_weight": self.bits_per_weight, "seconds": round(self.seconds, 3),
            "timings": {k: round(v, 3) for k, v in self.timings.items()},
            "quantized_modules": self.quantized_modules, "quantized_weights": self.quantized_weights,
            "artifact_bytes": self.artifact_bytes, "original_bytes": self.original_bytes,
            "root_digest": self.root_digest,
        }


def needs_calibration(recipe: Recipe) -> bool:
    return recipe.weights.method == "squeeze" and recipe.weights.sensitivity == "fisher"


def run_compress(
    model: str | ModelSource,
    output: str | os.PathLike[str],
    recipe: Recipe,
    calibration: CalibrationSpec | None,
    *,
    seed: int = 0,
    overwrite: bool = False,
    progress: StageProgress | None = None,
) -> CompressResult:
    """Compress ``model`` with ``recipe`` into the artifact directory ``output``. See squeeze.api.compress."""
    started = time.perf_counter()
    timings: dict[str, float] = {}
    output = Path(output)
    # -- preflight: nothing expensive happens before every check below has passed
    source = model if isinstance(model, ModelSource) else resolve_model(model)
    check_output_dir(output, overwrite)
    skeleton = meta_model(source)
    estimate = estimate_size(skeleton, recipe)  # also raises ModelError when there is no target linear
    check_disk(output, estimate)
    del skeleton
    if needs_calibration(recipe) and calibration is None:
        raise ConfigError(
            "no calibration text given, and this recipe weights k-means by Fisher sensitivity",
            hint="pass a text file or spec (e.g. --calibration my_corpus.txt, or wikitext2-train), "
                 "or use --sensitivity uniform",
        )
    windows = None
    if needs_calibration(recipe) and calibration is not None:
        with _stage(timings, "calibration_data"):  # before the model loads: a too-short text fails fast
            windows = calibration_windows(calibration, load_tokenizer(source))  # (n, T)

    with _stage(timings, "load"):
        net, tokenizer = load_model(source, dtype=torch.float32)
        targets = find_target_linears(net, recipe.weights.targets, recipe.weights.ignore)
    fisher: dict[str, torch.Tensor] = {}
    if windows is not None:
        with _stage(timings, "fisher"):
            report = (lambda done, total: progress("fisher", done, total)) if progress else None
            fisher = fisher_information(net, windows, targets, progress=report)

    unique = {t.data_ptr(): t for t in net.state_dict().values()}  # tied weights share storage: count once
    original_bytes = sum(t.numel() * t.element_size() for t in unique.values())
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.", suffix=".partial", dir=_parent(output)))
    try:
        quantized, n_weights, storage_bits = _write_tensors(
            net, targets, fisher, recipe, staging, seed, timings, progress
        )
        with _stage(timings, "write_metadata"):
            _write_metadata(net, tokenizer, recipe, quantized, storage_bits, n_weights, staging)
        provenance = Provenance(
            source_model=source.model_id,
            source_digest=source_digest(source),
            recipe_hash=recipe.spec_hash(),
            calibration_hash=calibration.spec_hash() if needs_calibration(recipe) and calibration else None,
            extra={"recipe": recipe.name, "seed": seed,
                   "calibration": calibration.name if needs_calibration(recipe) and calibration else None},
        )
        with _stage(timings, "seal"):
            manifest = seal_artifact(staging, provenance)
        _publish(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return CompressResult(
        output=str(output), model=source.model_id, recipe=recipe.name,
        bits_per_weight=round(storage_bits / n_weights, 4) if n_weights else 0.0,
        seconds=time.perf_counter() - started, timings=timings,
        quantized_modules=len(quantized), quantized_weights=n_weights,
        artifact_bytes=manifest.total_size, original_bytes=original_bytes, root_digest=manifest.root_digest,
    )


@contextlib.contextmanager
def _stage(timings: dict[str, float], name: str):  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    try:
        yield
    finally:
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - start


def _parent(output: Path) -> Path:
    parent = output.resolve().parent
    parent.mkdir(parents=True, exist_ok=True)
    return parent


def quantize_module(
    weight: torch.Tensor, fisher: torch.Tensor | None, recipe: Recipe, seed: int, timings: dict[str, float] | None = None
) -> QuantizedWeight:
    """Quantize one (out, in) fp32 weight as ``recipe.weights`` says; adds "sparse"/"kmeans"/"rtn" seconds to ``timings``."""
    w = recipe.weights
    timings = {} if timings is None else timings
    if w.method == "rtn":
        with _stage(timings, "rtn"):
            return rtn_quantize(weight, w.bits, w.group_size)
    fisher = fisher if w.sensitivity == "fisher" else None
    mask = None
    if w.sensitive_fraction or w.outlier_fraction:
        with _stage(timings, "sparse"):
            mask = select_sparse(weight, fisher, w.sensitive_fraction, w.outlier_fraction)
    with _stage(timings, "kmeans"):
        return quantize_lut(weight, fisher, w.bits, w.sensitive_fraction, w.outlier_fraction, seed=seed, mask=mask,
                            lut_dtype=w.lut_dtype)


def _write_tensors(
    net: nn.Module, targets: dict[str, nn.Linear], fisher: dict[str, torch.Tensor], recipe: Recipe,
    staging: Path, seed: int, timings: dict[str, float], progress: StageProgress | None,
) -> tuple[dict[str, dict[str, Any]], int, int]:
    """Stream every tensor of ``net`` into shards, quantizing target weights on the way (in model order)."""
    by_weight = {f"{name}.weight": name for name in targets}
    quantized: dict[str, dict[str, Any]] = {}
    n_weights = storage_bits = 0
    seen: set[int] = set()
    done = 0
    with ShardWriter(staging, recipe.output.max_shard_bytes) as writer:
        for key, tensor in net.state_dict().items():
            if tensor.data_ptr() in seen and tensor.numel():  # tied weights are stored once
                continue
            seen.add(tensor.data_ptr())
            module_name = by_weight.get(key)
            if module_name is None:
                with _stage(timings, "write"):
                    writer.add(key, tensor)
                continue
            qweight = quantize_module(tensor.detach().float(), fisher.pop(module_name, None), recipe, seed, timings)
            with _stage(timings, "write"):
                for name, part in qweight.to_tensors(module_name).items():
                    writer.add(name, part)
            out_f, in_f = tensor.shape
            quantized[module_name] = {"method": recipe.weights.method, "bits": recipe.weights.bits,
                                      "in_features": in_f, "out_features": out_f}
            if recipe.weights.method == "rtn":
                quantized[module_name]["group_size"] = recipe.weights.group_size or in_f
            n_weights += out_f * in_f
            storage_bits += qweight.storage_bits()
            done += 1
            if progress:
                progress("quantize", done, len(targets))
        with _stage(timings, "write"):
            writer.close()
    return quantized, n_weights, storage_bits


def _write_metadata(
    net: nn.Module, tokenizer: Any, recipe: Recipe, quantized: dict[str, dict[str, Any]],
    storage_bits: int, n_weights: int, staging: Path,
) -> None:
    config = net.config.to_dict()  # type: ignore[union-attr]
    w = recipe.weights
    config["quantization_config"] = {
        "quant_method": "squeeze",
        "format_version": FORMAT_VERSION,
        "squeeze_version": __version__,
        "method": w.method,
        "bits": w.bits,
        "sensitive_fraction": w.sensitive_fraction,
        "outlier_fraction": w.outlier_fraction,
        "sensitivity": w.sensitivity,
        "group_size": w.group_size,
        "lut_dtype": w.lut_dtype if w.method == "squeeze" else None,
        "bits_per_weight": round(storage_bits / n_weights, 4) if n_weights else None,
        "modules": quantized,
    }
    atomic_write_text(staging / "config.json", json.dumps(config, indent=2, sort_keys=True, default=str) + "\n")
    generation = getattr(net, "generation_config", None)
    if generation is not None:
        atomic_write_text(staging / "generation_config.json", generation.to_json_string(use_diff=True))
    atomic_write_text(staging / "recipe.yaml", recipe.to_yaml())
    tokenizer.save_pretrained(str(staging))


def _publish(staging: Path, output: Path) -> None:
    """Move the finished staging dir to ``output``; an old output is removed only after the swap."""
    old: Path | None = None
    if output.exists():
        old = output.with_name(f".{output.name}.old-{os.getpid()}")
        os.replace(output, old)
    os.replace(staging, output)
    fsync_directory(output.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
