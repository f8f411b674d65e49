"""``squeeze calibrate-kv``: fit KV-cache scales and add them to an artifact (or make one from a plain model).

An artifact gains ``kv_cache.safetensors`` ({attn}.k_scale / .k_zero / .v_clip or .v_levels for the int grids;
{attn}.k_scale / .v_scale, float32 scalars, for vLLM's fp8 cache) and a ``kv_cache`` entry in config.json's
quantization_config (squeeze.quant.kv_spec.KVSpec.to_config); its model shards are untouched (hard links).
The new artifact is built and sealed in a hidden staging directory next to the target and swapped in only
when complete, by an atomic exchange of the two directories (squeeze.format.swap), so the path holds a
complete artifact at every instant and a failed or killed run leaves the artifact exactly as it was.
Staging directories a killed run left behind are removed by the next run on that target (publish.py). The
scales live in their own file, not in the model shards and index, because transformers' loader would take
them for unexpected weights.
Files are written by the artifact writer compress uses too (writer.py).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from squeeze.calibrate.kv_capture import KVCalibration, calibrate_kv
from squeeze.calibrate.windows import calibration_windows
from squeeze.compression.job import StageProgress, timed  # progress stage "kv": calibration windows
from squeeze.compression.lock import OutputLock
from squeeze.compression.output import check_not_model_path, check_output_dir, check_writable, output_path
from squeeze.compression.preflight import check_context_length
from squeeze.compression.publish import clean_kv_leftovers, kv_staging, replace_dir
from squeeze.compression.writer import (
    CONFIG_NAME,
    seal,
    unique_tensors,
    with_quantization,
    write_config,
    write_model_files,
    write_tensor_file,
    write_tensors,
)
from squeeze.config import CalibrationSpec, OutputConfig
from squeeze.errors import ConfigError, IntegrityError, SqueezeError
from squeeze.format.manifest import MANIFEST_NAME, SIGNATURE_NAME, Manifest, Provenance
from squeeze.format.quant_config import QuantizationConfig
from squeeze.format.signature import warn_signature_dropped
from squeeze.format.swap import restore_aside
from squeeze.format.verify import read_manifest
from squeeze.limits import KvChoice, check_kv_calibration
from squeeze.quant.kv_bytes import kv_bytes_table
from squeeze.quant.kv_file import KV_FILE
from squeeze.version import __version__

#: The lock file beside the output (``.NAME.squeeze-kv.lock``) that a run holds from start to end.
KV_LOCK_SUFFIX = ".squeeze-kv.lock"


@dataclass
class CalibrateKVResult:
    """What calibrate-kv wrote and measured."""

    output: str
    bits: KvChoice  # 8, 4 or "fp8"
    sink_tokens: int
    calibration: dict[str, Any]
    bytes_per_token: dict[str, int]
    seconds: float
    timings: dict[str, float] = field(default_factory=dict)
    root_digest: str = ""

    @property
    def label(self) -> str:
        """``int8``, ``int4`` or ``fp8``."""
        return self.bits if isinstance(self.bits, str) else f"int{self.bits}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "output": self.output,
            "bits": self.bits,
            "sink_tokens": self.sink_tokens,
            "calibration": self.calibration,
            "kv_bytes_per_token": self.bytes_per_token,
            "seconds": round(self.seconds, 3),
            "timings": {k: round(v, 3) for k, v in self.timings.items()},
            "root_digest": self.root_digest,
        }


def default_calibration(target: str | os.PathLike[str]) -> str:
    """The built-in calibration spec ``target`` (an artifact) was compressed with; ConfigError when none."""
    from squeeze.config import CALIBRATION_DIR, builtin_names
    from squeeze.runtime.loader import is_artifact

    name = None
    if not os.path.lexists(target):
        raise ConfigError(
            f"no such artifact or model directory: {target}",
            hint="pass the path of a squeeze artifact (or of a model, with --output and --calibration)",
        )
    if is_artifact(Path(target)):
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


@dataclass(frozen=True)
class KVRunOptions:
    """What a calibrate-kv run writes, beside its target and calibration text (squeeze.api.calibrate_kv's keywords;
    see there): the width, the sink and grid options, the output (None: in place), and what it may replace.
    ``bits`` and ``sink_tokens`` are checked (and the sink defaulted) by :func:`run_calibrate_kv`."""

    bits: KvChoice
    output: str | os.PathLike[str] | None = None
    sink_tokens: int | None = None
    key_group: int | None = None
    value_group: int | None = None
    overwrite: bool = False
    drop_signature: bool = False
    progress: StageProgress | None = None


def run_calibrate_kv(
    target: str | os.PathLike[str], calibration: CalibrationSpec, options: KVRunOptions
) -> CalibrateKVResult:
    """Calibrate KV scales for ``target`` (artifact or model) and write them; see squeeze.api.calibrate_kv."""
    bits, sink_tokens = _check_options(
        options.bits, options.sink_tokens, options.key_group, options.value_group, calibration
    )
    checked = replace(options, bits=bits, sink_tokens=sink_tokens)
    output = options.output
    source = Path(os.path.realpath(os.fspath(target)))  # `current -> v3`: the artifact (and swap) is at v3
    out = output_path(output if output is not None else source)
    # one run per output at a time: a second one would swap its artifact over the first's, losing it
    lock = OutputLock(
        out.parent, name=f".{out.name}{KV_LOCK_SUFFIX}", holder="squeeze calibrate-kv", target=out, remove=True
    )
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        lock.acquire()
    except OSError as exc:
        raise ConfigError(
            f"cannot create the lock file {lock.path}: {exc.strerror or exc}",
            hint="the directory that holds the output must be writable",
        ) from None
    try:
        return _run_locked(target, calibration, checked, source, out)
    finally:
        lock.release()


def _run_locked(
    target: str | os.PathLike[str], calibration: CalibrationSpec, options: KVRunOptions, source: Path, out: Path
) -> CalibrateKVResult:
    """The run under the output's lock; ``options`` checked (``sink_tokens`` set)."""
    started = time.perf_counter()
    bits, sink_tokens, overwrite, progress = options.bits, options.sink_tokens, options.overwrite, options.progress
    key_group, value_group, in_place = options.key_group, options.value_group, options.output is None
    assert sink_tokens is not None  # set by run_calibrate_kv's check
    timings: dict[str, float] = {}
    restore_aside(out)  # a fallback swap cut short by a kill: the old artifact goes back before anything
    inputs = _Inputs(target, source)
    _check_output(inputs, out, overwrite=overwrite, in_place=in_place)
    drop = _check_signature(out, options.drop_signature)  # in place, or --output over a signed artifact

    with timed(timings, "load"):
        _load(inputs)  # an artifact is verified first: IntegrityError before any work
    model = inputs.loaded_model()
    check_context_length(model, calibration.seq_len)

    with timed(timings, "calibrate"):
        windows = calibration_windows(calibration, inputs.tokenizer)  # (n, T)
        report = (lambda done, total: progress("kv", done, total)) if progress else None
        result = calibrate_kv(
            model, windows, bits, sink_tokens=sink_tokens, key_group=key_group, value_group=value_group, progress=report
        )

    with timed(timings, "write"):
        config, manifest = _write_artifact(
            inputs, result, calibration, out, overwrite=overwrite or out == source, drop=drop
        )
    return CalibrateKVResult(
        output=str(out),
        bits=bits,
        sink_tokens=sink_tokens,
        calibration=result.to_dict(),
        bytes_per_token=kv_bytes_table(config, result.spec.to_config()),
        seconds=time.perf_counter() - started,
        timings=timings,
        root_digest=manifest.root_digest,
    )


