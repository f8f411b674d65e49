"""``squeeze inspect``: what an artifact holds."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from squeeze import api
from squeeze.api import support
from squeeze.api.support import short_path
from squeeze.cli.common import cli_errors, kv_bytes_line, out_console, print_json


def inspect(
    path: Path = typer.Argument(..., help="The artifact directory (or its manifest)."),
    json_out: bool = typer.Option(False, "--json", help="Print only JSON to stdout."),
) -> None:
    """Show files, tensors by role, bits per weight and manifest status (reads headers only)."""
    with cli_errors():
        info = api.inspect(path)
    if json_out:
        print_json(info.to_dict())
        return
    files = Table(title=escape(short_path(info.directory)), title_justify="left")
    files.add_column("file")
    files.add_column("size", justify="right")
    files.add_column("in manifest")
    for entry in info.files:
        size = "missing" if entry["size"] is None else f"{entry['size']:,}"
        if entry.get("problem"):  # a link or special file: listed, never followed or read
            size = f"[red]{entry['problem']}[/]"
        files.add_row(escape(short_path(entry["path"])), size, "yes" if entry["listed"] else "[red]no[/]")
    out_console.print(files)
    roles = Table(title=f"{info.n_tensors} tensors by role", title_justify="left")
    roles.add_column("role")
    roles.add_column("count", justify="right")
    roles.add_column("bytes", justify="right")
    for role in info.roles:
        roles.add_row(role.role, str(role.count), f"{role.bytes:,}")
    out_console.print(roles)
    quant = info.quantization.to_dict() if info.quantization is not None else {}
    if quant:  # in config.json's (sorted) key order
        desc = ", ".join(f"{k}={v}" for k, v in sorted(quant.items()) if k != "modules")
        out_console.print(f"quantization: {desc}")
        out_console.print(f"quantized modules: {info.quantized_modules}; bits per weight: {info.bits_per_weight}")
        if len(info.widths) > 1:  # a bits-per-weight budget: how many modules got each width
            shares = ", ".join(f"{n} at {bits} bits" for bits, n in info.widths.items())
            out_console.print(f"widths: {shares}")
        if info.expert_parameters:  # MoE: the 3-D expert parameters among them, and the experts they hold
            out_console.print(f"of which expert parameters: {info.expert_parameters} ({info.experts} expert matrices)")
    else:
        out_console.print("quantization: none")
    if info.kv_bytes_per_token:
        kv = dict(info.quantization.kv_cache or {}) if info.quantization is not None else None
        if isinstance(kv, dict) and kv.get("format") == support.KV_FP8_E4M3:
            calibrated = "calibrated for fp8 (per-layer scales, vLLM kv_cache_dtype=fp8)"
        else:
            calibrated = (
                f"calibrated for int{kv['bits']}" if isinstance(kv, dict) and "bits" in kv else "not calibrated"
            )
        out_console.print(f"KV cache: {calibrated}; " + kv_bytes_line(info.kv_bytes_per_token))
    digest = f"; root digest {info.root_digest}" if info.root_digest else ""
    out_console.print(f"manifest: {info.manifest_status}{digest}")
