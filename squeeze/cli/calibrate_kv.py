"""``squeeze calibrate-kv``: fit int8 / int4 KV-cache scales, or vLLM's fp8 KV scales, and add them to an artifact."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from squeeze import api
from squeeze.api.support import DEFAULT_SINK_TOKENS, MIN_SEQ_LEN
from squeeze.cli.common import cli_errors, err_console, kv_bytes_line, out_console, print_json, stage_progress

# The options as Annotated aliases, so that the command's signature is one short line per option.
Target = Annotated[
    str,
    typer.Argument(
        help="An artifact directory (updated in place unless --output), or a model (then --output is required).",
    ),
]
Bits = Annotated[
    str,
    typer.Option(
        "--bits",
        help="KV cache: 8 or 4 (squeeze's calibrated int grids), or fp8 (per-layer k/v scales for vLLM's "
        'kv_cache_dtype="fp8"; squeeze run uses them too).',
    ),
]
Calibration = Annotated[
    Optional[str],
    typer.Option(
        "--calibration",
        "-c",
        help="Calibration text file, spec YAML or built-in spec (default: the artifact's own built-in spec).",
    ),
]
Output = Annotated[
    Optional[Path], typer.Option("--output", "-o", help="Write a new artifact here instead of updating TARGET.")
]
SinkTokens = Annotated[
    Optional[int],
    typer.Option(
        "--sink-tokens",
        help=f"Leading tokens kept in full precision (attention sink, default {DEFAULT_SINK_TOKENS}; int8 / int4).",
    ),
]
KeyGroup = Annotated[
    Optional[int],
    typer.Option(
        "--key-group-size",
        help="Channels per key grid (default at int4: 32, or half the head under 64 channels; at int8: the whole "
        "head; int8 / int4 only).",
    ),
]
ValueGroup = Annotated[
    Optional[int],
    typer.Option("--value-group-size", help="Channels per value grid (default: the whole head; int8 / int4 only)."),
]
NumSamples = Annotated[
    Optional[int], typer.Option("--num-samples", min=1, help="Calibration windows (overrides the spec).")
]
SeqLen = Annotated[
    Optional[int], typer.Option("--seq-len", min=MIN_SEQ_LEN, help="Calibration window length in tokens.")
]
Overwrite = Annotated[bool, typer.Option("--overwrite", help="Replace a non-empty --output directory.")]
JsonOut = Annotated[bool, typer.Option("--json", help="Print only a JSON summary to stdout.")]
DropSignature = Annotated[
    bool,
    typer.Option(
        "--drop-signature",
        help="Calibrate a signed artifact: the new one is written without model.sig (sign it again with squeeze "
        "sign); without this flag a signed artifact is refused.",
    ),
]


def calibrate_kv(
    target: Target,
    bits: Bits = "8",
    calibration: Calibration = None,
    output: Output = None,
    sink_tokens: SinkTokens = None,
    key_group: KeyGroup = None,
    value_group: ValueGroup = None,
    num_samples: NumSamples = None,
    seq_len: SeqLen = None,
    overwrite: Overwrite = False,
    json_out: JsonOut = False,
    drop_signature: DropSignature = False,
) -> None:
    """Capture keys and values on calibration text, fit their scales, and add them to the artifact.

    Keys: per-channel normaliser (post-RoPE) then per-token grids; values: per-token grids with a
    calibrated clipping ratio per head (int8) or a calibrated 16-level codebook per layer (int4); the first
    --sink-tokens tokens stay in full precision. fp8: one scale per layer for keys (post-RoPE) and one for
    values, absmax / 448, as vLLM reads them (kv_cache_dtype="fp8"); every token is fp8. The artifact is
    swapped for the new one only when it is complete and sealed; a failed run leaves it as it was.
    """
    with cli_errors():
        # before the artifact or the calibration text is read
        choice = api.check_calibrate_kv_options(bits, sink_tokens, key_group=key_group, value_group=value_group)
        with stage_progress(not json_out, {"kv": "Capturing keys and values (windows)"}) as progress:
            result = api.calibrate_kv(
                target,
                calibration,
                bits=choice,
                output=output,
                sink_tokens=sink_tokens,
                key_group=key_group,
                value_group=value_group,
                overwrite=overwrite,
                drop_signature=drop_signature,
                calibration_overrides={"num_samples": num_samples, "seq_len": seq_len},
                progress=progress,
            )
    if json_out:
        print_json(result.to_dict())
        return
    fit = result.calibration
    sink = f"{result.sink_tokens} sink token(s) kept exact" if result.sink_tokens else "no sink: every token quantized"
    out_console.print(
        f"[bold green]wrote[/] {result.label} KV scales to {result.output} "
        f"({fit['tokens']} calibration tokens per layer, {sink})"
    )
    table = Table(title=f"calibration error (sum of squares) vs {fit['baseline']}", title_justify="left")
    for column in ("", "calibrated", "baseline", "ratio"):
        table.add_column(column, justify="right" if column else "left")
    for part in ("key", "value"):
        calibrated, dynamic = fit[f"{part}_error"], fit[f"dynamic_{part}_error"]
        table.add_row(f"{part}s", f"{calibrated:.4g}", f"{dynamic:.4g}", f"{calibrated / max(dynamic, 1e-30):.3f}")
    out_console.print(table)
    out_console.print(kv_bytes_line(result.bytes_per_token))
    err_console.print(f"[dim]root digest {result.root_digest}; check it with `squeeze verify {result.output}`[/]")
