"""The compress pipeline: preflight -> lock -> calibration -> Fisher -> per-layer-group quantization -> sealed artifact.

Work happens in the resumable work area ``<output>/.squeeze-work`` (see workarea.py): the Fisher information
and each quantized layer group are committed there as checkpoints, so a rerun of an interrupted job skips
what is done. The artifact is assembled and sealed in the work area and moved into the output only when
complete (manifest last); with ``overwrite`` the old artifact is removed only at that point, and only the
files its manifest lists (see output.py: a directory holding anything else is refused before any work).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from squeeze.version import __version__
from squeeze.calibrate.fisher import fisher_information
from squeeze.calibrate.windows import calibration_windows
from squeeze.compression.fingerprint import build_fingerprint, fingerprint_differences
from squeeze.compression.lock import OutputLock
from squeeze.compression.output import (
    check_not_model_path,
    check_output_dir,
    foreign_entries,
    output_path,
    owned_paths,
    remove_owned,
)
from squeeze.compression.preflight import (
    SizeEstimate,
    check_context_length,
    check_disk,
    check_memory,
    estimate_peak_memory,
    estimate_size,
    meta_model,
)
from squeeze.compression.signals import SignalGuard
from squeeze.compression.workarea import WORK_NAME, WorkArea
from squeeze.config import CalibrationSpec, Recipe
from squeeze.errors import ConfigError, Interrupted, ResourceError, ResumeError
from squeeze.format.atomic import atomic_write_text, fsync_directory
from squeeze.format.manifest import MANIFEST_NAME, Provenance
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
    resume: bool = False,
    restart: bool = False,
    force: bool = False,
    progress: StageProgress | None = None,
) -> CompressResult:
    """Compress ``model`` with ``recipe`` into the artifact directory ``output``. See squeeze.api.compress."""
    started = time.perf_counter()
    timings: dict[str, float] = {}
    output = output_path(output)  # absolute; `current -> v3` means v3; a path too long for the work area is refused
    if resume and restart:
        raise ConfigError("--resume and --restart contradict each other", hint="pass at most one of them")
    # -- preflight: nothing expensive happens before every check below has passed; only the lock is written
    source = model if isinstance(model, ModelSource) else resolve_model(model)
    work = WorkArea(output)
    if work.is_leftover() and (output / MANIFEST_NAME).is_file():
        with OutputLock(work.root):  # held by a live run (before its fingerprint is written): LockError
            work.remove()  # garbage next to a sealed artifact (it made verify fail): nothing to resume in it
    if work.is_publishing():  # a publish cut short: its record says which files it replaces (checked there)
        check_not_model_path(output, [source.path])
    else:
        check_output_dir(output, overwrite, ignore=(WORK_NAME,), protected=[source.path])
    if resume and not work.root.is_dir():
        raise ResumeError(f"nothing to resume: {output} has no work area ({WORK_NAME})",
                          hint="run the command without --resume to start a new compression")
    calibrating = needs_calibration(recipe)
    if calibrating and calibration is None:
        raise ConfigError(
            "no calibration text given, and this recipe weights k-means by Fisher sensitivity",
            hint="pass a text file or spec (e.g. --calibration my_corpus.txt, or wikitext2-train), "
                 "or use --sensitivity uniform",
        )
    calibration = calibration if calibrating else None

    created_output = not output.exists()
    created_work = work.create()
    lock = OutputLock(work.root).acquire()  # a concurrent run into this output is refused here, at once
    guard = SignalGuard()
    estimate: SizeEstimate | None = None
    try:
        skeleton = meta_model(source)
        estimate = estimate_size(skeleton, recipe)  # also raises ModelError when there is no target linear
        checkpoint_bytes = estimate.quantized_bytes + (estimate.n_quantized_weights * 4 if calibrating else 0)
        already = 0 if restart else work.disk_bytes()
        check_disk(output, estimate, checkpoint_bytes - already, force)
        check_memory(estimate_peak_memory(skeleton, recipe, calibration.seq_len if calibration else None), force)
        if calibration is not None:
            check_context_length(skeleton, calibration.seq_len)
        del skeleton
        with guard:
            return _run_locked(source, work, recipe, calibration, seed, overwrite, restart, guard, timings,
                               started, progress)
    except BaseException as exc:
        if created_work and not work.has_checkpoints():  # nothing worth resuming: leave no trace
            work.remove()
            if created_output:
                with contextlib.suppress(OSError):
                    output.rmdir()
        if guard.received is not None:
            raise _interrupted(guard.received, work) from None
        if _is_disk_full(exc):
            size = f" (the artifact alone needs about {estimate.total_bytes / 1e9:.2f} GB)" if estimate else ""
            raise ResourceError(
                f"no space left on the device while writing into {output}; {_committed(work)}",
                hint=f"free some disk space{size} and rerun the same command: it resumes from the last committed "
                     "layer group; the source model was only read, never written",
            ) from exc
        raise
    finally:
        lock.release()


def _run_locked(
    source: ModelSource, work: WorkArea, recipe: Recipe, calibration: CalibrationSpec | None, seed: int,
    overwrite: bool, restart: bool, guard: SignalGuard, timings: dict[str, float], started: float,
    progress: StageProgress | None,
) -> CompressResult:
    """Everything after the lock: fingerprint, (resumed) Fisher and layer groups, assembly, publish."""
    if restart:
        work.reset()
    work.clean_temps()
    with _stage(timings, "fingerprint"):
        digest = source_digest(source)
        fingerprint = build_fingerprint(
            source_model=source.model_id, source_digest=digest, recipe=recipe, calibration=calibration, seed=seed,
            squeeze_version=__version__, format_version=FORMAT_VERSION,
        )
    _check_fingerprint(work, fingerprint)
    record = work.publishing()
    if record is not None:  # killed while publishing: the artifact is complete in the work area
        with guard.deferred():
            _publish(work, record["old_files"])
        return _result(record["summary"], started, timings)

    windows = None
    if calibration is not None and not work.has_fisher():
        with _stage(timings, "calibration_data"):  # before the model loads: a too-short text fails fast
            windows = calibration_windows(calibration, load_tokenizer(source))  # (n, T)
    with _stage(timings, "load"):
        net, tokenizer = load_model(source, dtype=torch.float32)
        targets = find_target_linears(net, recipe.weights.targets, recipe.weights.ignore)
    fisher: dict[str, torch.Tensor] = {}
    if calibration is not None:
        with _stage(timings, "checkpoint"):
            loaded = work.load_fisher(list(targets))
        if loaded is not None:
            fisher = loaded
        else:
            if windows is None:  # the saved Fisher was unreadable
                windows = calibration_windows(calibration, load_tokenizer(source))
            with _stage(timings, "fisher"):
                report = (lambda done, total: progress("fisher", done, total)) if progress else None
                fisher = fisher_information(net, windows, targets, progress=report)
            with _stage(timings, "checkpoint"):
                work.save_fisher(fisher)
        del windows

    groups = layer_groups(net, targets)
    _quantize_groups(net, targets, groups, fisher, recipe, work, seed, timings, progress)
    del fisher
    unique = {t.data_ptr(): t for t in net.state_dict().values()}  # tied weights share storage: count once
    original_bytes = sum(t.numel() * t.element_size() for t in unique.values())

    staging = work.staging
    if staging.exists():
        shutil.rmtree(staging)  # a previous run's half-assembled artifact; rebuilt from the checkpoints
    provenance = Provenance(
        source_model=source.model_id,
        source_digest=digest,
        recipe_hash=recipe.spec_hash(),
        calibration_hash=calibration.spec_hash() if calibration else None,
        extra={"recipe": recipe.name, "seed": seed, "calibration": calibration.name if calibration else None},
    )
    try:
        quantized, n_weights, storage_bits = _assemble(net, targets, groups, recipe, work, staging, timings)
        with _stage(timings, "write_metadata"):
            _write_metadata(net, tokenizer, recipe, quantized, storage_bits, n_weights, staging)
        with _stage(timings, "seal"):
            manifest = seal_artifact(staging, provenance)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # rebuilt from the checkpoints in seconds; frees its disk now
        raise
    summary = {
        "output": str(work.output), "model": source.model_id, "recipe": recipe.name,
        "bits_per_weight": round(storage_bits / n_weights, 4) if n_weights else 0.0,
        "quantized_modules": len(quantized), "quantized_weights": n_weights,
        "artifact_bytes": manifest.total_size, "original_bytes": original_bytes, "root_digest": manifest.root_digest,
    }
    with guard.deferred(), _stage(timings, "publish"):
        # checked again: the output may have changed during the run; what the old manifest lists now is
        # recorded before anything is touched, so a publish cut short knows on rerun what it may remove
        old_files = check_output_dir(work.output, overwrite, ignore=(WORK_NAME,))
        work.mark_publishing(summary, fingerprint, sorted(old_files))
        _publish(work, old_files)
    return _result(summary, started, timings)


def _result(summary: dict[str, Any], started: float, timings: dict[str, float]) -> CompressResult:
    return CompressResult(**summary, seconds=time.perf_counter() - started, timings=timings)


def _check_fingerprint(work: WorkArea, fingerprint: dict[str, Any]) -> None:
    """Write the fingerprint of a new job, or refuse to resume a work area made by a different one."""
    saved = work.read_fingerprint()
    if saved is None:
        if work.has_checkpoints():
            raise ResumeError(f"the work area {work.root} has checkpoints but no fingerprint, so it cannot be resumed",
                              hint="pass --restart to discard it and start over")
        work.write_fingerprint(fingerprint)
        return
    differences = fingerprint_differences(saved, fingerprint)
    if differences:
        more = f"; and {len(differences) - 6} more" if len(differences) > 6 else ""
        raise ResumeError(
            f"cannot resume the work area in {work.output}: it was made by a different job ("
            + "; ".join(differences[:6]) + more + ")",
            hint="rerun with the original model, recipe, calibration and seed, or pass --restart to discard "
                 "the work area and start over",
        )


def _committed(work: WorkArea) -> str:
    groups = work.committed_groups()
    parts = [f"{groups} layer group(s)"] if groups else []
    if work.has_fisher():
        parts.append("the Fisher information")
    if not parts:
        return "nothing was committed yet"
    return f"{' and '.join(parts)} committed in {work.root}"


def _interrupted(signum: int, work: WorkArea) -> Interrupted:
    name = signal.Signals(signum).name
    resumable = work.root.is_dir() and work.has_checkpoints()
    hint = ("rerun the same command (or add --resume) to continue from the last committed layer group" if resumable
            else "nothing was committed, so there is nothing to resume: rerun the same command to start again")
    return Interrupted(f"interrupted by {name}; {_committed(work)}", hint=hint, signum=signum,
                       work_dir=str(work.root), resumable=resumable)


def _is_disk_full(exc: BaseException | None) -> bool:
    """ENOSPC / EDQUOT anywhere in the chain; safetensors' Rust writer reports it only as text."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(exc)
        if "No space left on device" in text or "StorageFull" in text or "Disk quota exceeded" in text:
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