def _check_options(
    bits: KvChoice,
    sink_tokens: int | None,
    key_group: int | None,
    value_group: int | None,
    calibration: CalibrationSpec,
) -> tuple[KvChoice, int]:
    """(bits, sink tokens), checked (squeeze.limits.check_kv_calibration), after refusing sink tokens that leave
    nothing of a window to calibrate on."""
    bits, sink_tokens = check_kv_calibration(bits, sink_tokens, key_group, value_group)
    if calibration.seq_len <= sink_tokens:
        raise ConfigError(
            f"calibration windows of {calibration.seq_len} tokens are not longer than the {sink_tokens} sink token(s)",
            hint="use a longer --seq-len or fewer --sink-tokens",
        )
    return bits, sink_tokens


@dataclass
class _Inputs:
    """What calibrate-kv reads: ``target`` as given, its real path, and what loading it gives."""

    target: str | os.PathLike[str]
    path: Path  # symlinks resolved
    artifact: bool = False
    model: torch.nn.Module | None = None  # fp32, or an artifact's dense cache
    tokenizer: Any = None
    config: dict[str, Any] | None = None  # an artifact's config.json, as verified
    manifest: Manifest | None = None  # an artifact's manifest

    def __post_init__(self) -> None:
        from squeeze.runtime.loader import is_artifact

        self.artifact = is_artifact(self.path)

    def loaded_model(self) -> torch.nn.Module:
        if self.model is None:
            raise ValueError("the input has not been loaded")
        return self.model


