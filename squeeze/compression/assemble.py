"""The write and seal stages of compress: the artifact assembled in the work area's staging directory.

Uninterrupted and resumed runs both take this path, quantized weights always read back from the layer-group
checkpoints, so their shards are byte-identical by construction. A failure here removes the half-built
staging directory (rebuilt from the checkpoints in seconds), which frees its disk at once.
"""

from __future__ import annotations

import contextlib
import shutil
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from squeeze.compression.job import CompressJob, timed, weight_format
from squeeze.compression.writer import (
    seal,
    state_bytes,
    unique_tensors,
    with_quantization,
    write_config,
    write_model_files,
    write_recipe,
    write_tensors,
)
from squeeze.config import EMBEDDING_AUTO, Recipe
from squeeze.errors import ResumeError
from squeeze.format.manifest import Provenance
from squeeze.format.quant_config import EmbeddingsEntry, ModuleEntry, QuantizationConfig, RecipeSummary
from squeeze.models.expert_params import UnroutedExpertsWarning, unrouted_message
from squeeze.models.targets import embedding_modules
from squeeze.models.weight_dtype import keep_dtype, source_dtype
from squeeze.version import __version__


@contextlib.contextmanager
def _discarded_on_error(staging: Path) -> Iterator[None]:
    try:
        yield
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # rebuilt from the checkpoints in seconds; frees its disk now
        raise


def write_stage(job: CompressJob) -> None:
    """Shards (model order, quantized weights from the checkpoints), config.json, tokenizer, recipe."""
    staging = job.work.staging
    if staging.exists():
        shutil.rmtree(staging)  # a previous run's half-assembled artifact; rebuilt from the checkpoints
    net = job.loaded_model()
    job.original_bytes = state_bytes(net)
    job.source_bytes = state_bytes(net, source_dtype(job.source))
    kept = keep_dtype(job.source, job.recipe.output.keep_dtype)
    write_artifact(job, staging, net, _artifact_tensors(job, kept), kept)


def write_artifact(
    job: CompressJob,
    staging: Path,
    net: nn.Module,
    tensors: Iterator[tuple[str, torch.Tensor]],
    kept: torch.dtype,
) -> None:
    """Shards from ``tensors`` (:func:`artifact_tensors`), then the warning about unrouted experts and the metadata
    of ``net`` into ``staging``; a failure discards ``staging``. The write stage of both an unbounded and a
    bounded (pipelines/bounded.py) run."""
    job.modules, job.n_weights, job.storage_bits = {}, 0, 0  # filled while the shards stream out
    job.unrouted, job.n_experts = {}, 0  # likewise, from the group checkpoints (experts modules)
    with _discarded_on_error(staging):
        write_tensors(staging, tensors, job.recipe.output.max_shard_bytes)
        warn_unrouted(job)
        quant = quantization_config(
            job.recipe, job.modules, job.storage_bits, job.n_weights, kept, embeddings=_embeddings_entry(job)
        )
        write_metadata(net, job.tokenizer, job.recipe, quant, staging)


def _embeddings_entry(job: CompressJob) -> EmbeddingsEntry | None:
    """``quantization_config.embeddings``: the quantized embeddings, their ``bits`` and, for a tied model, which
    one its LM head reads (``tied``: head name -> embedding name); None when the recipe (or, with
    ``embedding_bits: auto``, the budget's plan) keeps them. ``bits``: the recipe's width, or with auto the
    planned one (a {module: bits} mapping in the one case where an untied input embedding and LM head were
    planned to different widths)."""
    if not job.embedding_names:
        return None
    _found, head = embedding_modules(job.loaded_model())
    inputs = [name for name, module in job.embeddings.items() if isinstance(module, nn.Embedding)]
    bits: Any = job.recipe.weights.embedding_bits
    if bits == EMBEDDING_AUTO:  # the plan gave each its width (kept ones left job.embedding_names)
        planned = {name: job.bit_plan[name].bits for name in job.embedding_names}
        bits = next(iter(planned.values())) if len(set(planned.values())) == 1 else planned
    return EmbeddingsEntry.build(
        bits, list(job.embedding_names), {head: inputs[0]} if head is not None and inputs else {}
    )


