"""The public face of squeeze: every verb of the CLI is one function here.

Heavier stages (models, calibration, quantization, runtime) are imported inside the functions that need
them, so ``import squeeze`` stays light and verify works without loading transformers.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from squeeze.config import (
    CALIBRATION_DIR,
    DEFAULT_SINK_TOKENS,
    RECIPES_DIR,
    CalibrationSpec,
    Recipe,
    builtin_names,
    load_calibration_spec,
    load_recipe,
    parse_size,
)
from squeeze.errors import ConfigError, ResourceError
from squeeze.format.inspect import ArtifactInfo, inspect_artifact
from squeeze.format.paths import short_path
from squeeze.format.verify import VerifyReport, verify_artifact
from squeeze.limits import MIN_SEQ_LEN, KvChoice, check_kv_calibration, check_seed
from squeeze.quant.kv_spec import KV_FP8_E4M3
from squeeze.runtime.activations import ACTIVATIONS, DEFAULT_ACTIVATIONS, Activations, check_activations
from squeeze.runtime.options import KVOptions, LoadOptions, load_and_kv, split_keywords
from squeeze.runtime.sampling_params import SamplingParams
from squeeze.serve.connection_limits import DEFAULT_IDLE_TIMEOUT as SERVE_IDLE_TIMEOUT
from squeeze.serve.open_files import check_max_connections as check_serve_max_connections
from squeeze.serve.types import EngineConfig

if TYPE_CHECKING:  # `X as X`: re-exported for type checkers (the CLI annotates with them); not loaded at run time
    from fastapi import FastAPI

    from squeeze.compression.calibrate_kv import CalibrateKVResult
    from squeeze.compression.plan import CompressPlan as CompressPlan
    from squeeze.compression.runner import CompressResult as CompressResult
    from squeeze.distribution.pull import PullResult
    from squeeze.distribution.push import PushResult
    from squeeze.eval.compare import EvalResult
    from squeeze.eval.harness import HarnessResult
    from squeeze.format.signature import SignatureInfo as SignatureInfo
    from squeeze.format.signature import SignResult as SignResult
    from squeeze.runtime.generate import GenerationResult as GenerationResult
    from squeeze.runtime.loader import LoadedModel
    from squeeze.serve.engine import Engine
    from squeeze.serve.types import EngineClient

ProgressFn = Callable[[int, int], None]


def verify_model_integrity(
    path: str | os.PathLike[str],
    *,
    workers: int | None = None,
    progress: ProgressFn | None = None,
    public_key: str | os.PathLike[str] | None = None,
) -> VerifyReport:
    """Check every file of an artifact against its manifest (size and SHA-256, streamed, in parallel).

    ``path`` is the artifact directory or its ``squeeze.manifest.json``. Returns a VerifyReport whose
    ``ok`` is True only if the artifact is intact. Raises FormatError when the manifest is missing or
    malformed (nothing can be checked). ``progress(done_bytes, total_bytes)`` is called from worker threads.
    ``public_key`` (PEM, EC): also check the artifact's ``model.sig`` against the digests just verified (no
    second read); the report is then a SignedVerifyReport (``signature``, and a "signature" section in
    ``to_dict``), and a missing, foreign or stale signature is one of its problems. ConfigError for a key
    that cannot check signatures (or without the ``sign`` extra), before anything is hashed.
    """
    if public_key is not None:
        from squeeze.format.signature import verify_with_signature

        return verify_with_signature(path, public_key, workers=workers, progress=progress)
    return verify_artifact(path, workers=workers, progress=progress)


def check_signing_options(public_key: str | os.PathLike[str], *, verify: bool = True) -> None:
    """The checks a ``public_key`` gets before anything loads (what ``--public-key`` is checked with): ConfigError
    without verification (``verify=False``), for a key file that is unreadable, not PEM, or not an EC key on
    P-256/384/521, and without the ``sign`` extra. Reads no artifact."""
    from squeeze.runtime.loader import check_signing_options as check

    check(public_key, verify=verify)


def sign(
    path: str | os.PathLike[str],
    private_key: str | os.PathLike[str],
    *,
    password: str | None = None,
    signing_certificate: str | os.PathLike[str] | None = None,
    certificate_chain: Sequence[str | os.PathLike[str]] = (),
    workers: int | None = None,
    progress: ProgressFn | None = None,
) -> SignResult:
    """Sign an artifact: verify it, then write ``model.sig`` (an OpenSSF model signing bundle) into it.

    The signature lists every file with its SHA-256, the manifest (and so the provenance) included, as
    ``model_signing sign key`` would: ``model_signing verify key`` accepts it, and :func:`verify_model_integrity`
    / :func:`load` with ``public_key`` check it. The digests are the ones verification computed (one pass
    over the bytes). ``private_key``: PEM EC key (P-256/384/521), decrypted with ``password`` if given;
    ``signing_certificate`` (+ ``certificate_chain``) embeds an X.509 chain (model_signing's certificate
    signer). Raises IntegrityError when the artifact does not verify (nothing is signed), ConfigError for
    an unusable key or certificate or without the ``sign`` extra (``pip install 'squeeze[sign]'``).
    """
    from squeeze.format.signature import sign_artifact

    return sign_artifact(
        path,
        private_key,
        password=password,
        signing_certificate=signing_certificate,
        certificate_chain=certificate_chain,
        workers=workers,
        progress=progress,
    )


def inspect(path: str | os.PathLike[str]) -> ArtifactInfo:
    """Summarise an artifact (files, tensors by role, bits per weight, KV bytes per token, manifest status).

    Reads headers and config.json only (config.json once, through the hardened size-capped read).
    """
    from squeeze.quant.kv_bytes import kv_bytes_table

    info = inspect_artifact(path)
    try:
        kv = info.quantization.kv_cache if info.quantization is not None else None
        info.kv_bytes_per_token = kv_bytes_table(info.config, kv) if info.config is not None else None
    except (ValueError, TypeError, AttributeError, ArithmeticError, KeyError):  # no decoder config: nothing to size
        info.kv_bytes_per_token = None
    return info


def builtin_recipes() -> list[str]:
    """Names of the built-in recipes (``w4``, ``w3-s045``, ``rtn-w4``, ...), sorted: what :func:`compress`
    accepts as ``recipe`` besides a YAML path."""
    return builtin_names(RECIPES_DIR)


def builtin_calibration_specs() -> list[str]:
    """Names of the built-in calibration specs, sorted: what ``calibration`` accepts besides a file path."""
    return builtin_names(CALIBRATION_DIR)


def check_generate_options(
    prompts: str | Sequence[str],
    *,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    device: str = "cpu",
    kv_bits: int | None = None,
    kv_dynamic: bool = False,
) -> list[str]:
    """The checks :func:`generate` makes before anything loads; returns the prompts as a list (building the
    options objects is what checks them: prefer building them once and passing them to :func:`generate`).

    ConfigError, in this order, for: no prompt or an empty one, ``max_new_tokens`` < 1, a negative or
    non-finite ``temperature``, ``top_p`` outside (0, 1]; an unknown or unavailable ``device``; ``kv_bits``
    other than 4, 8, 16 or None, or ``kv_dynamic`` without 4 / 8 bits. Cheap: reads no file.
    """
    prompt_list = check_prompts(prompts)
    SamplingParams.for_generate(max_new_tokens, temperature, top_p)
    LoadOptions(device=device)
    KVOptions(kv_bits, kv_dynamic)
    return prompt_list


def check_prompts(prompts: str | Sequence[str]) -> list[str]:
    """The prompts as a list; ConfigError for no prompt or an empty one (cheap: checked before loading)."""
    from squeeze.runtime.checks import check_prompts as check

    return check(prompts)


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
    from squeeze.compression.runner import run_compress

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
    return run_compress(
        model,
        output,
        resolved,
        spec,
        seed=effective_seed,
        overwrite=overwrite,
        resume=resume,
        restart=restart,
        force=force,
        progress=progress,
        max_memory=None if max_memory is None else parse_size(max_memory),
        device=device,
    )


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
    from squeeze.compression.calibrate_kv import default_calibration, run_calibrate_kv

    spec_arg = calibration if calibration is not None else default_calibration(target)
    overrides = {k: v for k, v in dict(calibration_overrides or {}).items() if v is not None}
    spec = (
        spec_arg if isinstance(spec_arg, CalibrationSpec) else load_calibration_spec(os.fspath(spec_arg), **overrides)
    )
    return run_calibrate_kv(
        target,
        spec,
        bits,
        output=output,
        sink_tokens=sink_tokens,
        key_group=key_group,
        value_group=value_group,
        overwrite=overwrite,
        drop_signature=drop_signature,
        progress=progress,
    )


def evaluate(
    model: str | os.PathLike[str],
    text: str | os.PathLike[str],
    *,
    baseline: str | os.PathLike[str] | None = None,
    seq_len: int = 512,
    max_windows: int | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    load: LoadOptions | None = None,
    kv: KVOptions | None = None,
    **options: Any,
) -> EvalResult:
    """Perplexity of a model or artifact on a text file (paper protocol), with an optional baseline.

    Joins the text, tokenizes it once, cuts non-overlapping windows of ``seq_len`` tokens (the first
    ``max_windows``), and reports exp(mean NLL) plus lm-eval-style word perplexity. Artifacts are verified
    and loaded as :func:`load` does by default (weights compressed, native CPU kernels). The model (not
    the baseline) runs through the quantized KV cache the artifact was calibrated for; ``kv_bits`` 8 / 4
    picks it explicitly (ConfigError when not calibrated, unless ``kv_dynamic`` asks for uncalibrated
    per-token scales), 16 turns it off. ``public_key``: ``model`` must be an artifact signed by that key
    (see :func:`load`; ConfigError for a model that is not an artifact); the baseline is not checked.
    ``load`` / ``kv``: the options objects (LoadOptions: ``public_key``, ``activations``; KVOptions), or their
    keywords (``public_key=``, ``activations=``, ``kv_bits=``, ``kv_dynamic=``).
    """
    from squeeze.eval.compare import evaluate as _evaluate

    load, kv = load_and_kv(options, load, kv)
    return _evaluate(
        model,
        text,
        baseline=baseline,
        seq_len=seq_len,
        max_windows=max_windows,
        progress=progress,
        load=load,
        kv=kv,
    )


def register() -> None:
    """Register squeeze now with the libraries that load its artifacts by name: transformers (the "squeeze"
    quantization method, so ``AutoModelForCausalLM.from_pretrained(ARTIFACT)`` loads it; ``import squeeze``
    already arranges this lazily) and, when it is installed, lm-evaluation-harness (``--model squeeze``)."""
    import importlib.util

    from squeeze.runtime.hf import register as register_transformers

    register_transformers()
    if importlib.util.find_spec("lm_eval") is not None:
        from squeeze.eval.harness import register as register_harness

        register_harness()


def evaluate_tasks(
    model: str | os.PathLike[str],
    tasks: Sequence[str],
    *,
    include_path: str | os.PathLike[str] | None = None,
    limit: int | None = None,
    num_fewshot: int | None = None,
    batch_size: int = 1,
    load: LoadOptions | None = None,
    kv: KVOptions | None = None,
    **options: Any,
) -> HarnessResult:
    """lm-evaluation-harness's own evaluator on ``tasks`` (lm-eval task names), scoring ``model`` as
    :func:`evaluate` loads it (an artifact verified, compressed kernels, its calibrated KV cache unless
    ``kv_bits`` says otherwise). ``include_path``: a directory of task YAMLs (local tasks, which need no
    download). ``limit``: the first N documents of each task; ``num_fewshot``: examples in each prompt.
    Needs lm-eval (``pip install 'squeeze[eval]'``; ConfigError without it, for an unknown task, or for a
    task whose data cannot be downloaded). ``load`` / ``kv`` (or their keywords): as for :func:`evaluate`."""
    from squeeze.eval.harness import check_task_options, import_lm_eval, load_harness_model, run_tasks

    load, kv = load_and_kv(options, load, kv)
    if not tasks:
        raise ConfigError("no task named", hint="pass --tasks NAME[,NAME...]")
    check_task_options(include_path=include_path, limit=limit, num_fewshot=num_fewshot)  # before the model loads
    import_lm_eval()
    core = load_harness_model(model, batch_size=batch_size, load=load, kv=kv)
    return run_tasks(core, tasks, include_path=include_path, limit=limit, num_fewshot=num_fewshot)


def load(path: str | os.PathLike[str], options: LoadOptions | None = None, **keywords: Any) -> LoadedModel:
    """Verify an artifact against its manifest and load it on the CPU, weights kept compressed.

    ``options``: a :class:`LoadOptions` (checked when it was built), or its keywords: ``verify``,
    ``dense_cache``, ``low_memory``, ``check_memory``, ``public_key``, ``activations`` (ConfigError for a bad
    one, before anything is read; TypeError for an unknown keyword).
    Linears of a LUT format run the native CPU kernels on their packed codes (built on first use, once per
    machine). ``dense_cache=True`` caches every weight dequantized instead (the fastest prefill, 8x the
    memory at 4 bits); formats no kernel covers, or a machine without a C++ compiler, take that dense path
    too, unless ``low_memory=True``, which dequantizes them in row slices on every call instead.
    ``path`` may also be an ``https://`` URL or a Hub repo id (naming no local path): it is pulled into the
    artifact cache first (:func:`local_artifact`).
    Before reading any weight, the memory the load will hold is estimated from the manifest and config
    (artifact bytes + dense cache + a fixed overhead) and a ResourceError is raised when it exceeds the
    available memory (MemAvailable); ``check_memory=False`` skips that refusal.
    ``public_key`` (PEM, EC): the artifact must carry a ``model.sig`` by that key over exactly the verified
    bytes (:func:`sign`); checked right after verification, before anything is built, from the digests
    verification computed (IntegrityError: unsigned, another key, another artifact). ConfigError with
    ``verify=False`` or for a key that cannot check signatures.
    ``activations``: "float32" (default) multiplies the exact LUT values in float32; "int8" runs 3/4-bit LUT
    weights through the W4A8 kernel (activations quantized per row to int8, exact int32 sums: 2-4x faster at
    16-32 rows, every row's result independent of its batch at any row count; perplexity +3.3 % on SmolLM2-135M
    w4, WikiText-2); ConfigError else.
    """
    from squeeze.runtime.loader import load_artifact

    options = LoadOptions.build(options, split_keywords(keywords, LoadOptions)[0])
    return load_artifact(local_artifact(path, public_key=options.public_key), options)


def loading(options: LoadOptions | None = None, **keywords: Any) -> AbstractContextManager[LoadOptions]:
    """Load options for ``AutoModelForCausalLM.from_pretrained(artifact)`` calls inside a ``with`` block
    (:func:`squeeze.runtime.hf.loading`): ``public_key`` (the signature is checked right after the manifest,
    IntegrityError unless it verifies), ``activations``, ``dense_cache`` / ``low_memory``; a
    :class:`LoadOptions` or its keywords, checked once (ConfigError). ``verify=False`` is refused."""
    from squeeze.runtime.hf import loading as hf_loading

    return hf_loading(options, **keywords)


def set_activations(model: Any, activations: Activations) -> int:
    """Switch a loaded model's LUT kernels to ``activations`` ("int8" or "float32"; ConfigError else): for
    models from ``AutoModelForCausalLM.from_pretrained`` (:func:`load` takes the option directly). Returns
    how many quantized modules were switched."""
    from squeeze.runtime.weight_paths import set_activations as _set

    return _set(model, activations)  # checks it


def generate(
    model: str | os.PathLike[str] | LoadedModel,
    prompts: str | Sequence[str],
    sampling: SamplingParams | None = None,
    *,
    load: LoadOptions | None = None,
    kv: KVOptions | None = None,
    chat: bool = False,
    stream: Callable[[str], None] | None = None,
    **options: Any,
) -> GenerationResult:
    """Load an artifact (verified unless ``verify=False``) and continue the prompts, all in one batch.

    The options come as three objects, each checked once when it is built (the CLI builds them from its
    flags), or as their keywords, from which this call builds them once:
    ``sampling`` (:class:`SamplingParams`; keywords ``max_new_tokens``, ``temperature``, ``top_p``, ``seed``):
    greedy when ``temperature == 0``; else sampling with ``top_p``, seeded by ``seed``.
    ``load`` (:class:`LoadOptions`; keywords ``verify``, ``dense_cache``, ``low_memory``, ``public_key``,
    ``activations``, ``device``): as in :func:`load`; ``device`` is ``cpu`` or ``cuda[:N]``.
    ``kv`` (:class:`KVOptions`; keywords ``kv_bits``, ``kv_dynamic``): the KV cache, as in :func:`evaluate`
    (default: what the artifact was calibrated for).
    ``model``: an artifact directory, or a LoadedModel from :func:`load` (reused as is: the load options then
    only place it on the device; ``public_key`` is a ConfigError: pass it to :func:`load`).
    ``chat`` applies the tokenizer's chat template. ``stream(piece)`` receives the first prompt's text as it
    is produced. Options, prompts and the device are checked (ConfigError), then whether the load fits in
    memory (ResourceError, see :func:`load`), before anything loads.
    Returns texts plus load time, time to first token, tokens/s, peak memory and KV-cache bytes.
    """
    from squeeze.runtime.generate import generate as _generate

    sampling_keywords, load_keywords, kv_keywords = split_keywords(options, _GenerateKeywords, LoadOptions, KVOptions)
    if sampling is None:
        sampling = SamplingParams.for_generate(**sampling_keywords)
    elif sampling_keywords:
        raise ConfigError(f"pass sampling or its keywords, not both (found {', '.join(sorted(sampling_keywords))})")
    load, kv = LoadOptions.build(load, load_keywords), KVOptions.build(kv, kv_keywords)
    prompt_list = check_prompts(prompts)
    loaded, load_seconds = _loaded_on(model, load)
    return _generate(
        loaded,
        loaded.tokenizer,
        prompt_list,
        sampling,
        chat=chat,
        stream=stream,
        load_seconds=load_seconds,
        kv_spec=kv.spec_for(loaded.model, loaded.kv_spec),
    )


@dataclass(frozen=True)
class _GenerateKeywords:
    """The keywords of :meth:`SamplingParams.for_generate` (what :func:`generate` deals its keywords to)."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None