@contextlib.contextmanager
def _stage(timings: dict[str, float], name: str):  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    try:
        yield
    finally:
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - start


def quantize_module(
    weight: torch.Tensor, fisher: torch.Tensor | None, recipe: Recipe, timings: dict[str, float] | None = None
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
        return quantize_lut(weight, fisher, w.bits, w.sensitive_fraction, w.outlier_fraction, mask=mask,
                            lut_dtype=w.lut_dtype)


def layer_groups(net: nn.Module, targets: dict[str, nn.Linear]) -> list[list[str]]:
    """Target linears grouped by decoder block (``...layers.<i>``), in model order: the checkpoint unit."""
    order = [key.removesuffix(".weight") for key in net.state_dict() if key.removesuffix(".weight") in targets]
    groups: dict[str, list[str]] = {}
    for name in dict.fromkeys(order):
        match = _BLOCK_RE.match(name)
        groups.setdefault(match.group(1) if match else name, []).append(name)
    return list(groups.values())


_BLOCK_RE = re.compile(r"^(.*?\.(?:layers|h|blocks|layer)\.\d+)\.")


def _quantize_groups(
    net: nn.Module, targets: dict[str, nn.Linear], groups: list[list[str]], fisher: dict[str, torch.Tensor],
    recipe: Recipe, work: WorkArea, seed: int, timings: dict[str, float], progress: StageProgress | None,
) -> None:
    """Quantize every group without a committed checkpoint, committing each as soon as it is done."""
    done = 0
    for index, names in enumerate(groups):
        with _stage(timings, "checkpoint"):
            committed = work.has_group(index, names)
        if committed:
            for name in names:
                fisher.pop(name, None)
        else:
            tensors: dict[str, torch.Tensor] = {}
            meta: dict[str, Any] = {"modules": names, "tensors": {}, "storage_bits": {}}
            for name in names:
                weight = targets[name].weight.detach().float()
                qweight = quantize_module(weight, fisher.pop(name, None), recipe, timings)
                parts = qweight.to_tensors(name)
                tensors.update(parts)
                meta["tensors"][name] = list(parts)
                meta["storage_bits"][name] = qweight.storage_bits()
            with _stage(timings, "checkpoint"):
                work.save_group(index, tensors, meta)
        done += len(names)
        if progress:
            progress("quantize", done, len(targets))


def _assemble(
    net: nn.Module, targets: dict[str, nn.Linear], groups: list[list[str]], recipe: Recipe, work: WorkArea,
    staging: Path, timings: dict[str, float],
) -> tuple[dict[str, dict[str, Any]], int, int]:
    """Stream every tensor of ``net`` into shards in model order, quantized weights read from the checkpoints.

    Uninterrupted and resumed runs both take this path, so their shards are byte-identical by construction.
    """
    group_of = {name: index for index, names in enumerate(groups) for name in names}
    remaining = {index: len(names) for index, names in enumerate(groups)}
    loaded: dict[int, tuple[dict[str, torch.Tensor], dict[str, Any]]] = {}
    quantized: dict[str, dict[str, Any]] = {}
    n_weights = storage_bits = 0
    seen: set[int] = set()
    with ShardWriter(staging, recipe.output.max_shard_bytes) as writer:
        for key, tensor in net.state_dict().items():
            if tensor.data_ptr() in seen and tensor.numel():  # tied weights are stored once
                continue
            seen.add(tensor.data_ptr())
            module_name = key.removesuffix(".weight") if key.endswith(".weight") else None
            if module_name not in group_of:
                with _stage(timings, "write"):
                    writer.add(key, tensor)
                continue
            index = group_of[module_name]
            if index not in loaded:
                with _stage(timings, "checkpoint"):
                    group = work.load_group(index, groups[index])
                if group is None:  # removed or corrupted since it was committed: the run must start that group over
                    raise ResumeError(f"layer group checkpoint {work.group_path(index)} is missing or unreadable",
                                      hint="rerun the same command: the group is quantized again")
                loaded[index] = group
            parts, meta = loaded[index]
            with _stage(timings, "write"):
                for name in meta["tensors"][module_name]:
                    writer.add(name, parts[name])
            remaining[index] -= 1
            if not remaining[index]:
                del loaded[index]
            out_f, in_f = tensor.shape
            quantized[module_name] = {"method": recipe.weights.method, "bits": recipe.weights.bits,
                                      "in_features": in_f, "out_features": out_f}
            if recipe.weights.method == "rtn":
                quantized[module_name]["group_size"] = recipe.weights.group_size or in_f
            n_weights += out_f * in_f
            storage_bits += int(meta["storage_bits"][module_name])
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


def _publish(work: WorkArea, old_files: Iterable[str]) -> None:
    """Move the sealed artifact from the work area into the output, manifest last, then drop the work area.

    The old artifact's manifest goes first (it stops verifying before anything else changes), then the old
    files the new artifact does not replace; the new files are renamed in one by one (a rename over an old
    file of the same name replaces it atomically), the manifest last. Only paths in ``old_files`` (what
    the old manifest listed, recorded before the publish began) or in the new manifest are ever touched.
    A run killed at any point finishes this on rerun.
    """
    staging, output = work.staging, work.output
    if (staging / MANIFEST_NAME).is_file():
        new_files = owned_paths(staging)
        foreign = foreign_entries(output, set(old_files) | new_files, ignore=(WORK_NAME,))
        if foreign:  # appeared since the run's checks: never overwritten, never deleted
            raise ConfigError(
                f"output directory {output} now holds files squeeze did not write: {', '.join(foreign)}",
                hint="move them away and rerun the same command: the sealed artifact is kept in the work area",
            )
        remove_owned(output, old_files, keep=new_files - {MANIFEST_NAME})
        for relative in sorted(new_files - {MANIFEST_NAME}):
            source = staging / relative
            if source.is_file():  # else moved by the run that was cut short
                (output / relative).parent.mkdir(parents=True, exist_ok=True)
                os.replace(source, output / relative)
        fsync_directory(output)
        os.replace(staging / MANIFEST_NAME, output / MANIFEST_NAME)
        fsync_directory(output)
    if staging.is_dir():
        shutil.rmtree(staging)  # empty directories, in squeeze's own work area
    work.remove()
    fsync_directory(output)
