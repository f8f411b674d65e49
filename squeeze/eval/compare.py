"""Perplexity of a model or artifact, optionally side by side with a baseline, on the same text."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from squeeze.calibrate.windows import read_text_file
from squeeze.errors import ConfigError, ModelError
from squeeze.eval.perplexity import CacheFactory, PerplexityResult, perplexity
from squeeze.models.source import ModelSource
from squeeze.quant.kv_spec import KVSpec
from squeeze.runtime.options import KVOptions, LoadOptions, load_and_kv
from squeeze.runtime.stored_dtype import compute_dtype
from squeeze.runtime.weight_paths import activation_precision, weight_paths


@dataclass(frozen=True)
class EvalResult:
    """Perplexity of ``model`` (and of ``baseline`` when given) on the same text and windows."""

    model: str
    result: PerplexityResult
    baseline: str | None = None
    baseline_result: PerplexityResult | None = None
    #: The model's KV cache: {"kv_bits": 16 (full precision) | 8 | 4, "kv_dynamic": bool, "kv_cache": its name}
    #: (kv_cache: "int8", "int4", "fp8" (kv_bits 8), or the model's dtype for full precision).
    kv: dict[str, Any] | None = None
    #: The activation precision the model's quantized linears ran in (squeeze.runtime.weight_paths:
    #: "float32", "int8" or a mix); "float32" for a model without any.
    activations: str = "float32"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "model": self.model,
            "perplexity": self.result.perplexity,
            "word_perplexity": self.result.word_perplexity,
            "nll": self.result.nll,
            "windows": self.result.n_windows,
            "tokens": self.result.n_tokens,
            **(self.kv or {}),
            "activations_ran": self.activations,
        }
        if self.baseline_result is not None:
            out.update(
                baseline=self.baseline,
                baseline_perplexity=self.baseline_result.perplexity,
                baseline_word_perplexity=self.baseline_result.word_perplexity,
                perplexity_ratio=self.result.perplexity / self.baseline_result.perplexity,
            )
        return out


@dataclass(frozen=True)
class EvalTarget:
    """What one model spec names, found without loading anything: an artifact directory or a model source."""

    spec: str
    artifact: Path | None = None
    source: ModelSource | None = None


def resolve_target(spec: str | os.PathLike[str], option: str | None = None) -> EvalTarget:
    """Check cheaply (no model loading, no hashing) that ``spec`` names something ``eval`` can open.

    An artifact directory (it has a manifest), or anything :func:`squeeze.models.source.resolve_model`
    resolves (an HF directory, a .gguf file, a built-in alias, a cached hub id). A squeeze output without
    its manifest is refused here rather than handed to transformers. ``option`` (e.g. ``--baseline``)
    prefixes the error so the user knows which of the two models is wrong.
    """
    from squeeze.compression.workarea import WORK_NAME
    from squeeze.format.manifest import MANIFEST_NAME
    from squeeze.format.quant_config import QuantizationConfig
    from squeeze.models.remote_code import read_small_json
    from squeeze.models.source import resolve_model
    from squeeze.runtime.loader import is_artifact

    text = os.fspath(spec)
    prefix = f"{option}: " if option else ""
    if is_artifact(text):
        return EvalTarget(text, artifact=Path(text))
    path = Path(text).expanduser()
    if path.is_dir():
        config = read_small_json(path / "config.json")
        quant = QuantizationConfig.from_model_config(config if isinstance(config, dict) else None, strict=False)
        unfinished = (path / WORK_NAME).exists()
        if unfinished or quant is not None:
            raise ModelError(
                f"{prefix}{text} is a squeeze output without its manifest ({MANIFEST_NAME}): expected a complete "
                "artifact",
                hint="it is an unfinished squeeze compress: rerun that command with --resume to finish it"
                if unfinished
                else "copy the whole artifact again (the manifest included), or compress again",
            )
    try:
        return EvalTarget(text, source=resolve_model(text))
    except ModelError as exc:
        if not prefix:
            raise
        raise ModelError(prefix + exc.message, hint=exc.hint) from None


def open_for_eval(spec: str | os.PathLike[str]) -> tuple[nn.Module, Any]:
    """(model, tokenizer) from an artifact directory (verified, reference dequant path) or a model spec."""
    model, tokenizer, _ = open_target(resolve_target(spec))
    return model, tokenizer


def open_target(target: EvalTarget, options: LoadOptions | None = None) -> tuple[nn.Module, Any, KVSpec | None]:
    """(model, tokenizer, the artifact's calibrated KV spec or None); an artifact is loaded with ``options``
    (its ``public_key`` checks the signature, its ``activations`` set the LUT kernels' precision), always
    verified."""
    from squeeze.models.source import load_model
    from squeeze.runtime.loader import load_artifact

    if target.artifact is not None:
        loaded = load_artifact(target.artifact, options if options is not None else LoadOptions())
        return loaded.model, loaded.tokenizer, loaded.kv_spec
    assert target.source is not None
    model, tokenizer = load_model(target.source)
    return model, tokenizer, None


def kv_cache_factory(
    model: nn.Module, calibrated: KVSpec | None, kv: KVOptions
) -> tuple[CacheFactory | None, KVSpec | None]:
    """The cache every window is scored through (None: no cache), per squeeze.runtime.kv_selection.select_kv_spec."""
    from squeeze.runtime.quantized_cache import SqueezeKVCache

    spec = kv.spec_for(model, calibrated)
    if spec is None:
        return None, None
    return (lambda: SqueezeKVCache(spec)), spec


def evaluate(
    model: str | os.PathLike[str],
    text_file: str | os.PathLike[str],
    *,
    baseline: str | os.PathLike[str] | None = None,
    seq_len: int = 512,
    max_windows: int | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    load: LoadOptions | None = None,
    kv: KVOptions | None = None,
    **options: Any,
) -> EvalResult:
    """Paper-protocol perplexity of ``model`` (and ``baseline``) on ``text_file``; see squeeze.api.evaluate.

    The KV options (``kv``) apply to ``model`` only; the baseline always runs with a full-precision cache-free
    pass. Everything cheap is checked before the first model loads: the options (when they were built), the
    text file, then that both ``model`` and ``baseline`` exist and can be opened (see :func:`resolve_target`).
    ``load.public_key``: ``model`` must be an artifact signed by this key (checked while it loads); the
    baseline is not checked. ``load.activations``: the LUT kernels' activation precision for artifacts (model
    and baseline). Artifacts are always verified.
    """
    load, kv = load_and_kv(options, load, kv)  # as given, or built once from their keywords
    public_key = load.public_key
    text = read_text_file(text_file, "evaluation text", ConfigError)
    targets = {"model": resolve_target(model)}
    if public_key is not None and targets["model"].artifact is None:
        raise ConfigError(
            f"--public-key checks an artifact's signature, and {model} is not a squeeze artifact",
            hint="drop --public-key, or evaluate the signed artifact",
        )
    if baseline is not None:
        targets["baseline"] = resolve_target(baseline, "--baseline")
    kv_used: list[tuple[int, str]] = []
    ran: list[str] = []

    def measure(label: str, with_kv: bool) -> PerplexityResult:
        unsigned = dataclasses.replace(load, public_key=None) if public_key is not None else load
        net, tokenizer, calibrated = open_target(targets[label], load if label == "model" else unsigned)
        factory = None
        if label == "model":
            ran.append(activation_precision(weight_paths(net)))
        if with_kv:
            factory, chosen = kv_cache_factory(net, calibrated, kv)
            full = str(compute_dtype(net)).removeprefix("torch.")  # not net.dtype: a stored float16 embedding
            kv_used.append((chosen.bits, chosen.label) if chosen is not None else (16, full))
        report = (lambda done, total: progress(label, done, total)) if progress else None
        return perplexity(
            net, tokenizer, text, seq_len=seq_len, max_windows=max_windows, progress=report, kv_cache=factory
        )

    result = measure("model", True)
    kv_info = {"kv_bits": kv_used[0][0], "kv_dynamic": kv.kv_dynamic, "kv_cache": kv_used[0][1]}
    if baseline is None:
        return EvalResult(str(model), result, kv=kv_info, activations=ran[0])
    return EvalResult(str(model), result, str(baseline), measure("baseline", False), kv=kv_info, activations=ran[0])