def serve_engine(
    path: str | os.PathLike[str],
    *,
    config: EngineConfig | None = None,
    load: LoadOptions | None = None,
    model_name: str | None = None,
    **load_options: Any,
) -> Engine:
    """Load an artifact (verified unless ``verify=False``) into a serving engine: continuous batching over a
    paged KV cache (squeeze.serve). Start it with ``engine.start()``, or hand it to
    ``squeeze.serve.http.create_app`` (what ``squeeze serve`` does).

    ``config``: the KV cache and batching options (EngineConfig; checked before anything loads, ConfigError).
    Its ``kv_bits`` None takes the artifact's calibrated KV cache when it has one, else full precision;
    4 / 8 need calibrated scales unless ``kv_dynamic``. ``model_name``: what the API reports (default: the
    artifact directory's name). ConfigError when the KV memory cannot hold one full-context sequence.
    ``load``: the :class:`LoadOptions` (or its keywords: ``verify``, ``dense_cache``, ``low_memory``,
    ``public_key``, ``activations``), as in :func:`load`.
    """
    from pathlib import Path

    from squeeze.serve.engine import Engine

    config = config if config is not None else EngineConfig()
    check_engine_config(config)
    load = LoadOptions.build(load, split_keywords(load_options, LoadOptions)[0])
    # a URL or repo id names the model by its last part, not by its directory in the cache
    name = model_name or Path(os.fspath(path).rstrip("/")).resolve().name
    loaded, _ = _loaded_on(path, load)
    from squeeze.runtime.quantized_cache import kv_spec_for

    # the KV options were checked when the EngineConfig was built
    kv_spec = kv_spec_for(loaded.model, loaded.kv_spec, config.kv_bits, dynamic=config.kv_dynamic, checked=True)
    try:
        return Engine(loaded.model, loaded.tokenizer, config, kv_spec, model_name=name)
    except (RuntimeError, MemoryError) as exc:  # the preflight cannot see every limit (overcommit, other processes)
        refused = _allocation_refused(exc, config.kv_memory_bytes)
        if refused is None:
            raise
        raise refused from None


