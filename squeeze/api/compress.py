"""The compress verbs: compress, plan_compress, calibrate_kv, and what they accept (built-in recipes and specs).

The pipelines (models, calibration, quantization) are imported inside the verbs, so ``import squeeze`` stays light.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from squeeze.config import (
    CALIBRATION_DIR,
    RECIPES_DIR,
    CalibrationSpec,
    Recipe,
    builtin_names,
    load_calibration_spec,
    load_recipe,
    parse_size,
)
from squeeze.limits import KvChoice, check_kv_calibration, check_seed

if TYPE_CHECKING:
    from squeeze.compression.calibrate_kv import CalibrateKVResult
    from squeeze.compression.plan import CompressPlan
    from squeeze.compression.runner import CompressResult


def compress(
    model: str,
    output: str | os.PathLike[str],
    recipe: str | os.PathLike[str] | Recipe = "w4",
    calibration: str | os.PathLike[str] | CalibrationSpec | None = None,
    *,
    seed: int | None = None,
    overwrite: bool = False,
    resume: bool = False,
    restart: bool = False,
    force: bool = False,
    overrides: Mapping[str, Any] | None = None,
    calibration_overrides: Mapping[str, Any] | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    max_memory: int | str | None = None,
    device: str | None = None,
) -> CompressResult:
    """Compress a causal LM with SqueezeLLM (or RTN) into a sealed artifact directory.

    ``model``: a local HF directory, a hub id in the local HF cache, a ``.gguf`` file, or ``smollm2-135m``.
    ``recipe``: a built-in name (``w4``, ``w3-s045``, ``rtn-w4``, ...), a YAML path or a Recipe;
    ``overrides`` are dotted recipe keys (``{"weights.bits": 3}``); ``weights.target_bpw`` (e.g. 3.5, built-in
    ``b3.5``) plans each linear's width for that average instead (ConfigError, naming the range, when the
    model's settings cannot meet it; with ``weights.bits`` in the same place it contradicts: ConfigError).
    ``weights.embedding_bits`` (4 or 8; built-ins ``w4-e4``, ``w3-s045-e4``, ``w4-lut8-e8``) quantizes the token
    embedding and an untied LM head too (a tied pair once; ModelError for a model without a token embedding);
    ``output.keep_dtype`` (``source``, ``float32``, ``bfloat16``, ``float16``) is the dtype of every tensor left
    unquantized, by default the source checkpoint's (float16 for GGUF). The result's ``source_bytes`` is the
    model's tensors in the source dtype, what ``artifact_bytes`` compares with.
    ``calibration``: a built-in spec name, a spec YAML, a plain text file or a CalibrationSpec (needed for Fisher
    sensitivity); ``seed`` overrides the calibration sampling seed and seeds k-means: the same inputs and seed
    give byte-identical shards. ``output`` must not exist or be empty unless ``overwrite``; the old artifact is
    replaced only once the new one is complete. ``progress(stage, done, total)`` reports every stage's start as
    (name, 0, 0), then the counted work of the "fisher", "generate" (``weights.generated_samples``), "plan" (budget
    recipes), "quantize" (per layer group) and "tune" stages with ``total > 0``.

    Interruptions: the Fisher information and each quantized layer group are checkpointed in
    ``output/.squeeze-work``; calling again with the same arguments resumes after the last committed group
    and gives the same bytes as an uninterrupted run. ``resume`` insists on an existing work area
    (ResumeError if there is none); a work area made with other inputs is refused (ResumeError listing the
    differences) unless ``restart``, which discards it. SIGINT/SIGTERM raise Interrupted (exit code 130/143)
    after the last commit. A concurrent run into the same output raises LockError. Estimated peak memory
    and disk are checked first (ResourceError); ``force`` skips those two refusals.

    ``max_memory`` (bytes, or a size like ``"1GB"``): keep the run's peak resident memory under this budget by
    streaming the model block by block from the source safetensors; the shards are byte-identical to an
    unbounded run. A budget that cannot hold one block and its activations is refused in preflight
    (ResourceError naming the minimum).

    ``device`` (``"cuda"``, ``"cuda:N"``, ``"cpu"``): the model stays on the host (or is read lazily, with
    ``max_memory``) and each decoder block is moved there for its Fisher forward and backward and its k-means,
    then comes back quantized. Checked before any work (ConfigError: no CUDA, an index past the last GPU, an
    error-compensation recipe, torchrun). ``"cpu"`` gives the bytes of a run without ``device``; on a GPU the
    Fisher and the k-means agree with the CPU run within float tolerance (GPU reductions), while everything
    computed on the host (unquantized tensors, calibration windows, rotary tables) is the same bits.
    """
    from squeeze.compression.job import needs_calibration
    from squeeze.compression.runner import RunOptions, run_compress

    if seed is not None:  # one rule for every seed (squeeze.limits.check_seed), before anything is read
        check_seed(seed, "seed (--seed)")
    resolved = recipe if isinstance(recipe, Recipe) else load_recipe(os.fspath(recipe), **dict(overrides or {}))
    spec = None
    if needs_calibration(resolved) and calibration is not None:
        extra = {**dict(calibration_overrides or {}), **({"seed": seed} if seed is not None else {})}
        spec = (
            calibration
            if isinstance(calibration, CalibrationSpec)
            else load_calibration_spec(os.fspath(calibration), **extra)
        )
    effective_seed = seed if seed is not None else (spec.seed if spec is not None else 0)
    options = RunOptions(
        seed=effective_seed,
        overwrite=overwrite,
        resume=resume,
        restart=restart,
        force=force,
        progress=progress,
        max_memory=None if max_memory is None else parse_size(max_memory),
        device=device,
    )
    return run_compress(model, output, resolved, spec, options)


def plan_compress(
    model: str,
    recipe: str | os.PathLike[str] | Recipe = "w4",
    calibration: str | os.PathLike[str] | CalibrationSpec | None = None,
    *,
    overrides: Mapping[str, Any] | None = None,
    calibration_overrides: Mapping[str, Any] | None = None,
    max_memory: int | str | None = None,
    device: str | None = None,
    ranks: int | None = None,
) -> CompressPlan:
    """What :func:`compress` with these arguments will need, from the model's config.json alone (no weights are
    read; a directory holding only config.json will do): per rank, peak host memory (and GPU memory with
    ``device="cuda"``), the work area's disk, and seconds per stage from the per-unit rates measured on the
    machine plan_rates.json names (None where no rate was measured, e.g. on a GPU). ``ranks``: torchrun
    processes (default: this world's size). Calibration windows: the spec's (``calibration`` and its overrides),
    else ``num_samples`` / ``seq_len`` from ``calibration_overrides``, else 32 x 512. Raises what the run would
    raise for a model it cannot compress (ModelError / ConfigError naming what is missing)."""
    from squeeze.compression.job import needs_calibration
    from squeeze.compression.plan import plan_compress as plan

    resolved = recipe if isinstance(recipe, Recipe) else load_recipe(os.fspath(recipe), **dict(overrides or {}))
    given = {key: value for key, value in dict(calibration_overrides or {}).items() if value is not None}
    num_samples: int | None = None
    seq_len: int | None = None
    if needs_calibration(resolved):
        if isinstance(calibration, CalibrationSpec):
            spec = calibration
        elif calibration is not None:
            spec = load_calibration_spec(os.fspath(calibration), **given)
        else:
            spec = CalibrationSpec(name="plan", source="text", path="plan.txt", **given)
        num_samples, seq_len = spec.num_samples, spec.seq_len
    return plan(
        model,
        resolved,
        num_samples=num_samples,
        seq_len=seq_len,
        max_memory=None if max_memory is None else parse_size(max_memory),
        device=device,
        ranks=ranks if ranks is not None else compress_world()[1],
    )


def compress_world() -> tuple[int, int]:
    """``(rank, world size)`` of this process in a data-parallel compress started by torchrun (RANK and
    WORLD_SIZE in the environment), ``(0, 1)`` without torchrun. ConfigError when those are malformed."""
    from squeeze.compression.distributed import world_from_env

    world = world_from_env()
    return world.rank, world.size


def calibrate_kv(
    target: str | os.PathLike[str],
    calibration: str | os.PathLike[str] | CalibrationSpec | None = None,
    *,
    bits: KvChoice = 8,
    output: str | os.PathLike[str] | None = None,
    sink_tokens: int | None = None,
    key_group: int | None = None,
    value_group: int | None = None,
    overwrite: bool = False,
    calibration_overrides: Mapping[str, Any] | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    drop_signature: bool = False,
) -> CalibrateKVResult:
    """Calibrate int8 / int4 KV-cache scales, or vLLM's fp8 KV scales, and write them into an artifact.

    ``target``: an artifact (verified first; updated in place, or copied to ``output``) or any model
    :func:`compress` accepts (then ``output`` is required: an artifact with the original weights and the
    calibrated KV is written). ``calibration``: a built-in spec name, a spec YAML or a plain text file;
    default: the spec the artifact was compressed with, when it is a built-in one. ``bits``: 8, 4 or "fp8".

    8 / 4: the first ``sink_tokens`` tokens (default DEFAULT_SINK_TOKENS) are left out of calibration and
    kept in full precision at run time. ``key_group`` / ``value_group``: channels per key / value grid
    (default: 32 for int4 keys, else the whole head; e.g. 32 for two grids per head). At int4 values are
    indices into a calibrated codebook of 16 levels per layer, at int8 uniform grids with a calibrated
    clipping ratio.

    "fp8": vLLM's ``kv_cache_dtype="fp8"``: per attention layer one float32 ``{attn}.k_scale`` and
    ``{attn}.v_scale`` (max |post-RoPE key| / 448 and max |value| / 448 over every calibration token) in
    kv_cache.safetensors, and ``quantization_config.kv_cache = {"format": "fp8_e4m3", "version": 1, ...}``;
    squeeze's own runtime then stores its KV cache in fp8 with those scales. No sink and no grid options
    (ConfigError if given).

    The artifact is replaced only once the new one is complete and sealed: a failure leaves it exactly as it
    was. One run per output at a time (LockError for a second). A signed artifact (``model.sig``) is refused
    before any work unless ``drop_signature``: the new artifact is then written unsigned (sign it again).
    """
    from squeeze.compression.calibrate_kv import KVRunOptions, default_calibration, run_calibrate_kv

    spec_arg = calibration if calibration is not None else default_calibration(target)
    overrides = {k: v for k, v in dict(calibration_overrides or {}).items() if v is not None}
    spec = (
        spec_arg if isinstance(spec_arg, CalibrationSpec) else load_calibration_spec(os.fspath(spec_arg), **overrides)
    )
    options = KVRunOptions(
        bits,
        output=output,
        sink_tokens=sink_tokens,
        key_group=key_group,
        value_group=value_group,
        overwrite=overwrite,
        drop_signature=drop_signature,
        progress=progress,
    )
    return run_calibrate_kv(target, spec, options)


def check_calibrate_kv_options(
    bits: KvChoice | str,
    sink_tokens: int | None = None,
    *,
    key_group: int | None = None,
    value_group: int | None = None,
) -> KvChoice:
    """``bits`` as :func:`calibrate_kv` takes it (8, 4 or "fp8"; "8" / "4" as typed become the widths).

    ConfigError (named as the CLI's flags) when ``bits`` is not one of those, ``sink_tokens`` is negative, or
    fp8 comes with a grid size or sink tokens (int grid options); checked before the artifact or the
    calibration text is read.
    """
    return check_kv_calibration(bits, sink_tokens, key_group, value_group)[0]


def builtin_recipes() -> list[str]:
    """Names of the built-in recipes (``w4``, ``w3-s045``, ``rtn-w4``, ...), sorted: what :func:`compress`
    accepts as ``recipe`` besides a YAML path."""
    return builtin_names(RECIPES_DIR)


def builtin_calibration_specs() -> list[str]:
    """Names of the built-in calibration specs, sorted: what ``calibration`` accepts besides a file path."""
    return builtin_names(CALIBRATION_DIR)


__all__ = [
    "compress",
    "plan_compress",
    "compress_world",
    "calibrate_kv",
    "check_calibrate_kv_options",
    "builtin_recipes",
    "builtin_calibration_specs",
]
