"""The ``squeeze`` command: a thin Typer layer over squeeze.api; one module per verb."""

from __future__ import annotations

import typer

from squeeze import __version__
from squeeze.cli import inspect as inspect_cmd
from squeeze.cli import verify as verify_cmd

app = typer.Typer(
    name="squeeze",
    help="Compress Hugging Face LLMs with SqueezeLLM, verify the artifact, and run it.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"squeeze {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Show the version."),
) -> None:
    """Compress Hugging Face LLMs with SqueezeLLM, verify the artifact, and run it."""


app.command("verify", short_help="Check an artifact against its manifest (exit 0 intact, 1 tampered, 2 malformed).")(verify_cmd.verify)
app.command("inspect", short_help="Show what an artifact holds.")(inspect_cmd.inspect)


def main() -> None:
    """Console-script entry point."""
    app()