def check_engine_config(config: EngineConfig) -> None:
    """ResourceError when ``config``'s KV pool is more than the memory available now: what :func:`serve_engine`
    checks before anything loads. (The options themselves were checked when the EngineConfig was built:
    ConfigError naming the ``squeeze serve`` flag.)"""
    _check_kv_memory_available(config.kv_memory_bytes)


def _check_kv_memory_available(kv_memory_bytes: int) -> None:
    """ResourceError when the KV pool alone is more than this process can allocate now: the least of the
    available memory, its address-space limit (``ulimit -v``) and its cgroup's limit (the pool is allocated at
    start, on the CPU: a pool that cannot fit failed there with "can't allocate memory", an internal error)."""
    from squeeze.system import memory_headroom

    headroom = memory_headroom()
    if headroom is not None and kv_memory_bytes > headroom.bytes:
        raise ResourceError(
            f"--kv-memory {kv_memory_bytes / 2**30:,.2f} GiB is more than the {headroom.bytes / 2**30:,.2f} GiB of "
            f"{headroom.describe()} (and the model needs room too)",
            hint=_kv_memory_hint(headroom.source),
        )


def _kv_memory_hint(source: str) -> str:
    smaller = "pass a smaller --kv-memory, e.g. 1GiB (it must hold one full-context sequence)"
    if source == "RLIMIT_AS":
        return f"{smaller}, or raise the limit (ulimit -v unlimited)"
    if source == "cgroup":
        return f"{smaller}, or give the container more memory (its memory limit)"
    return smaller


