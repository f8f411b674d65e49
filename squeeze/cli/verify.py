"""``squeeze verify``: check an artifact against its manifest."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from squeeze import api
from squeeze.api import short_path
from squeeze.cli.common import PublicKey, cli_errors, err_console, out_console, print_json, progress_bar

EXIT_HELP = """

Exit codes: 0 the artifact is intact; 1 integrity failure (hash or size mismatch, missing, extra or
truncated file, symlink, inconsistent manifest or index; with --public-key: unsigned, signed by another key
or over another artifact); 2 usage error (an unusable --public-key too) or malformed/missing manifest.
"""


def verify(
    path: Path = typer.Argument(..., help="The artifact directory or its squeeze.manifest.json."),
    json_out: bool = typer.Option(False, "--json", help="Print only a JSON report to stdout."),
    workers: int = typer.Option(0, "--workers", min=0, help="Hashing threads (0 = automatic)."),
    public_key: PublicKey = None,
) -> None:
    """Verify every file's size and SHA-256 against the manifest (streamed, in parallel threads)."""
    with cli_errors():
        if public_key is not None:
            api.check_signing_options(public_key)  # a bad key: exit 2 before anything is hashed
        with progress_bar("Hashing", not json_out, bytes_=True) as progress:
            report = api.verify_model_integrity(path, workers=workers or None, progress=progress, public_key=public_key)
    if json_out:
        print_json(report.to_dict())
    else:
        table = Table(title=escape(short_path(report.artifact_dir)), title_justify="left")
        table.add_column("file")
        table.add_column("size", justify="right")
        table.add_column("status")
        for result in report.files:
            status = "[green]OK[/]" if result.ok else f"[bold red]FAILED[/] {escape(result.error or '')}"
            table.add_row(escape(short_path(result.path)), "" if result.size is None else f"{result.size:,}", status)
        out_console.print(table)
        for problem in report.problems:
            out_console.print(f"[bold red]FAILED[/] {escape(problem)}")
        speed = report.bytes_hashed / report.seconds / 1e6 if report.seconds > 0 else 0.0
        summary = (
            f"{len(report.files)} files, {report.bytes_hashed:,} bytes hashed in {report.seconds:.2f} s "
            f"({speed:,.0f} MB/s)"
        )
        if report.ok:
            out_console.print(f"[bold green]intact[/]: {summary}; root digest {report.root_digest}")
        signature = getattr(report, "signature", None)
        if report.ok and signature is not None:
            out_console.print(
                f"[bold green]signed[/]: {escape(short_path(signature.path))} by key sha256:{signature.key_sha256[:16]}"
                f"... covers {signature.files} files, the manifest included"
            )
    if not report.ok:
        if not json_out:
            first = escape(report.first_error() or "")
            err_console.print(f"[bold red]Error:[/] integrity check failed: {first}", soft_wrap=True)
        raise typer.Exit(1)


verify.__doc__ = (verify.__doc__ or "") + EXIT_HELP
