"""``squeeze run``: verify an artifact while loading it, then generate text (streamed) with run statistics."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from squeeze import api
from squeeze.api import support
from squeeze.cli.common import PublicKey, cli_errors, err_console, kv_bytes_line, print_json, progress_bar
from squeeze.errors import ConfigError

MIB = 1024 * 1024
UNVERIFIED_WARNING = "Warning: loading without verification: the artifact's bytes are NOT checked against its manifest"


def read_prompts_file(path: Path) -> list[str]:
    """One prompt per line of a UTF-8 file, blank lines skipped; ConfigError when unreadable or empty."""
    if not path.is_file():
        raise ConfigError(
            f"prompts file {path} does not exist or is not a file",
            hint="pass a UTF-8 text file with one prompt per line",
        )
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read prompts file {path}: {exc}", hint="it must be readable UTF-8 text") from exc
    prompts = [line.rstrip("\r") for line in text.split("\n") if line.strip()]
    if not prompts:
        raise ConfigError(f"prompts file {path} holds no prompt (only blank lines)", hint="write one prompt per line")
    return prompts


def _write(piece: str) -> None:
    sys.stdout.write(piece)
    sys.stdout.flush()  # the user watches tokens arrive


# The options as Annotated aliases, so that the command's signature is one short line per option.
Prompt = Annotated[Optional[str], typer.Argument(help="Text to continue (may be omitted with --prompts-file).")]
# a string, not a Path: a URL's "//" must survive
Model = Annotated[
    str,
    typer.Option(
        "--model",
        "-m",
        help="The artifact directory (written by squeeze compress), or an https:// URL or Hub repo id of one "
        "(pulled into the artifact cache first, verified).",
    ),
]
MaxNewTokens = Annotated[int, typer.Option("--max-new-tokens", "-n", help="Tokens to generate per prompt (>= 1).")]
Temperature = Annotated[float, typer.Option("--temperature", help="0 = greedy; > 0 samples at this temperature.")]
TopP = Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass in (0, 1] (with --temperature > 0).")]
Seed = Annotated[Optional[int], typer.Option("--seed", help="Seed for sampling (reproducible runs).")]
Chat = Annotated[bool, typer.Option("--chat", help="Wrap each prompt as a user turn with the chat template.")]
PromptsFile = Annotated[
    Optional[Path],
    typer.Option("--prompts-file", help="One prompt per line, run as one batch (after PROMPT, if given)."),
]
Dense = Annotated[
    bool,
    typer.Option(
        "--dense",
        help="Cache every weight dequantized in fp32: faster prefill, ~8x the weight memory at 4 bits.",
    ),
]
LowMemory = Annotated[
    bool,
    typer.Option(
        "--low-memory",
        help="Never build dense weights: only matters where no native kernel covers a weight "
        "(then it dequantizes row slices per call).",
    ),
]
SpeculateOpt = Annotated[
    str,
    typer.Option(
        "--speculate",
        help="Speculative decoding over the same weights: ngram:K (K tokens copied from the prompt and output so "
        "far), int8:K (K tokens drafted by the W4A8 path) or off (default). The same tokens either way; faster "
        "where drafts are accepted.",
    ),
]
ActivationsOpt = Annotated[
    str,
    typer.Option(
        "--activations",
        help="Activation precision of the native LUT kernels: float32 (the exact LUT values; default), int8 "
        "(W4A8 for 3/4-bit weights, activations per group of 64 columns: 2.5-3x faster at 16-32 rows) or bfloat16 "
        "(AVX-512 BF16 CPUs; float32 elsewhere).",
    ),
]
NoVerify = Annotated[
    bool, typer.Option("--no-verify", help="Skip checking the artifact against its manifest (not recommended).")
]
Device = Annotated[str, typer.Option("--device", help="cpu, cuda or cuda:N.")]
KvBits = Annotated[
    Optional[int],
    typer.Option(
        "--kv-bits",
        help="KV cache: 8 or 4 (default: what the artifact was calibrated for, else full precision), "
        "16 = full precision.",
    ),
]
KvDynamic = Annotated[
    bool,
    typer.Option("--kv-dynamic", help="With --kv-bits: uncalibrated per-token absmax scales (no calibrate-kv needed)."),
]
JsonOut = Annotated[bool, typer.Option("--json", help="Print only JSON to stdout (no streaming).")]


def run(
    model: Model,  # before PROMPT: required (no default); the help lists it among the options as before
    prompt: Prompt = None,
    max_new_tokens: MaxNewTokens = 128,
    temperature: Temperature = 0.0,
    top_p: TopP = 1.0,
    seed: Seed = None,
    chat: Chat = False,
    prompts_file: PromptsFile = None,
    dense: Dense = False,
    low_memory: LowMemory = False,
    activations: ActivationsOpt = support.DEFAULT_ACTIVATIONS,
    speculate: SpeculateOpt = "off",
    no_verify: NoVerify = False,
    device: Device = "cpu",
    kv_bits: KvBits = None,
    kv_dynamic: KvDynamic = False,
    json_out: JsonOut = False,
    public_key: PublicKey = None,
) -> None:
    """Generate text from an artifact: tokens stream to stdout; timings, peak memory and the weights path go to stderr.

    Several prompts (--prompts-file) run as one batch; the first one streams, the others follow it.
    """
    with cli_errors():
        # everything cheap is checked before the model loads, so a bad option costs nothing and prints nothing;
        # each options object is checked once, when built here: api.generate and the runtime take them as they are
        sampling = support.SamplingParams.for_generate(max_new_tokens, temperature, top_p, seed)
        load = support.LoadOptions(
            verify=not no_verify,
            dense_cache=dense,
            low_memory=low_memory,
            public_key=public_key,
            activations=activations,  # type: ignore[arg-type]  # checked when the options are built
            device=device,
        )
        kv = support.KVOptions(kv_bits, kv_dynamic)
        speculation = support.SpeculationOptions.parse(speculate)
        prompts = api.check_prompts(_prompts(prompt, prompts_file))
        if no_verify:
            err_console.print(UNVERIFIED_WARNING, style="yellow", soft_wrap=True, markup=False)
        stream = None if json_out else _write
        with progress_bar("Pulling", not json_out, bytes_=True) as progress:
            local = api.local_artifact(model, public_key=public_key, progress=progress)
        result = api.generate(
            local, prompts, sampling, load=load, kv=kv, chat=chat, stream=stream, speculate=speculation
        )
    ran = result.activations
    if json_out:
        print_json({**result.to_dict(), **_json_extra(model, load)})
    else:
        _write("\n")
        for i, text in enumerate(result.texts[1:], start=2):
            _write(f"\n--- prompt {i} ---\n{text}\n")
    _warn_activations(load.activations, ran, dense=dense)
    if not json_out:
        _print_stats(result, verified=not no_verify)


def _prompts(prompt: str | None, prompts_file: Path | None) -> list[str]:
    """PROMPT, then the lines of --prompts-file (unchecked: api.check_prompts checks them)."""
    prompts = [prompt] if prompt is not None else []
    if prompts_file is not None:
        prompts += read_prompts_file(prompts_file)
    return prompts


def _json_extra(model: str, load: support.LoadOptions) -> dict[str, object]:
    """What ``--json`` adds to the result: the artifact as named and how it was loaded."""
    return {
        "model": str(model),
        "verified": load.verify,
        "signature_checked": load.public_key is not None,
        "dense": load.dense_cache,
        "low_memory": load.low_memory,
        "activations": load.activations,
    }


def _warn_activations(asked: str, ran: str, *, dense: bool) -> None:
    """A warning line (stderr) when ``--activations int8`` was asked for and some linears ran float: only the
    native kernels of 3- and 4-bit LUT weights have the int8 form (not --dense, --low-memory, RTN or 8-bit)."""
    if asked != "int8" or ran == "int8":
        return
    why = "--dense caches float weights" if dense else "int8 runs only in the native kernels of 3/4-bit LUT weights"
    err_console.print(
        f"Warning: --activations int8 was asked for, but the linears ran activations {ran} ({why})",
        style="yellow",
        soft_wrap=True,
        markup=False,
    )


def _print_stats(result: support.GenerationResult, *, verified: bool) -> None:
    """The KV bytes line (when known) and the stats line, which stays the last line of stderr and ends with
    the path the weights ran (``weights: native-avx512 (210 linears)``)."""
    tps = f"{result.tokens_per_second:.1f} tok/s" if result.tokens_per_second is not None else "- tok/s"
    memory = f"peak CUDA {result.peak_cuda_bytes / MIB:.0f} MiB, " if result.peak_cuda_bytes is not None else ""
    if result.kv_bytes_per_token:
        err_console.print(
            kv_bytes_line(result.kv_bytes_per_token), style="dim", soft_wrap=True, markup=False, highlight=False
        )
    if result.speculation != "off":
        rate = result.spec_accepted_tokens / result.spec_draft_tokens if result.spec_draft_tokens else 0.0
        err_console.print(
            f"speculation {result.speculation}: {result.spec_accepted_tokens} of {result.spec_draft_tokens} draft "
            f"tokens accepted ({rate:.0%})",
            style="dim",
            soft_wrap=True,
            markup=False,
            highlight=False,
        )
    err_console.print(
        f"load {result.load_seconds:.2f} s ({'verified' if verified else 'NOT verified'}) | "
        f"first token {result.ttft_seconds:.3f} s | {tps} | {sum(result.new_tokens)} new tokens | "
        f"{memory}peak RSS {result.peak_rss_bytes / MIB:.0f} MiB | "
        f"KV cache {result.kv_cache} {result.kv_cache_bytes / MIB:.2f} MiB | "
        f"activations {result.activations} | weights: {result.weights_path}",
        style="dim",
        soft_wrap=True,
        markup=False,
        highlight=False,
    )
