"""``squeeze eval``: perplexity of a model or artifact, with a baseline side by side."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from squeeze import api
from squeeze.cli.common import PublicKey, cli_errors, out_console, print_json, stage_progress
from squeeze.cli.run import ActivationsOpt

# The options as Annotated aliases, so that the command's signature is one short line per option.
Model = Annotated[
    str,
    typer.Argument(help="An artifact directory, a local HF model directory, a .gguf file or a built-in model."),
]
Text = Annotated[Path, typer.Option("--text", "-t", help="UTF-8 text to evaluate on (never the calibration text).")]
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
    text: Text,
    baseline: Baseline = None,
    seq_len: SeqLen = 512,
    max_windows: MaxWindows = None,
    kv_bits: KvBits = None,
    kv_dynamic: KvDynamic = False,
    json_out: JsonOut = False,
    public_key: PublicKey = None,
    activations: ActivationsOpt = api.DEFAULT_ACTIVATIONS,
) -> None:
    """Perplexity, paper protocol: join, tokenize once, non-overlapping windows, exp(mean NLL); plus word perplexity."""
    with cli_errors():
        activations = api.check_activations(activations)
        labels = {"model": "Evaluating model (windows)", "baseline": "Evaluating baseline (windows)"}
        with stage_progress(not json_out, labels) as progress:
            result = api.evaluate(
                model,
                text,
                baseline=baseline,
                seq_len=seq_len,
                max_windows=max_windows,
                progress=progress,
                kv_bits=kv_bits,
                kv_dynamic=kv_dynamic,
                public_key=public_key,
                activations=activations,
            )
    if json_out:
        print_json(result.to_dict())
        return
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
