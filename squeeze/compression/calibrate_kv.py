"""``squeeze calibrate-kv``: fit KV-cache scales and add them to an artifact (or make one from a plain model).

An artifact gains ``kv_cache.safetensors`` ({attn}.k_scale / .k_zero / .v_clip) and a ``kv_cache`` entry in
config.json's quantization_config; its model shards are untouched (hard links). The new artifact is built
and sealed in a hidden staging directory next to the target and swapped in only when complete, by an
atomic exchange of the two directories (squeeze.format.swap), so the path holds a complete artifact at every
instant and a failed or killed run leaves the artifact exactly as it was. Staging directories a killed run
left behind are removed by the next run on that target. The scales live in their own file,
not in the model shards and index, because transformers' loader would take them for unexpected weights.
"""

from __future__ import annotations

import contextlib
import fcntl
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
from safetensors.torch import save as safetensors_save

from squeeze.version import __version__
from squeeze.calibrate.kv import KVCalibration, calibrate_kv
from squeeze.calibrate.windows import calibration_windows
from squeeze.compression.preflight import check_context_length
from squeeze.config import DEFAULT_SINK_TOKENS, CalibrationSpec
from squeeze.compression.output import (
    check_not_model_path,
    check_output_dir,
    check_writable,
    output_path,
    foreign_entries,
    owned_paths,
    remove_owned,
)
from squeeze.errors import ConfigError, FormatError, IntegrityError, SqueezeError
from squeeze.format.atomic import atomic_write_bytes, atomic_write_text, directory_mode
from squeeze.format.manifest import MANIFEST_NAME, Manifest, Provenance
from squeeze.format.shards import ShardWriter
from squeeze.format.swap import aside_pattern, restore_aside, swap_in
from squeeze.format.verify import read_manifest, seal_artifact
from squeeze.limits import check_kv_bits
from squeeze.quant.kv_spec import KV_FILE, kv_bytes_table

#: progress(stage, done, total); stage "kv" counts calibration windows.
StageProgress = Callable[[str, int, int], None]


@dataclass
class CalibrateKVResult:
    """What calibrate-kv wrote and measured."""

    output: str
    bits: int
    sink_tokens: int
    calibration: dict[str, Any]
    bytes_per_token: dict[str, int]
    seconds: float
    timings: dict[str, float] = field(default_factory=dict)
    root_digest: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"output": self.output, "bits": self.bits, "sink_tokens": self.sink_tokens,
                "calibration": self.calibration, "kv_bytes_per_token": self.bytes_per_token,
                "seconds": round(self.seconds, 3), "timings": {k: round(v, 3) for k, v in self.timings.items()},
                "root_digest": self.root_digest}


def default_calibration(target: str | os.PathLike[str]) -> str:
    """The built-in calibration spec ``target`` (an artifact) was compressed with; ConfigError when none."""
    from squeeze.config import CALIBRATION_DIR, builtin_names
    from squeeze.runtime.loader import is_artifact

    name = None
    if is_artifact(target):
        try:
            name = read_manifest(Path(target)).provenance.extra.get("calibration")
        except SqueezeError:
            name = None
    if isinstance(name, str) and name in builtin_names(CALIBRATION_DIR):
        return name
    raise ConfigError(
        f"no calibration text given for {target}, and it records no built-in calibration spec to reuse",
        hint="pass --calibration (a text file, a spec YAML, or a built-in spec: "
             f"{', '.join(builtin_names(CALIBRATION_DIR))}); never the text you evaluate on",
    )