def _load(inputs: _Inputs) -> None:
    """Load the model: an artifact verified against its manifest, or a plain model in fp32."""
    from squeeze.models.source import load_model, resolve_model
    from squeeze.runtime.loader import LoadOptions, load_artifact

    if inputs.artifact:
        inputs.manifest = read_manifest(inputs.path)
        loaded = load_artifact(inputs.path, LoadOptions(dense_cache=True))  # verified: IntegrityError before any work
        inputs.model, inputs.tokenizer = loaded.model, loaded.tokenizer
        inputs.config = _verified_config(loaded)
    else:
        inputs.model, inputs.tokenizer = load_model(resolve_model(str(inputs.target)), dtype=torch.float32)


def _write_artifact(
    inputs: _Inputs,
    result: KVCalibration,
    calibration: CalibrationSpec,
    out: Path,
    *,
    overwrite: bool,
    drop: frozenset[str] = frozenset(),
) -> tuple[dict[str, Any], Manifest]:
    """Build and seal the new artifact next to ``out``, then swap it in; returns its config and manifest."""
    with kv_staging(out) as staging:
        if inputs.manifest is not None and inputs.config is not None:
            linked, config = _link_artifact(inputs.path, staging, inputs.manifest), inputs.config
        else:
            linked, config = {}, _write_plain_artifact(inputs.loaded_model(), inputs.tokenizer, staging)
        config = _write_kv(staging, config, result, calibration)
        old = inputs.manifest.provenance if inputs.manifest else None
        manifest = seal(staging, _provenance(old, inputs.target, result, calibration))
        _check_linked(manifest, linked)
        replace_dir(staging, out, overwrite=overwrite, drop=drop)
    return config, manifest


def _check_signature(out: Path, drop_signature: bool) -> frozenset[str]:
    """The files of the artifact at ``out`` the user agreed to lose: its model.sig with ``drop_signature``
    (a warning says so); ConfigError, before any work, for a signed one without it: the new artifact's bytes
    differ, so the old signature cannot stay, and a signature is not dropped unasked."""
    if not os.path.lexists(out / SIGNATURE_NAME):
        return frozenset()
    if not drop_signature:
        raise ConfigError(
            f"{out} is signed ({SIGNATURE_NAME}), and the artifact calibrate-kv writes there would not match "
            "that signature",
            hint=f"pass --drop-signature to write it unsigned, then sign it again: squeeze sign {out} "
            "--private-key KEY.pem",
        )
    warn_signature_dropped(out, "calibrate-kv replaces it")
    return frozenset({SIGNATURE_NAME})


