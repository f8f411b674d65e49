"""``squeeze push``: upload a verified artifact to the Hugging Face Hub."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from squeeze import api
from squeeze.cli.common import cli_errors, err_console, print_json


def push(
    path: Path = typer.Argument(..., help="The artifact directory."),
    repo_id: str = typer.Argument(..., help="The Hub repository, e.g. my-org/smollm2-135m-w4."),
    private: bool = typer.Option(False, "--private", help="Create the repository as private."),
    revision: Optional[str] = typer.Option(None, "--revision", help="The branch to push to (made when missing)."),
    message: Optional[str] = typer.Option(None, "--commit-message", help="The Hub commit's message."),
    json_out: bool = typer.Option(False, "--json", help="Print only a JSON report to stdout."),
) -> None:
    """Verify an artifact, then upload every file it lists (manifest and signature included) to the Hub.

    The token is huggingface_hub's own (HF_TOKEN, or `hf auth login`)."""
    with cli_errors():
        result = api.push(path, repo_id, private=private, revision=revision, commit_message=message)
    if json_out:
        print_json(result.to_dict())
    else:
        err_console.print(f"[bold green]pushed[/] {result.files} files ({result.bytes_uploaded:,} bytes) to {repo_id}")
