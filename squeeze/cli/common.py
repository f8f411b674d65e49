"""Shared CLI plumbing: error handling (one line + exit code), consoles, progress bars, JSON output, and the
KV bytes-per-token line three commands print."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    TaskProgressColumn,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from squeeze.cli.progress_lines import ProgressLines
from squeeze.errors import SqueezeError

#: Human output and progress go to stderr so that stdout carries only data (``--json``) or generated text.
err_console = Console(stderr=True, highlight=False)
out_console = Console(highlight=False)

EXIT_INTERRUPTED = 130

#: ``--public-key`` of verify, run, serve and eval (api: ``public_key=``).
PublicKey = Annotated[
    Optional[Path],
    typer.Option(
        "--public-key",
        help="Refuse the artifact unless its model.sig is a signature by this PEM EC public key over exactly "
        "these bytes (squeeze sign; model_signing sign key). Needs the sign extra.",
    ),
]


def debug_enabled() -> bool:
    return os.environ.get("SQUEEZE_DEBUG", "") not in ("", "0")


@contextlib.contextmanager
def cli_errors() -> Iterator[None]:
    """Turn a SqueezeError into ``Error: ...`` (+ hint) on stderr and its exit code; tracebacks only in debug."""
    try:
        yield
    except SqueezeError as exc:
        if debug_enabled():
            raise
        # escaped: a message or hint may hold brackets (pip install 'squeeze[eval]') that are not markup
        err_console.print(f"[bold red]Error:[/] {escape(exc.message)}", soft_wrap=True)
        hint = exc.hint or exc.default_hint  # every refusal says what to do: its own hint, else its class's
        if hint:
            err_console.print(f"[dim]Hint:[/] {escape(hint)}", soft_wrap=True)
        raise typer.Exit(exc.exit_code) from None
    except KeyboardInterrupt:
        if debug_enabled():
            raise
        err_console.print("[bold red]Error:[/] interrupted")
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except (typer.Exit, typer.Abort, SystemExit):
        raise
    except Exception as exc:  # noqa: BLE001 - a bug must still read as one line, with the way to see more
        if debug_enabled():
            raise
        err_console.print(f"[bold red]Error:[/] internal error: {type(exc).__name__}: {exc}", soft_wrap=True)
        err_console.print("[dim]Hint:[/] rerun with SQUEEZE_DEBUG=1 for a traceback, and report it")
        raise typer.Exit(3) from None


def print_json(data: Any) -> None:
    """Write ``data`` as JSON to stdout (and nothing else), for scripts."""
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
    sys.stdout.flush()


def show_progress(enabled: bool) -> bool:
    """Progress bars only on an interactive stderr, never in ``--json`` mode."""
    return enabled and err_console.is_terminal


BYTE_COLUMNS = (
    TextColumn("{task.description}"),
    BarColumn(),
    DownloadColumn(),
    TransferSpeedColumn(),
    TimeRemainingColumn(),
)
STEP_COLUMNS = (
    TextColumn("{task.description}"),
    BarColumn(),
    MofNCompleteColumn(),
    TaskProgressColumn(),
    TimeRemainingColumn(),
)


@contextlib.contextmanager
def progress_bar(
    description: str, enabled: bool, *, bytes_: bool = False
) -> Iterator[Callable[[int, int], None] | None]:
    """A transient rich progress bar on stderr; yields a thread-safe ``progress(done, total)`` or None.

    ``bytes_`` shows sizes and transfer speed (hashing); otherwise N-of-M steps (layers, windows).
    """
    if not show_progress(enabled):
        yield None
        return
    columns = BYTE_COLUMNS if bytes_ else STEP_COLUMNS
    with Progress(*columns, console=err_console, transient=True) as progress:
        task = progress.add_task(description, total=None)

        def update(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        yield update


@contextlib.contextmanager
def stage_progress(
    enabled: bool, labels: dict[str, str], *, lines: bool = False
) -> Iterator[Callable[[str, int, int], None] | None]:
    """One N-of-M bar per pipeline stage, created on its first count; yields ``progress(stage, done, total)``.

    ``lines``: when stderr is not a terminal (a log), plain rate-limited lines instead (cli/progress_lines.py),
    also with ``--json`` (they go to stderr; stdout keeps only the JSON)."""
    if lines and not err_console.is_terminal:
        yield ProgressLines(labels, _write_stderr_line)
        return
    if not show_progress(enabled):
        yield None
        return
    with Progress(*STEP_COLUMNS, console=err_console) as progress:
        tasks: dict[str, Any] = {}

        def update(stage: str, done: int, total: int) -> None:
            if total <= 0:  # a stage's start (nothing to count): the log lines name it, a bar has nothing to show
                return
            if stage not in tasks:
                tasks[stage] = progress.add_task(labels.get(stage, stage), total=total)
            progress.update(tasks[stage], completed=done, total=total)

        yield update


def _write_stderr_line(text: str) -> None:
    """One plain line on stderr, flushed (a log read while the job runs shows it at once)."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def kv_bytes_line(table: dict[str, int]) -> str:
    """``KV bytes/token: fp16 23040, int8 11880 (0.516x), int4 6120 (0.266x)``."""
    fp16 = table["fp16"]
    parts = [f"fp16 {fp16}"] + [f"{k} {v} ({v / fp16:.3f}x)" for k, v in table.items() if k != "fp16"]
    return "KV bytes/token (all layers, scales included): " + ", ".join(parts)