def _check_output(inputs: _Inputs, out: Path, *, overwrite: bool, in_place: bool) -> None:
    """Check where the new artifact goes (``out``) before any work; cleans what a killed run left next to it."""
    from squeeze.models.source import resolve_model

    if in_place and not inputs.artifact:
        raise ConfigError(
            f"{inputs.target} is a model, not a squeeze artifact, and no --output was given",
            hint="pass --output DIR: an artifact with the original weights and calibrated KV is written there",
        )
    if out != inputs.path or not inputs.artifact:
        # a new place: the usual output rules (refuse foreign files; never over, in or around the input)
        model_path = inputs.path if inputs.artifact else resolve_model(str(inputs.target)).path
        check_not_model_path(out, [model_path], what="the model or artifact being calibrated")
        check_output_dir(out, overwrite)
    check_writable(out.parent)  # the staging directory and the swap live next to the output
    clean_kv_leftovers(out)


def _verified_config(loaded: Any) -> dict[str, Any]:
    """config.json as the loader verified it (never re-read from disk)."""
    captured = loaded.report.captured["config.json"].data
    return json.loads(bytes(captured.numpy()))


def _link_artifact(source: Path, staging: Path, manifest: Manifest) -> dict[str, str]:
    """Hard-link (or copy) every file of ``source`` but those calibrate-kv rewrites: {path: expected sha256}."""
    rewritten = {MANIFEST_NAME, CONFIG_NAME, KV_FILE}
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
            raise IntegrityError(
                f"{entry.path} changed on disk while calibrate-kv ran; nothing was written",
                hint="run `squeeze verify` on the artifact, then calibrate again",
            )


def _write_plain_artifact(model: torch.nn.Module, tokenizer: Any, staging: Path) -> dict[str, Any]:
    """The original weights as shards, tokenizer, generation config; returns config.json's dict (unwritten)."""
    write_tensors(staging, unique_tensors(model.state_dict()), OutputConfig().max_shard_bytes)
    write_model_files(staging, model, tokenizer)
    # the weights are not quantized: only the KV cache will be
    plain = model.config.to_dict()  # type: ignore[union-attr, operator]
    return with_quantization(plain, QuantizationConfig.unquantized(__version__))


def _write_kv(
    staging: Path, config: dict[str, Any], result: KVCalibration, calibration: CalibrationSpec
) -> dict[str, Any]:
    """kv_cache.safetensors plus config.json with its ``quantization_config.kv_cache`` entry (returned)."""
    write_tensor_file(staging, KV_FILE, result.spec.to_tensors())
    quant = QuantizationConfig.from_model_config(config) or QuantizationConfig.unquantized(__version__)
    entry = {
        **result.spec.to_config(),
        "file": KV_FILE,
        "calibration": calibration.name,
        "calibration_hash": calibration.spec_hash(),
    }
    config = with_quantization(config, quant.with_kv_cache(entry))
    write_config(staging, config)
    return config


def _provenance(
    old: Provenance | None, target: str | os.PathLike[str], result: KVCalibration, calibration: CalibrationSpec
) -> Provenance:
    kv = {"bits": result.spec.choice, "calibration": calibration.name, "calibration_hash": calibration.spec_hash()}
    if old is None:
        from squeeze.models.source import resolve_model, source_digest

        source = resolve_model(str(target))
        return Provenance(source_model=source.model_id, source_digest=source_digest(source), extra={"kv_cache": kv})
    return Provenance(
        old.source_model, old.source_digest, old.recipe_hash, old.calibration_hash, {**old.extra, "kv_cache": kv}
    )


__all__ = ["CalibrateKVResult", "KVRunOptions", "default_calibration", "run_calibrate_kv"]