def _kept(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An unquantized tensor as the artifact stores it: floating point in ``dtype``, anything else as is."""
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


def _artifact_tensors(job: CompressJob, kept: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the loaded model in state-dict order, tied ones once: :func:`artifact_tensors`."""
    state = unique_tensors(job.loaded_model().state_dict())
    return artifact_tensors(job, ((key, tensor_reader(tensor)) for key, tensor in state), kept)


def tensor_reader(tensor: torch.Tensor) -> Callable[[], torch.Tensor]:
    """A reader (for :func:`artifact_tensors`) of a tensor already in memory."""
    return lambda: tensor


def artifact_tensors(
    job: CompressJob, state: Iterable[tuple[str, Callable[[], torch.Tensor]]], kept: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """The artifact's tensors from ``state`` ((state-dict key, its tensor's reader), tied ones once, in order):
    a target's weight replaced by its quantized tensors from the group checkpoint, every other floating tensor
    read and cast to ``kept``. Fills ``job.modules``, ``n_weights``, ``storage_bits`` and the experts counts.
    The loaded model's state here; the source's, read tensor by tensor, in a bounded run (pipelines/bounded.py)."""
    group_of = {name: index for index, names in enumerate(job.groups) for name in names}
    remaining = {index: len(names) for index, names in enumerate(job.groups)}
    loaded: dict[int, tuple[dict[str, torch.Tensor], dict[str, Any]]] = {}
    for key, read in state:
        # a linear's weight is ``{name}.weight``; an expert parameter's key is its name (``...experts.down_proj``)
        module_name = key.removesuffix(".weight") if key.endswith(".weight") else key
        if module_name not in group_of:  # a norm gain weights.tuning tuned comes from the tune stage
            yield key, _kept(job.tuned[key] if key in job.tuned else read(), kept)
            continue
        index = group_of[module_name]
        if index not in loaded:
            loaded[index] = _load_group(job, index)
            count_experts(job, loaded[index][1])
        parts, meta = loaded[index]
        for name in meta["tensors"][module_name]:
            yield name, job.tuned.get(name, parts[name])
        remaining[index] -= 1
        if not remaining[index]:
            del loaded[index]
        # written by the weight's format when it was quantized; checked once here, as a loader checks it
        entry = job.modules[module_name] = ModuleEntry.from_dict(module_name, meta["specs"][module_name])
        job.n_weights += entry.n_weights
        job.storage_bits += int(meta["storage_bits"][module_name])
        if module_name in meta.get("lnq", {}):
            job.lnq[module_name] = dict(meta["lnq"][module_name])


def count_experts(job: CompressJob, meta: dict[str, Any]) -> None:
    """Add a group checkpoint's experts modules (their expert counts) and unrouted experts to the job's."""
    job.n_experts += sum(int(n) for n in meta.get("experts", {}).values())
    job.unrouted.update({name: list(ids) for name, ids in meta.get("unrouted", {}).items()})


def warn_unrouted(job: CompressJob) -> None:
    """One warning when calibration never reached some experts (their Fisher is zero, so the LUT k-means fit
    their rows with uniform weights); their count goes into the result. Runs where the artifact is written (one
    process, or rank 0 under torchrun) from the committed groups, so a resumed run warns the same."""
    if job.unrouted:
        warnings.warn(unrouted_message(job.unrouted, job.n_experts), UnroutedExpertsWarning, stacklevel=2)


def _load_group(job: CompressJob, index: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    with timed(job.timings, "checkpoint"):
        group = job.work.load_group(index, job.groups[index])
    if group is None:  # removed or corrupted since it was committed: the run must start that group over
        raise ResumeError(
            f"layer group checkpoint {job.work.group_path(index)} is missing or unreadable",
            hint="rerun the same command: the group is quantized again",
        )
    if "specs" not in group[1]:  # committed by a squeeze that kept no module entries in its checkpoints
        raise ResumeError(
            f"layer group checkpoint {job.work.group_path(index)} was written by an older squeeze",
            hint="rerun with --restart to quantize again",
        )
    return group


def quantization_config(
    recipe: Recipe,
    quantized: Mapping[str, ModuleEntry],
    storage_bits: int,
    n_weights: int,
    kept_dtype: torch.dtype = torch.float32,
    *,
    embeddings: EmbeddingsEntry | None = None,
) -> QuantizationConfig:
    """The artifact's ``quantization_config``: the recipe's summary, every quantized module's entry
    (``quantized``), the bits per weight (``storage_bits / n_weights``), the unquantized tensors' dtype and the
    quantized embeddings."""
    w = recipe.weights
    return QuantizationConfig(
        squeeze_version=__version__,
        method=w.method,
        modules=dict(quantized),
        summary=RecipeSummary(
            # a budget recipe has no one width: each module entry carries its own, and target_bpw the average asked
            bits=None if w.target_bpw is not None else w.bits,
            target_bpw=w.target_bpw,
            sensitive_fraction=w.sensitive_fraction,
            outlier_fraction=w.outlier_fraction,
            sensitivity=w.sensitivity,
            group_size=w.group_size,
            lut_dtype=w.lut_dtype if "lut_dtype" in weight_format(recipe).recipe_options else None,
            bits_per_weight=round(storage_bits / n_weights, 4) if n_weights else None,
        ),
        # the dtype every unquantized tensor is stored in; loaders compute in float32 whatever it is
        unquantized_dtype=str(kept_dtype).removeprefix("torch."),
        # weights.embedding_bits: the loaders rebuild the embedding (and a tied head)
        embeddings=embeddings,
    )


def write_metadata(net: nn.Module, tokenizer: Any, recipe: Recipe, quant: QuantizationConfig, staging: Path) -> None:
    """config.json with the artifact's ``quantization_config``, then the generation config, tokenizer, recipe."""
    config = with_quantization(net.config.to_dict(), quant)  # type: ignore[union-attr, operator]
    write_config(staging, config)
    write_model_files(staging, net, tokenizer)
    write_recipe(staging, recipe.to_yaml())


def seal_stage(job: CompressJob) -> None:
    """Seal the staging directory (its manifest records where the artifact came from) and sum up the run."""
    calibration = job.calibration
    provenance = Provenance(
        source_model=job.source.model_id,
        source_digest=job.digest,
        recipe_hash=job.recipe.spec_hash(),
        calibration_hash=calibration.spec_hash() if calibration else None,
        extra={"recipe": job.recipe.name, "seed": job.seed, "calibration": calibration.name if calibration else None},
    )
    with _discarded_on_error(job.work.staging):
        manifest = seal(job.work.staging, provenance)
    job.manifest = manifest
    job.summary = {
        "output": str(job.work.output),
        "model": job.source.model_id,
        "recipe": job.recipe.name,
        "bits_per_weight": round(job.storage_bits / job.n_weights, 4) if job.n_weights else 0.0,
        "quantized_modules": len(job.modules),
        "quantized_weights": job.n_weights,
        "artifact_bytes": manifest.total_size,
        "original_bytes": job.original_bytes,
        "source_bytes": job.source_bytes,
        "root_digest": manifest.root_digest,
        "experts": job.n_experts,
        "unrouted_experts": sum(len(ids) for ids in job.unrouted.values()),
    }


__all__ = ["write_stage", "write_metadata", "seal_stage", "count_experts", "warn_unrouted"]