def run_calibrate_kv(
    target: str | os.PathLike[str],
    calibration: CalibrationSpec,
    bits: int,
    *,
    output: str | os.PathLike[str] | None = None,
    sink_tokens: int = DEFAULT_SINK_TOKENS,
    key_group: int | None = None,
    value_group: int | None = None,
    overwrite: bool = False,
    progress: StageProgress | None = None,
) -> CalibrateKVResult:
    """Calibrate KV scales for ``target`` (artifact or model) and write them; see squeeze.api.calibrate_kv."""
    from squeeze.models.source import load_model, resolve_model
    from squeeze.runtime.loader import is_artifact, load_artifact

    started = time.perf_counter()
    timings: dict[str, float] = {}
    bits = check_kv_bits(bits)
    if sink_tokens < 0:
        raise ConfigError(f"--sink-tokens must be >= 0, found {sink_tokens}")
    if calibration.seq_len <= sink_tokens:
        raise ConfigError(
            f"calibration windows of {calibration.seq_len} tokens are not longer than the {sink_tokens} sink token(s)",
            hint="use a longer --seq-len or fewer --sink-tokens",
        )
    source = Path(os.path.realpath(os.fspath(target)))  # `current -> v3`: the artifact (and swap) is at v3
    out = output_path(output if output is not None else source)
    restore_aside(out)  # a fallback swap cut short by a kill: the old artifact goes back before anything
    artifact = is_artifact(source)
    _check_output(target, source, out, artifact, overwrite=overwrite, in_place=output is None)

    t = time.perf_counter()
    old_manifest = None
    if artifact:
        old_manifest = read_manifest(source)
        loaded = load_artifact(source, verify=True, dense_cache=True)  # IntegrityError before any work
        model, tokenizer = loaded.model, loaded.tokenizer
        config = _verified_config(loaded)
    else:
        model, tokenizer = load_model(resolve_model(str(target)), dtype=torch.float32)
        config = None
    timings["load"] = time.perf_counter() - t
    check_context_length(model, calibration.seq_len)

    t = time.perf_counter()
    windows = calibration_windows(calibration, tokenizer)  # (n, T)
    report = (lambda done, total: progress("kv", done, total)) if progress else None
    result = calibrate_kv(model, windows, bits, sink_tokens=sink_tokens, key_group=key_group, value_group=value_group,
                          progress=report)
    timings["calibrate"] = time.perf_counter() - t

    t = time.perf_counter()
    with _staging(out) as staging:
        if old_manifest is not None and config is not None:
            linked = _link_artifact(source, staging, old_manifest)
        else:
            linked, config = {}, _write_plain_artifact(model, tokenizer, staging)
        config_written = _write_kv(staging, config, result, calibration)
        provenance = _provenance(old_manifest.provenance if old_manifest else None, target, result, calibration)
        manifest = seal_artifact(staging, provenance)
        _check_linked(manifest, linked)
        _replace(staging, out, overwrite=overwrite or out == source)
    timings["write"] = time.perf_counter() - t
    return CalibrateKVResult(
        output=str(out), bits=bits, sink_tokens=sink_tokens, calibration=result.to_dict(),
        bytes_per_token=kv_bytes_table(config_written), seconds=time.perf_counter() - started,
        timings=timings, root_digest=manifest.root_digest,
    )


def _check_output(target: str | os.PathLike[str], source: Path, out: Path, artifact: bool, *, overwrite: bool,
                  in_place: bool) -> None:
    """Check where the new artifact goes (``out``) before any work; cleans what a killed run left next to it."""
    from squeeze.models.source import resolve_model

    if in_place and not artifact:
        raise ConfigError(f"{target} is a model, not a squeeze artifact, and no --output was given",
                          hint="pass --output DIR: an artifact with the original weights and calibrated KV is written there")
    if out != source or not artifact:
        # a new place: the usual output rules (refuse foreign files; never over, in or around the input)
        model_path = source if artifact else resolve_model(str(target)).path
        check_not_model_path(out, [model_path], what="the model or artifact being calibrated")
        check_output_dir(out, overwrite)
    check_writable(out.parent)  # the staging directory and the swap live next to the output
    _clean_leftovers(out)


def _parent(output: Path) -> Path:
    parent = output.parent
    parent.mkdir(parents=True, exist_ok=True)
    return parent


_STAGING_INFIX = ".kv-"
_STAGING_SUFFIX = ".partial"


@contextlib.contextmanager
def _staging(out: Path):  # type: ignore[no-untyped-def]
    """A fresh hidden staging directory next to ``out``, flock-ed while in use; removed on failure.

    The lock tells a later run's leftover clean-up that this directory belongs to a live process.
    """
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}{_STAGING_INFIX}", suffix=_STAGING_SUFFIX, dir=_parent(out)))
    os.chmod(staging, directory_mode())  # mkdtemp makes it 0700; the swapped-in artifact keeps this mode
    fd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # not yet swapped: everything in it was written here
        raise
    finally:
        os.close(fd)


def _replace(staging: Path, out: Path, *, overwrite: bool) -> None:
    """Swap the sealed ``staging`` in at ``out`` atomically, then discard what was there before."""
    if os.path.lexists(out):  # checked again: files may have appeared in the output during calibration
        check_output_dir(out, overwrite)
    previous = swap_in(staging, out)
    if previous is not None:
        _discard(previous, out, unfinished_staging=False)


def _discard(old: Path, out: Path, *, unfinished_staging: bool) -> None:
    """Delete a directory moved aside from ``out`` (its old artifact), or a staging directory left behind.

    Only what squeeze wrote goes: an old artifact's manifest-listed files (checked to be all it holds just
    before the swap), or the whole of a staging directory that was never sealed (``unfinished_staging``:
    squeeze wrote all of it). Should anything else be there, only the listed files are removed and the
    directory is kept, visibly renamed, with the rest.
    """
    try:
        owned: frozenset[str] | None = owned_paths(old)
    except (FormatError, OSError):
        owned = None if unfinished_staging else frozenset()
    if owned is not None and foreign_entries(old, owned):
        kept = Path(tempfile.mkdtemp(prefix=f"{out.name}.kv-leftover-", dir=old.parent))
        os.rename(old, kept)
        remove_owned(kept, owned)
        return
    shutil.rmtree(old, ignore_errors=True)


