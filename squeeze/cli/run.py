"""``squeeze run``: verify an artifact while loading it, then generate text (streamed) with run statistics."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from squeeze import api
from squeeze.cli.common import cli_errors, err_console, kv_bytes_line, print_json
from squeeze.errors import ConfigError

MIB = 1024 * 1024


def read_prompts_file(path: Path) -> list[str]:
    """One prompt per line of a UTF-8 file, blank lines skipped; ConfigError when unreadable or empty."""
    if not path.is_file():
        raise ConfigError(f"prompts file {path} does not exist or is not a file",
                          hint="pass a UTF-8 text file with one prompt per line")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read prompts file {path}: {exc}", hint="it must be readable UTF-8 text") from exc
    prompts = [line.rstrip("\r") for line in text.split("\n") if line.strip()]
    if not prompts:
        raise ConfigError(f"prompts file {path} holds no prompt (only blank lines)",
                          hint="write one prompt per line")
    return prompts


def _write(piece: str) -> None:
    sys.stdout.write(piece)
    sys.stdout.flush()  # the user watches tokens arrive


def run(
    prompt: Optional[str] = typer.Argument(None, help="Text to continue (may be omitted with --prompts-file)."),
    model: Path = typer.Option(..., "--model", "-m", help="The artifact directory (written by squeeze compress)."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n", help="Tokens to generate per prompt (>= 1)."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy; > 0 samples at this temperature."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass in (0, 1] (with --temperature > 0)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed for sampling (reproducible runs)."),
    chat: bool = typer.Option(False, "--chat", help="Wrap each prompt as a user turn with the chat template."),
    prompts_file: Optional[Path] = typer.Option(None, "--prompts-file", help="One prompt per line, run as one batch (after PROMPT, if given)."),
    low_memory: bool = typer.Option(False, "--low-memory", help="Dequantize on the fly in row chunks instead of caching dense weights."),
    no_verify: bool = typer.Option(False, "--no-verify", help="Skip checking the artifact against its manifest (not recommended)."),
    device: str = typer.Option("cpu", "--device", help="cpu, cuda or cuda:N."),
    kv_bits: Optional[int] = typer.Option(None, "--kv-bits", help="KV cache: 8 or 4 (default: what the artifact was calibrated for, else full precision), 16 = full precision."),
    kv_dynamic: bool = typer.Option(False, "--kv-dynamic", help="With --kv-bits: uncalibrated per-token absmax scales (no calibrate-kv needed)."),
    json_out: bool = typer.Option(False, "--json", help="Print only JSON to stdout (no streaming)."),
) -> None:
    """Generate text from an artifact: tokens stream to stdout; timings and peak memory go to stderr.

    Several prompts (--prompts-file) run as one batch; the first one streams, the others follow it.
    """
    with cli_errors():
        prompts = [prompt] if prompt is not None else []
        if prompts_file is not None:
            prompts += read_prompts_file(prompts_file)
        # everything cheap is checked before the model loads, so a bad option costs nothing and prints nothing
        prompts = api.check_generate_options(prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                                             top_p=top_p, device=device, kv_bits=kv_bits, kv_dynamic=kv_dynamic)
        if no_verify:
            err_console.print("Warning: loading without verification: the artifact's bytes are NOT checked "
                              "against its manifest", style="yellow", soft_wrap=True, markup=False)
        result = api.generate(model, prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                              seed=seed, chat=chat, stream=None if json_out else _write, verify=not no_verify,
                              low_memory=low_memory, device=device, kv_bits=kv_bits, kv_dynamic=kv_dynamic)
    if json_out:
        print_json({**result.to_dict(), "model": str(model), "verified": not no_verify, "low_memory": low_memory})
        return
    _write("\n")
    for i, text in enumerate(result.texts[1:], start=2):
        _write(f"\n--- prompt {i} ---\n{text}\n")
    _print_stats(result, verified=not no_verify)


def _print_stats(result: api.GenerationResult, *, verified: bool) -> None:
    """The KV bytes line (when known) and the stats line, which stays the last line of stderr."""
    tps = f"{result.tokens_per_second:.1f} tok/s" if result.tokens_per_second is not None else "- tok/s"
    memory = (f"peak CUDA {result.peak_cuda_bytes / MIB:.0f} MiB, " if result.peak_cuda_bytes is not None else "")
    if result.kv_bytes_per_token:
        err_console.print(kv_bytes_line(result.kv_bytes_per_token), style="dim", soft_wrap=True, markup=False,
                          highlight=False)
    err_console.print(
        f"load {result.load_seconds:.2f} s ({'verified' if verified else 'NOT verified'}) | "
        f"first token {result.ttft_seconds:.3f} s | {tps} | {sum(result.new_tokens)} new tokens | "
        f"{memory}peak RSS {result.peak_rss_bytes / MIB:.0f} MiB | "
        f"KV cache {result.kv_cache} {result.kv_cache_bytes / MIB:.2f} MiB",
        style="dim", soft_wrap=True, markup=False, highlight=False,
    )