def _allocation_refused(exc: BaseException, kv_memory_bytes: int) -> ResourceError | None:
    """The ResourceError for a KV pool (or model) the system would not allocate, from torch's "can't allocate
    memory" RuntimeError or a MemoryError; None for any other error."""
    if not isinstance(exc, MemoryError) and "can't allocate memory" not in str(exc):
        return None
    return ResourceError(
        f"the system refused the memory for the KV pool and the model (--kv-memory {kv_memory_bytes / 2**30:,.2f} "
        "GiB): out of memory, or over a limit of this process (ulimit -v, a cgroup)",
        hint="pass a smaller --kv-memory, e.g. 1GiB, or raise the limit",
    )


def create_serve_app(
    engine: EngineClient,
    *,
    api_key: str | None = None,
    served_model_name: str | None = None,
    shutdown_grace_seconds: float = 10.0,
    max_request_bytes: int | None = None,
) -> FastAPI:
    """The OpenAI-compatible HTTP app over ``engine`` (:func:`squeeze.serve.http.create_app`; needs the
    ``serve`` extra: fastapi, uvicorn, prometheus-client). ``max_request_bytes``: the body cap (default: from
    the engine's context, squeeze.serve.connection_limits.default_max_request_bytes)."""
    from squeeze.serve.http import create_app

    return create_app(
        engine,
        api_key=api_key,
        served_model_name=served_model_name,
        shutdown_grace_seconds=shutdown_grace_seconds,
        max_request_bytes=max_request_bytes,
    )


