"""``squeeze pull``: download an artifact, verified against its manifest while it streams."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from squeeze import api
from squeeze.cli.common import cli_errors, err_console, print_json, progress_bar


def pull(
    source: str = typer.Argument(..., help="An https:// or http:// URL of an artifact directory, or a Hub repo id."),
    output: Optional[Path] = typer.Option(
        None, "--output", "-o", help="Where the artifact goes (default: the local artifact cache)."
    ),
    public_key: Optional[Path] = typer.Option(
        None, "--public-key", help="Refuse the artifact unless it is signed by this key (PEM)."
    ),
    workers: int = typer.Option(0, "--workers", min=0, help="Parallel downloads (0 = automatic)."),
    json_out: bool = typer.Option(False, "--json", help="Print only a JSON report to stdout."),
    min_rate: Optional[float] = typer.Option(
        None,
        "--min-rate",
        help="Bytes/s the transfer must average over a minute, else it stops (default $SQUEEZE_PULL_MIN_RATE "
        "or 4096; 0: off).",
    ),
    deadline: Optional[float] = typer.Option(
        None, "--deadline", help="Seconds the whole pull may take (default $SQUEEZE_PULL_DEADLINE or none; 0: none)."
    ),
) -> None:
    """Download an artifact; every file is hashed while it streams and checked before it is kept."""
    with cli_errors():
        with progress_bar("Pulling", not json_out, bytes_=True) as progress:
            result = api.pull(
                source,
                output,
                public_key=public_key,
                workers=workers or None,
                progress=progress,
                min_rate=min_rate,
                deadline=deadline,
            )
    if json_out:
        print_json(result.to_dict())
    elif result.extra.get("already_present"):
        err_console.print(f"[bold green]up to date[/] {result.output} already holds this artifact")
    else:
        reused = f", {result.bytes_reused:,} kept from an earlier try" if result.bytes_reused else ""
        signed = f", signed by key {result.signed_by[:16]}..." if result.signed_by else ""
        err_console.print(
            f"[bold green]pulled[/] {result.files} files ({result.bytes_downloaded:,} bytes downloaded{reused}) "
            f"into {result.output} in {result.seconds:.1f} s, every byte verified{signed}"
        )
