"""``squeeze eval``: perplexity of a model or artifact, with a baseline side by side; or lm-evaluation-harness
tasks on it (``--tasks``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from squeeze import api
from squeeze.api import support
from squeeze.cli.common import PublicKey, cli_errors, err_console, out_console, print_json, stage_progress
from squeeze.cli.run import ActivationsOpt
from squeeze.errors import ConfigError

# The options as Annotated aliases, so that the command's signature is one short line per option.
Model = Annotated[
    str,
    typer.Argument(help="An artifact directory, a local HF model directory, a .gguf file or a built-in model."),
]
Text = Annotated[
    Optional[Path],
    typer.Option("--text", "-t", help="UTF-8 text to measure perplexity on (never the calibration text)."),
]
Tasks = Annotated[
    Optional[str],
    typer.Option(
        "--tasks",
        help="lm-evaluation-harness tasks, comma-separated, run by lm-eval's own evaluator on the model as "
        "squeeze loads it (instead of --text; needs pip install 'squeeze\\[eval]').",
    ),
]
IncludePath = Annotated[
    Optional[Path], typer.Option("--include-path", help="With --tasks: a directory of local task YAMLs.")
]
Limit = Annotated[Optional[int], typer.Option("--limit", min=1, help="With --tasks: the first N documents of each.")]
NumFewshot = Annotated[Optional[int], typer.Option("--num-fewshot", min=0, help="With --tasks: examples per prompt.")]
BatchSize = Annotated[int, typer.Option("--batch-size", min=1, help="With --tasks: sequences per forward pass.")]
Baseline = Annotated[
    Optional[str],
    typer.Option("--baseline", "-b", help="A second model or artifact, measured on the same windows."),
]
SeqLen = Annotated[int, typer.Option("--seq-len", min=2, help="Window length in tokens.")]
MaxWindows = Annotated[Optional[int], typer.Option("--max-windows", min=1, help="Evaluate only the first N windows.")]
KvBits = Annotated[
    Optional[int],
    typer.Option(
        "--kv-bits",
        help="KV cache for the model: 8 or 4 (calibrated; default: what the artifact was calibrated for), "
        "16 = full precision.",
    ),
]
KvDynamic = Annotated[bool, typer.Option("--kv-dynamic", help="With --kv-bits: uncalibrated per-token absmax scales.")]
JsonOut = Annotated[bool, typer.Option("--json", help="Print only JSON to stdout.")]


def eval_(
    model: Model,
    text: Text = None,
    tasks: Tasks = None,
    include_path: IncludePath = None,
    limit: Limit = None,
    num_fewshot: NumFewshot = None,
    batch_size: BatchSize = 1,
    baseline: Baseline = None,
    seq_len: SeqLen = 512,
    max_windows: MaxWindows = None,
    kv_bits: KvBits = None,
    kv_dynamic: KvDynamic = False,
    json_out: JsonOut = False,
    public_key: PublicKey = None,
    activations: ActivationsOpt = support.DEFAULT_ACTIVATIONS,
) -> None:
    """Perplexity, paper protocol: join, tokenize once, non-overlapping windows, exp(mean NLL); plus word perplexity.
    Or, with --tasks, lm-evaluation-harness tasks."""
    task_options = _TaskOptions(include_path, limit, num_fewshot, batch_size)
    with cli_errors():
        if (text is None) == (tasks is None):
            raise ConfigError(
                "pass either --text FILE (perplexity) or --tasks NAMES (lm-evaluation-harness)",
                hint="squeeze eval MODEL --text wiki.test.txt, or squeeze eval MODEL --tasks hellaswag",
            )
        if tasks is None:
            _refuse_task_options(task_options)
        load = support.LoadOptions(public_key=public_key, activations=activations)  # type: ignore[arg-type]
        kv_options = support.KVOptions(kv_bits, kv_dynamic)
    if tasks is not None:
        _eval_tasks(model, tasks, task_options, load, kv_options, json_out)
        return
    assert text is not None  # checked above
    with cli_errors():
        labels = {"model": "Evaluating model (windows)", "baseline": "Evaluating baseline (windows)"}
        with stage_progress(not json_out, labels) as progress:
            result = api.evaluate(
                model,
                text,
                baseline=baseline,
                seq_len=seq_len,
                max_windows=max_windows,
                progress=progress,
                load=load,
                kv=kv_options,
            )
    if activations == "int8" and result.activations != "int8":  # only LUT 3/4-bit native kernels run int8
        err_console.print(
            f"Warning: --activations int8 was asked for, but the linears ran activations {result.activations} "
            "(int8 runs only in the native kernels of 3/4-bit LUT weights)",
            style="yellow",
            soft_wrap=True,
            markup=False,
        )
    if json_out:
        print_json(result.to_dict())
        return
    _print_perplexity(result, text, seq_len)


def _print_perplexity(result: support.EvalResult, text: Path, seq_len: int) -> None:
    """The perplexity table: the model (with its KV cache, when quantized), and the baseline when there is one."""
    table = Table(title=f"{text.name}: {result.result.n_windows} windows x {seq_len} tokens", title_justify="left")
    for column in ("model", "perplexity", "word perplexity"):
        table.add_column(column, justify="left" if column == "model" else "right")
    kv = result.kv or {}
    dynamic = ", dynamic" if kv.get("kv_dynamic") else ""
    kv_label = "" if kv.get("kv_bits", 16) == 16 else f" ({kv.get('kv_cache', 'int' + str(kv['kv_bits']))} KV{dynamic})"
    table.add_row(result.model + kv_label, f"{result.result.perplexity:.3f}", f"{result.result.word_perplexity:.3f}")
    if result.baseline_result is not None:
        table.add_row(
            f"{result.baseline} (baseline)",
            f"{result.baseline_result.perplexity:.3f}",
            f"{result.baseline_result.word_perplexity:.3f}",
        )
    out_console.print(table)


@dataclass(frozen=True)
class _TaskOptions:
    """The lm-evaluation-harness options of ``squeeze eval`` (--include-path, --limit, --num-fewshot,
    --batch-size): they apply with --tasks only."""

    include_path: Optional[Path]
    limit: Optional[int]
    num_fewshot: Optional[int]
    batch_size: int


def _refuse_task_options(options: _TaskOptions) -> None:
    """ConfigError for --tasks options given without --tasks (they would be silently ignored)."""
    given = {"--include-path": options.include_path, "--limit": options.limit, "--num-fewshot": options.num_fewshot}
    stray = [flag for flag, value in given.items() if value is not None] + (
        ["--batch-size"] if options.batch_size != 1 else []
    )
    if stray:
        raise ConfigError(
            f"{', '.join(stray)} {'applies' if len(stray) == 1 else 'apply'} to lm-evaluation-harness tasks only, "
            "and no --tasks was given",
            hint=f"add --tasks NAMES, or drop {', '.join(stray)} for a perplexity run (--max-windows limits that one)",
        )


def _eval_tasks(
    model: str,
    tasks: str,
    options: _TaskOptions,
    load: support.LoadOptions,
    kv: support.KVOptions,
    json_out: bool,
) -> None:
    """``squeeze eval MODEL --tasks NAMES``: lm-eval's results as a table (or JSON)."""
    names = [t.strip() for t in tasks.split(",") if t.strip()]
    with cli_errors():
        result = api.evaluate_tasks(
            model,
            names,
            include_path=options.include_path,
            limit=options.limit,
            num_fewshot=options.num_fewshot,
            batch_size=options.batch_size,
            load=load,
            kv=kv,
        )
    if json_out:
        print_json(result.to_dict())
        return
    table = Table(title=f"{model}: lm-evaluation-harness", title_justify="left")
    for column in ("task", "metric", "value", "stderr"):
        table.add_column(column, justify="left" if column in ("task", "metric") else "right")
    for task, metric, value, stderr in result.rows:
        table.add_row(task, metric, f"{value:.4f}", "" if stderr is None else f"{stderr:.4f}")
    out_console.print(table)
