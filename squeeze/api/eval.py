"""The eval verbs: perplexity on a text (``evaluate``) and lm-evaluation-harness tasks (``evaluate_tasks``)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from squeeze.errors import ConfigError
from squeeze.runtime.options import KVOptions, LoadOptions, load_and_kv

if TYPE_CHECKING:
    from squeeze.eval.compare import EvalResult
    from squeeze.eval.harness import HarnessResult


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


__all__ = ["evaluate", "evaluate_tasks"]