def serve_uvicorn_config(
    app: Any,
    *,
    shutdown_grace: float,
    max_connections: int | None = None,
    idle_timeout: float = SERVE_IDLE_TIMEOUT,
) -> Any:
    """The ``uvicorn.Config`` squeeze serve runs ``app`` under (:func:`squeeze.serve.connection_limits.uvicorn_config`):
    a connection that sends no whole request head within ``idle_timeout`` seconds is closed (a body that does
    not follow its head within as long plus 1 s per 64 KiB is answered 408 and closed), connections past
    ``max_connections`` (default: the open-file limit less 64) are answered 503."""
    from squeeze.serve.connection_limits import uvicorn_config

    return uvicorn_config(
        app, shutdown_grace=shutdown_grace, max_connections=max_connections, idle_timeout=idle_timeout
    )


def serve_uvicorn_server(
    app: Any,
    *,
    shutdown_grace: float,
    max_connections: int | None = None,
    idle_timeout: float = SERVE_IDLE_TIMEOUT,
) -> Any:
    """The ``uvicorn.Server`` squeeze serve runs: :func:`serve_uvicorn_config`'s, on an event loop that logs
    failed accepts (out of open files) as one line per 10 s rather than a traceback per try. ConfigError when
    ``max_connections`` is more than the open-file limit less 64 allows."""
    from squeeze.serve.connection_limits import uvicorn_server

    config = serve_uvicorn_config(
        app, shutdown_grace=shutdown_grace, max_connections=max_connections, idle_timeout=idle_timeout
    )
    return uvicorn_server(config)


