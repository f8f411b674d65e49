"""The ``squeeze`` command: a thin Typer layer over squeeze.api; one module per verb."""

from __future__ import annotations

import warnings

import typer

from squeeze import api
from squeeze.cli import calibrate_kv as calibrate_kv_cmd
from squeeze.cli import compress as compress_cmd
from squeeze.cli import eval as eval_cmd
from squeeze.cli import inspect as inspect_cmd
from squeeze.cli import pull as pull_cmd
from squeeze.cli import push as push_cmd
from squeeze.cli import run as run_cmd
from squeeze.cli import serve as serve_cmd
from squeeze.cli import sign as sign_cmd
from squeeze.cli import verify as verify_cmd
from squeeze.version import __version__

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
    quiet_third_party_progress()


app.command("compress", short_help="Compress a model into a verified artifact (SqueezeLLM or RTN).")(
    compress_cmd.compress
)
app.command("calibrate-kv", short_help="Fit int8/int4 KV-cache scales and add them to an artifact.")(
    calibrate_kv_cmd.calibrate_kv
)
app.command("eval", short_help="Perplexity of a model or artifact, with a baseline side by side.")(eval_cmd.eval_)
app.command("verify", short_help="Check an artifact against its manifest (exit 0 intact, 1 tampered, 2 malformed).")(
    verify_cmd.verify
)
app.command("sign", short_help="Sign a verified artifact (model.sig, OpenSSF model signing; checked by --public-key).")(
    sign_cmd.sign
)
app.command("inspect", short_help="Show what an artifact holds.")(inspect_cmd.inspect)
app.command("run", short_help="Generate text from an artifact (verified while loading), streamed.")(run_cmd.run)
app.command(
    "serve",
    short_help="Serve an artifact over an OpenAI-compatible HTTP API (continuous batching, paged quantized KV).",
)(serve_cmd.serve)
app.command("pull", short_help="Download an artifact (URL or Hub repo id), verified while it streams.")(pull_cmd.pull)
app.command("push", short_help="Upload a verified artifact to the Hugging Face Hub.")(push_cmd.push)


def quiet_third_party_progress() -> None:
    """transformers/datasets draw their own tqdm bars on stderr; squeeze shows its own (or JSON only)."""
    import os

    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:  # transformers is a dependency; this only guards broken installs of it
        pass


def _squeeze_warnings_on_one_line(
    message: Warning | str, category: type[Warning], filename: str, lineno: int, line: str | None = None
) -> str:
    """squeeze's own warnings as one line (``Warning: ...``); others keep Python's format (file and line)."""
    if category.__module__.startswith("squeeze"):
        return f"Warning: {message}\n"
    return _python_format(message, category, filename, lineno, line)


_python_format = warnings.formatwarning


def main() -> None:
    """Console-script entry point."""
    warnings.formatwarning = _squeeze_warnings_on_one_line
    api.register(lm_eval=False)  # transformers, lazily (`import squeeze` registers nothing); eval registers lm-eval
    app()
