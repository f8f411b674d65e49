"""The public face of squeeze: every verb of the CLI is one function here.

Heavier stages (models, calibration, quantization, runtime) are imported inside the functions that need
them, so ``import squeeze`` stays light and verify works without loading transformers.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from squeeze.config import CalibrationSpec, Recipe, load_calibration_spec, load_recipe
from squeeze.format.inspect import ArtifactInfo, inspect_artifact
from squeeze.format.verify import VerifyReport, verify_artifact

if TYPE_CHECKING:
    from squeeze.compress.pipeline import CompressResult
    from squeeze.eval.compare import EvalResult
    from squeeze.runtime.loader import LoadedModel

ProgressFn = Callable[[int, int], None]


def verify_model_integrity(
    path: str | os.PathLike[str], *, workers: int | None = None, progress: ProgressFn | None = None
) -> VerifyReport:
    """Check every file of an artifact against its manifest (size and SHA-256, streamed, in parallel).

    ``path`` is the artifact directory or its ``squeeze.manifest.json``. Returns a VerifyReport whose
    ``ok`` is True only if the artifact is intact. Raises FormatError when the manifest is missing or
    malformed (nothing can be checked). ``progress(done_bytes, total_bytes)`` is called from worker threads.
    """
    return verify_artifact(path, workers=workers, progress=progress)


def inspect(path: str | os.PathLike[str]) -> ArtifactInfo:
    """Summarise an artifact (files, tensors by role, bits per weight, manifest status) from headers only."""
    return inspect_artifact(path)




def compress(
    model: str,
    output: str | os.PathLike[str],
    recipe: str | os.PathLike[str] | Recipe = "w4",
    calibration: str | os.PathLike[str] | CalibrationSpec | None = None,
    *,
    seed: int | None = None,
    overwrite: bool = False,
    overrides: Mapping[str, Any] | None = None,
    calibration_overrides: Mapping[str, Any] | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> CompressResult:
    """Compress a causal LM with SqueezeLLM (or RTN) into a sealed artifact directory.

    ``model``: a local HF directory, a hub id in the local HF cache, a ``.gguf`` file, or ``smollm2-135m``.
    ``recipe``: a built-in name (``w4``, ``w3-s045``, ``rtn-w4``, ...), a YAML path or a Recipe;
    ``overrides`` are dotted recipe keys (``{"weights.bits": 3}``). ``calibration``: a built-in spec name,
    a spec YAML, a plain text file or a CalibrationSpec (needed for Fisher sensitivity); ``seed`` overrides
    the calibration sampling seed and seeds k-means: the same inputs and seed give byte-identical shards.
    ``output`` must not exist or be empty unless ``overwrite``; the old artifact is replaced only once the
    new one is complete. ``progress(stage, done, total)`` reports the "fisher" and "quantize" stages.
    """
    from squeeze.compress.pipeline import needs_calibration, run_compress

    resolved = recipe if isinstance(recipe, Recipe) else load_recipe(recipe, **dict(overrides or {}))
    spec = None
    if needs_calibration(resolved) and calibration is not None:
        extra = {**dict(calibration_overrides or {}), **({"seed": seed} if seed is not None else {})}
        spec = calibration if isinstance(calibration, CalibrationSpec) else load_calibration_spec(calibration, **extra)
    effective_seed = seed if seed is not None else (spec.seed if spec is not None else 0)
    return run_compress(model, output, resolved, spec, seed=effective_seed, overwrite=overwrite, progress=progress)


def evaluate(
    model: str | os.PathLike[str],
    text: str | os.PathLike[str],
    *,
    baseline: str | os.PathLike[str] | None = None,
    seq_len: int = 512,
    max_windows: int | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> EvalResult:
    """Perplexity of a model or artifact on a text file (paper protocol), with an optional baseline.

    Joins the text, tokenizes it once, cuts non-overlapping windows of ``seq_len`` tokens (the first
    ``max_windows``), and reports exp(mean NLL) plus lm-eval-style word perplexity. Artifacts are verified
    and loaded through the reference dequantizing path.
    """
    from squeeze.eval.compare import evaluate as _evaluate

    return _evaluate(model, text, baseline=baseline, seq_len=seq_len, max_windows=max_windows, progress=progress)


def load(path: str | os.PathLike[str], *, verify: bool = True, dense_cache: bool = True) -> LoadedModel:
    """Verify an artifact against its manifest and load it (CPU, reference dequantization path)."""
    from squeeze.runtime.loader import load_artifact

    return load_artifact(path, verify=verify, dense_cache=dense_cache)


__all__ = ["verify_model_integrity", "inspect", "compress", "evaluate", "load", "VerifyReport", "ArtifactInfo"]