def pull(
    source: str,
    output: str | os.PathLike[str] | None = None,
    *,
    public_key: str | os.PathLike[str] | None = None,
    workers: int | None = None,
    progress: ProgressFn | None = None,
    min_rate: float | None = None,
    deadline: float | None = None,
) -> PullResult:
    """Download an artifact and verify every byte against its manifest before keeping it.

    ``source``: an ``https://`` / ``http://`` URL of an artifact directory, or a Hugging Face Hub repo id.
    ``output`` (default: the local artifact cache) appears only once every file is complete and verified;
    an interrupted pull resumes from its partial files. ``public_key``: the artifact must carry a signature
    by that key. ``progress(done_bytes, total_bytes)`` is called from worker threads. ``min_rate``: bytes/s
    the transfer must average over a minute (default ``$SQUEEZE_PULL_MIN_RATE``, else 4096; 0: off);
    ``deadline``: seconds the whole pull may take (default ``$SQUEEZE_PULL_DEADLINE``, else none); passing
    either raises TransferError (rerun to resume).
    """
    from squeeze.distribution.pull import pull_artifact

    return pull_artifact(
        source,
        output,
        public_key=public_key,
        workers=workers,
        progress=progress,
        min_rate=min_rate,
        deadline=deadline,
    )


def push(
    path: str | os.PathLike[str],
    repo_id: str,
    *,
    token: str | None = None,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
    card: bool = True,
    base_model: str | None = None,
    eval_reports: Sequence[str | os.PathLike[str]] = (),
) -> PushResult:
    """Verify the artifact at ``path`` and upload it to the Hugging Face Hub repo ``repo_id``, with a model card
    (``README.md``) when ``card`` and neither the artifact nor the repo has one: ``base_model`` (a Hub id; default
    the manifest's source when it is one) in its front matter, and the table of the ``squeeze eval --json``
    reports ``eval_reports`` (files, read and checked before anything is sent)."""
    from squeeze.distribution.model_card import read_eval_report
    from squeeze.distribution.push import push_artifact

    evals = [row for report in eval_reports for row in read_eval_report(report)]
    return push_artifact(
        path,
        repo_id,
        token=token,
        private=private,
        revision=revision,
        commit_message=commit_message,
        card=card,
        base_model=base_model,
        evals=evals,
    )


