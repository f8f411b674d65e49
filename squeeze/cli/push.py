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
    card: bool = typer.Option(
        True, "--card/--no-card", help="Add a model card (README.md) when neither the artifact nor the repo has one."
    ),
    base_model: Optional[str] = typer.Option(
        None, "--base-model", help="The Hub id it was compressed from (default: the manifest's source, if a Hub id)."
    ),
    eval_json: Optional[list[Path]] = typer.Option(
        None, "--eval-json", help="A `squeeze eval --json` report for the card's evaluation table (repeatable)."
    ),
) -> None:
    """Verify an artifact, then upload every file it lists (manifest and signature included) to the Hub, with a
    model card (README.md, not part of the artifact) unless the repo already has one.

    The token is huggingface_hub's own (HF_TOKEN, or `hf auth login`)."""
    with cli_errors():
        result = api.push(
            path,
            repo_id,
            private=private,
            revision=revision,
            commit_message=message,
            card=card,
            base_model=base_model,
            eval_reports=eval_json or (),
        )
    if json_out:
        print_json(result.to_dict())
        return
    card_note = {
        "written": "; model card README.md written",
        "repo_has_one": "; the repo's README.md kept (no card written)",
        "artifact_has_one": "; the artifact's own README.md is the card",
        "off": "",
    }[result.model_card]
    err_console.print(
        f"[bold green]pushed[/] {result.files} files ({result.bytes_uploaded:,} bytes) to {repo_id}{card_note}"
    )