def _clean_leftovers(out: Path) -> None:
    """Drop what a killed run left next to ``out``: stale staging dirs, an old artifact moved aside."""
    parent = out.parent
    if not parent.is_dir():
        return
    patterns = (f".{out.name}{_STAGING_INFIX}*{_STAGING_SUFFIX}", aside_pattern(out))
    for candidate in sorted({p for pattern in patterns for p in parent.glob(pattern)}):
        if candidate.is_symlink() or not candidate.is_dir():
            continue
        fd = os.open(candidate, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # a live calibrate-kv is writing it
        finally:
            os.close(fd)
        _discard(candidate, out, unfinished_staging=candidate.name.startswith(f".{out.name}{_STAGING_INFIX}"))


def _verified_config(loaded: Any) -> dict[str, Any]:
    """config.json as the loader verified it (never re-read from disk)."""
    captured = loaded.report.captured["config.json"].data
    return json.loads(bytes(captured.numpy()))


def _link_artifact(source: Path, staging: Path, manifest: Manifest) -> dict[str, str]:
    """Hard-link (or copy) every file of ``source`` but those calibrate-kv rewrites: {path: expected sha256}."""
    rewritten = {MANIFEST_NAME, "config.json", KV_FILE}
    linked = {}
    for entry in manifest.files:
        if entry.path in rewritten:
            continue
        target = staging / entry.path
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(source / entry.path, target, follow_symlinks=False)
        except OSError:
            shutil.copyfile(source / entry.path, target, follow_symlinks=False)
        linked[entry.path] = entry.sha256
    return linked


def _check_linked(manifest: Manifest, linked: dict[str, str]) -> None:
    """The files carried over must still be the ones the old manifest signed (swapped since loading: refuse)."""
    for entry in manifest.files:
        if entry.path in linked and linked[entry.path] != entry.sha256:
            raise IntegrityError(f"{entry.path} changed on disk while calibrate-kv ran; nothing was written",
                                 hint="run `squeeze verify` on the artifact, then calibrate again")


def _write_plain_artifact(model: torch.nn.Module, tokenizer: Any, staging: Path) -> dict[str, Any]:
    """The original weights as shards, tokenizer, generation config; returns config.json's dict (unwritten)."""
    seen: set[int] = set()
    with ShardWriter(staging, 2_000_000_000) as writer:
        for key, tensor in model.state_dict().items():
            if tensor.numel() and tensor.data_ptr() in seen:  # tied weights are stored once
                continue
            seen.add(tensor.data_ptr())
            writer.add(key, tensor.detach().contiguous())
        writer.close()
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        atomic_write_text(staging / "generation_config.json", generation.to_json_string(use_diff=True))
    tokenizer.save_pretrained(str(staging))
    config = model.config.to_dict()  # type: ignore[union-attr, operator]
    config["quantization_config"] = {"quant_method": "squeeze", "format_version": 1, "squeeze_version": __version__,
                                     "method": "none", "modules": {}}
    return config


def _write_kv(staging: Path, config: dict[str, Any], result: KVCalibration,
              calibration: CalibrationSpec) -> dict[str, Any]:
    """kv_cache.safetensors plus config.json with its ``quantization_config.kv_cache`` entry (returned)."""
    atomic_write_bytes(staging / KV_FILE, safetensors_save(result.spec.to_tensors(), metadata={"format": "pt"}))
    config = dict(config)
    quant = dict(config.get("quantization_config") or {"quant_method": "squeeze", "format_version": 1, "modules": {}})
    quant["kv_cache"] = {**result.spec.to_config(), "file": KV_FILE, "calibration": calibration.name,
                         "calibration_hash": calibration.spec_hash()}
    config["quantization_config"] = quant
    atomic_write_text(staging / "config.json", _json(config))
    return config


def _provenance(old: Provenance | None, target: str | os.PathLike[str], result: KVCalibration,
                calibration: CalibrationSpec) -> Provenance:
    kv = {"bits": result.spec.bits, "calibration": calibration.name, "calibration_hash": calibration.spec_hash()}
    if old is None:
        from squeeze.models.source import resolve_model, source_digest

        source = resolve_model(str(target))
        return Provenance(source_model=source.model_id, source_digest=source_digest(source), extra={"kv_cache": kv})
    return Provenance(old.source_model, old.source_digest, old.recipe_hash, old.calibration_hash,
                      {**old.extra, "kv_cache": kv})


def _json(config: dict[str, Any]) -> str:
    return json.dumps(config, indent=2, sort_keys=True, default=str) + "\n"


__all__ = ["CalibrateKVResult", "default_calibration", "run_calibrate_kv"]