def local_artifact(
    source: str | os.PathLike[str],
    *,
    public_key: str | os.PathLike[str] | None = None,
    progress: ProgressFn | None = None,
) -> str:
    """``source`` as a local artifact path: a local path as it is (ConfigError "no such artifact directory"
    when it does not exist); an ``https://`` / ``http://`` URL or ``hf://org/name[@revision]`` pulled
    (:func:`pull`) into the artifact cache first, or found there complete
    (``${SQUEEZE_CACHE:-~/.cache/squeeze}/artifacts``). A bare ``org/name`` is a local path: only ``hf://``
    (or :func:`pull`) downloads from the Hub, and never while ``HF_HUB_OFFLINE`` is set. What :func:`load` and
    ``squeeze run -m`` do with such a source; the loader then verifies the directory as always."""
    from squeeze.distribution.pull import existing_artifact_dir, resolve_source
    from squeeze.distribution.remote import is_remote

    text = os.fspath(source)
    if not is_remote(text):
        existing_artifact_dir(text)
        return text

    return os.fspath(resolve_source(text, public_key=public_key, progress=progress))


def _loaded_on(model: str | os.PathLike[str] | LoadedModel, options: LoadOptions) -> tuple[LoadedModel, float]:
    """``model`` loaded (a path; a LoadedModel is taken as is) and moved to ``options.device``; the seconds
    loading took."""
    import dataclasses
    import time

    target = options.torch_device
    if options.public_key is not None and not isinstance(model, (str, os.PathLike)):
        raise ConfigError(
            "public_key applies while loading an artifact, and this model is already loaded",
            hint="pass public_key to squeeze.load(), or pass the artifact's path here",
        )
    if not isinstance(model, (str, os.PathLike)):
        if target.type != "cpu":
            model.model.to(target)
        return model, 0.0
    start = time.perf_counter()
    path = local_artifact(model, public_key=options.public_key)
    on_cpu = target.type == "cpu"
    if not on_cpu:  # host memory: the dense cache (if any) is built on the device, not here
        from squeeze.runtime.memory import check_load_memory

        check_load_memory(path, dense_cache=False, low_memory=True)
        # off the CPU the native kernels do not run: load for the dense (or chunked) path the device takes
        dense = options.dense_cache or not options.low_memory
        options = dataclasses.replace(options, dense_cache=dense, check_memory=False, device="cpu")
    loaded = load(path, options)
    load_seconds = time.perf_counter() - start
    if not on_cpu:
        loaded.model.to(target)
    return loaded, load_seconds


__all__ = [
    "compress_world",
    "verify_model_integrity",
    "sign",
    "check_signing_options",
    "inspect",
    "compress",
    "plan_compress",
    "calibrate_kv",
    "evaluate",
    "load",
    "generate",
    "serve_engine",
    "pull",
    "push",
    "local_artifact",
    "create_serve_app",
    "serve_uvicorn_config",
    "serve_uvicorn_server",
    "check_serve_max_connections",
    "SERVE_IDLE_TIMEOUT",
    "check_engine_config",
    "EngineConfig",
    "parse_size",
    "check_generate_options",
    "check_prompts",
    "check_calibrate_kv_options",
    "builtin_recipes",
    "builtin_calibration_specs",
    "short_path",
    "VerifyReport",
    "ArtifactInfo",
    "DEFAULT_SINK_TOKENS",
    "MIN_SEQ_LEN",
    "KV_FP8_E4M3",
    "Activations",
    "ACTIVATIONS",
    "DEFAULT_ACTIVATIONS",
    "check_activations",
    "set_activations",
    "loading",
    "SamplingParams",
    "LoadOptions",
    "KVOptions",
]
