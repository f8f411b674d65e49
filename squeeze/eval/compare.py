"""Perplexity of a model or artifact, optionally side by side with a baseline, on the same text."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from squeeze.calibrate.windows import read_text_file
from squeeze.errors import ConfigError
from squeeze.eval.perplexity import PerplexityResult, perplexity


@dataclass(frozen=True)
class EvalResult:
    """Perplexity of ``model`` (and of ``baseline`` when given) on the same text and windows."""

    model: str
    result: PerplexityResult
    baseline: str | None = None
    baseline_result: PerplexityResult | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "model": self.model,
            "perplexity": self.result.perplexity,
            "word_perplexity": self.result.word_perplexity,
            "nll": self.result.nll,
            "windows": self.result.n_windows,
            "tokens": self.result.n_tokens,
        }
        if self.baseline_result is not None:
            out.update(
                baseline=self.baseline,
                baseline_perplexity=self.baseline_result.perplexity,
                baseline_word_perplexity=self.baseline_result.word_perplexity,
                perplexity_ratio=self.result.perplexity / self.baseline_result.perplexity,
            )
        return out


def open_for_eval(spec: str | os.PathLike[str]) -> tuple[nn.Module, Any]:
    """(model, tokenizer) from an artifact directory (verified, reference dequant path) or a model spec."""
    from squeeze.models.source import load_model, resolve_model
    from squeeze.runtime.loader import is_artifact, load_artifact

    if is_artifact(spec):
        loaded = load_artifact(spec, verify=True)
        return loaded.model, loaded.tokenizer
    return load_model(resolve_model(str(spec)))


def evaluate(
    model: str | os.PathLike[str],
    text_file: str | os.PathLike[str],
    *,
    baseline: str | os.PathLike[str] | None = None,
    seq_len: int = 512,
    max_windows: int | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> EvalResult:
    """Paper-protocol perplexity of ``model`` (and ``baseline``) on ``text_file``; see squeeze.api.evaluate."""
    text = read_text_file(text_file, "evaluation text", ConfigError)

    def measure(spec: str | os.PathLike[str], label: str) -> PerplexityResult:
        net, tokenizer = open_for_eval(spec)
        report = (lambda done, total: progress(label, done, total)) if progress else None
        return perplexity(net, tokenizer, text, seq_len=seq_len, max_windows=max_windows, progress=report)

    result = measure(model, "model")
    if baseline is None:
        return EvalResult(str(model), result)
    return EvalResult(str(model), result, str(baseline), measure(baseline, "baseline"))
