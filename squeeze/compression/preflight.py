"""Checks that run before any expensive work: output directory, model architecture, size, free disk, memory.

Everything here is cheap: the model is built on the meta device from its config (no weights read), which
finds the target linears and gives an exact estimate of the artifact's size.
"""

from __future__ import annotations

import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from squeeze.calibrate.hessian import hessian_bytes_bound
from squeeze.compression.bit_budget import budget_bytes
from squeeze.compression.embeddings import embedding_names, embedding_targets
from squeeze.config import EMBEDDING_AUTO, Recipe
from squeeze.errors import ConfigError, ModelError, ResourceError
from squeeze.models.checkpoint_keys import check_checkpoint_keys
from squeeze.models.config_bounds import check_config_sizes
from squeeze.models.source import ModelSource
from squeeze.models.targets import Target, find_targets, linear_targets, target_shape
from squeeze.models.weight_dtype import KEEP_DTYPES
from squeeze.quant.schemes import format_for_recipe
from squeeze.quant.tuning import split_windows
from squeeze.system import available_memory_bytes

#: Head-room on top of the estimate: tokenizer files, config, manifest, filesystem slack.
DISK_MARGIN_BYTES = 64 * 2**20
DISK_MARGIN_FRACTION = 0.05


@dataclass(frozen=True)
class SizeEstimate:
    """What the artifact will weigh: quantized linears, everything else, and the total in bytes."""

    quantized_bytes: int
    other_bytes: int
    n_quantized_weights: int
    n_targets: int

    @property
    def total_bytes(self) -> int:
        return self.quantized_bytes + self.other_bytes


def check_context_length(model: nn.Module, seq_len: int, option: str = "--seq-len") -> None:
    """Refuse calibration windows longer than the model's context (``max_position_embeddings``)."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(limit, int) and not isinstance(limit, bool) and seq_len > limit:
        raise ConfigError(
            f"{option} {seq_len} exceeds the model's context of {limit} tokens", hint=f"use {option} {limit} or less"
        )


def meta_model(source: ModelSource) -> nn.Module:
    """The model's architecture on the meta device (no memory, no weights read), checked against the checkpoint.

    ModelError, before anything is built, for a config.json size out of bounds (squeeze.models.config_bounds:
    ``num_hidden_layers: 1e12`` would take minutes to build), and after, from the safetensors headers, for a
    checkpoint that lacks one of the architecture's weights or holds one it has no place for
    (squeeze.models.checkpoint_keys): transformers would initialise the first at random and drop the second.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    check_config_sizes(source)
    kwargs = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    try:
        config = AutoConfig.from_pretrained(
            str(source.directory), local_files_only=True, trust_remote_code=False, **kwargs
        )
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds for unsupported configs
        raise ModelError(
            f"cannot build the architecture of {source.model_id}: {type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}",
            hint="squeeze compresses causal LMs that transformers can load with AutoModelForCausalLM",
        ) from exc
    check_checkpoint_keys(model, source, config)
    return model


def estimate_size(
    model: nn.Module, recipe: Recipe, dtype_bytes: int = 4, *, targets: dict[str, Target] | None = None
) -> SizeEstimate:
    """Exact artifact tensor bytes for ``recipe`` applied to ``model`` (meta or real), sparse part included.

    ``targets``: the model's targets (linears and expert parameters, each as its (out, in) matrix) when the
    caller already found them (else found here).

    A ``target_bpw`` budget: the quantized bytes are the budget's, a bound (the plan never exceeds it; exact
    to the byte only where the plan spends every bit). With ``embedding_bits: auto`` the embeddings are in that
    budget (the plan keeps or quantizes them) and leave the other bytes.
    """
    weights = recipe.weights
    if targets is None:
        targets = find_targets(model, weights.targets, weights.ignore)
    fmt = format_for_recipe(weights)
    if fmt is None:  # a WeightsConfig is validated against the registry when it is built
        raise ValueError(f"no registered weight format for method {weights.method!r}")
    quantized = 0
    n_weights = 0
    target_params = set()
    for module in targets.values():
        out_f, in_f = target_shape(module)
        target_params.add(id(module.weight))
        n_weights += out_f * in_f
        quantized += fmt.estimate_bytes(out_f, in_f, weights, dtype_bytes)
    if weights.target_bpw is not None:  # a budget: at most target_bpw bits per weight (ConfigError out of reach)
        embeddings: dict[str, tuple[int, int]] = {}
        if weights.embedding_bits == EMBEDDING_AUTO:  # the embeddings are planned too: counted in the budget
            for name, table in embedding_targets(model, embedding_names(model, recipe, targets)).items():
                target_params.add(id(table.weight))
                embeddings[name] = (int(table.weight.shape[0]), int(table.weight.shape[1]))
        shapes = {n: target_shape(m) for n, m in targets.items()}
        quantized = budget_bytes(shapes, weights, dtype_bytes, embeddings, _kept_bytes(model, recipe, dtype_bytes))
    seen: set[int] = set()
    other = 0
    for param in list(model.parameters()) + list(model.buffers()):
        if id(param) in target_params or id(param) in seen:
            continue
        seen.add(id(param))
        other += param.numel() * dtype_bytes
    return SizeEstimate(quantized, other, n_weights, len(targets))


def _kept_bytes(model: nn.Module, recipe: Recipe, default: int) -> int:
    """Bytes per weight of a tensor left unquantized: ``output.keep_dtype``'s, or the dtype the model's config
    names for ``source``; ``default`` when it names none (a GGUF source's is decided when it is read)."""
    choice = recipe.output.keep_dtype
    if choice != "source":
        return KEEP_DTYPES[choice].itemsize
    config = getattr(model, "config", None)
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype.itemsize if isinstance(dtype, torch.dtype) and dtype.is_floating_point else default


def free_disk_bytes(path: Path) -> int:
    """Free bytes on the filesystem that will hold ``path`` (its nearest existing ancestor)."""
    probe = path.resolve()
    while not probe.exists():
        probe = probe.parent
    return shutil.disk_usage(probe).free


def check_disk(output: Path, estimate: SizeEstimate, extra_bytes: int = 0, force: bool = False) -> int:
    """Raise ResourceError (unless ``force``) if the artifact plus ``extra_bytes`` will not fit.

    Returns the bytes needed.

    ``extra_bytes``: what else the run still has to write next to the artifact (checkpoints).
    """
    needed = int(estimate.total_bytes * (1 + DISK_MARGIN_FRACTION)) + DISK_MARGIN_BYTES + max(extra_bytes, 0)
    free = free_disk_bytes(output)
    if free < needed and not force:
        raise ResourceError(
            f"not enough free disk for {output}: the artifact and its checkpoints need about {needed / 1e9:.2f} GB, "
            f"{free / 1e9:.2f} GB are free",
            hint="free some space, choose an --output on another filesystem, or pass --force to try anyway",
        )
    return needed


#: Python, torch and transformers themselves, before any tensor is allocated.
BASE_PROCESS_BYTES = 600 * 2**20


def estimate_peak_memory(
    model: nn.Module, recipe: Recipe, calibration_seq_len: int | None, *, targets: dict[str, Target] | None = None
) -> int:
    """Rough peak resident bytes of a compress run of ``model`` (meta) with ``recipe``; None seq_len: no Fisher.
    ``targets``: the model's target linears when the caller already found them (else found here).

    fp32 weights stay loaded throughout; loading briefly holds a second copy (GGUF dequantization, state
    dict); Fisher adds one fp32 accumulator per target weight plus one window's activations (logits,
    their gradient and the saved activations of every layer); error compensation adds the input Hessians.
    """
    seen: set[int] = set()
    params = 0
    for tensor in list(model.parameters()) + list(model.buffers()):
        if id(tensor) not in seen:
            seen.add(id(tensor))
            params += tensor.numel() * 4
    if targets is None:
        targets = find_targets(model, recipe.weights.targets, recipe.weights.ignore)
    largest = max((m.weight.numel() for m in targets.values()), default=0) * 4
    working = largest * 8  # k-means / sparse selection scratch on one layer
    if calibration_seq_len is not None:
        config = getattr(model, "config", None)
        vocab = int(getattr(config, "vocab_size", 0) or 0)
        hidden = int(getattr(config, "hidden_size", 0) or 0)
        inter = int(getattr(config, "intermediate_size", 0) or 4 * hidden)
        layers = int(getattr(config, "num_hidden_layers", 0) or 0)
        # float64 accumulators during the pass (so that a torchrun split sums to the same bits), fp32 after
        fisher = sum(m.weight.numel() for m in targets.values()) * 8
        if getattr(recipe.weights, "error_compensation", False):  # the input Hessians live beside the Fisher
            fisher += hessian_bytes_bound(linear_targets(targets))
        activations = calibration_seq_len * 4 * (3 * vocab + layers * (12 * hidden + 4 * inter))
        working = max(working, fisher + activations)
        if (distill := getattr(recipe.weights, "distill", None)) is not None:
            held = _distill_held_out(distill.tokens // calibration_seq_len, distill.generated_samples)
            working = max(working, _distill_bytes(targets, calibration_seq_len, vocab, activations, held))
    return BASE_PROCESS_BYTES + params + max(params, working)


def _distill_held_out(text_windows: int, generated: int) -> int:
    """The windows weights.distill holds out at most: an eighth of the calibration windows it may use and of
    its sampled sequences, each source split as the stage splits it (squeeze.quant.tuning.split_windows)."""
    held = len(split_windows(max(1, text_windows))[1])
    return held + (len(split_windows(generated)[1]) if generated else 0)


def _distill_bytes(targets: dict[str, Target], seq_len: int, vocab: int, activations: int, held: int) -> int:
    """weights.distill (squeeze.compression.distill_stage) beside the loaded model: each quantized weight's int64
    code and its gathered float32 value kept for the backward, one window's activations twice (the teacher's
    forward and the student's), and the ``held`` held-out windows' cached target log-probabilities."""
    weights = sum(m.weight.numel() for m in targets.values())
    return weights * 12 + 2 * activations + held * seq_len * vocab * 4


def check_budget(needed: int, max_memory: int, force: bool = False) -> None:
    """``--max-memory``: refuse (ResourceError, unless ``force``) a budget below ``needed``, the estimated peak of
    a bounded run (one block plus its activations, the embedding and head, the process itself)."""
    if max_memory < needed and not force:
        raise ResourceError(
            f"--max-memory {_size(max_memory)} is below the minimum of {_size(needed)} for this model: one block "
            "plus its activations, the embedding and LM head, and the process itself",
            hint=f"pass --max-memory {_size(needed)} or more (shorter calibration windows lower it), or --force to "
            "try anyway",
        )


def _size(n: int) -> str:
    """A byte count as GB / MB / KB / B, never rounded up into a larger unit (``1B`` is not "1MB")."""
    if n >= 10**9:
        return f"{n / 1e9:.2f}GB"
    if n >= 10**6:
        return f"{round(n / 1e6)}MB"
    if n >= 10**3:
        return f"{round(n / 1e3)}KB"
    return f"{n}B"


def parse_device(spec: str | torch.device | None) -> torch.device | None:
    """``cpu``, ``cuda`` or ``cuda:N`` as a torch.device, by its spelling alone (a plan is made away from the
    GPUs); None for None. ConfigError for anything else."""
    if spec is None:
        return None
    text = str(spec).strip().lower()
    kind, colon, index = text.partition(":")
    if kind not in ("cpu", "cuda") or (colon and not index.isdigit()) or (kind == "cpu" and colon):
        raise ConfigError(
            f"--device {spec!r} is not a device squeeze compresses on: expected cpu, cuda or cuda:N",
            hint="pass --device cuda (the current GPU), --device cuda:1, or --device cpu",
        )
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", int(index)) if colon else torch.device("cuda")


def check_device(spec: str | torch.device | None) -> torch.device | None:
    """``--device``: ``cpu``, ``cuda`` or ``cuda:N`` as a torch.device (None: no device, the host run), checked
    against this machine before any work: ConfigError for another spelling, CUDA absent, or an index past the
    last GPU. ``cuda`` alone means the current CUDA device (index included in the result)."""
    parsed = parse_device(spec)
    if parsed is None or parsed.type == "cpu":
        return parsed
    text = str(spec).strip().lower()
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ConfigError(
            f"--device {text}: no CUDA GPU is available here (torch {torch.__version__}, "
            f"CUDA build {torch.version.cuda or 'none'})",
            hint="drop --device to compress on the CPU, or install a CUDA build of torch on a machine with a GPU",
        )
    number = parsed.index if parsed.index is not None else torch.cuda.current_device()
    if number >= count:
        raise ConfigError(
            f"--device {text}: this machine has {count} CUDA GPU(s), cuda:0 to cuda:{count - 1}",
            hint=f"pass --device cuda:N with N below {count}, or check CUDA_VISIBLE_DEVICES",
        )
    return torch.device("cuda", number)


def check_device_options(device: torch.device | None, *, error_compensation: bool, ranks: int) -> None:
    """Refuse (ConfigError) what ``--device`` does not run yet: error compensation (its input Hessians are
    taken by hooks on a whole-model pass, not block by block) and a torchrun world (one device per process
    is not dealt out yet)."""
    if device is None:
        return
    if error_compensation:
        raise ConfigError(
            f"--device {device} does not run error compensation recipes yet (their input Hessians need the "
            "whole-model pass)",
            hint="drop --device for this recipe, or choose a recipe without error compensation",
        )
    if ranks > 1:
        raise ConfigError(
            f"--device runs in one process, found a torchrun world of {ranks} ranks",
            hint="drop --device under torchrun, or run one process with --device",
        )


def check_memory(needed: int, force: bool = False) -> int | None:
    """Raise ResourceError (unless ``force``) when ``needed`` bytes exceed the available memory; returns it."""
    available = available_memory_bytes()
    if available is not None and needed > available and not force:
        raise ResourceError(
            f"not enough memory: compressing this model needs about {needed / 1e9:.2f} GB at its peak, "
            f"{available / 1e9:.2f} GB are available",
            hint="close other programs, use a machine with more memory, lower --seq-len, or pass --force to try anyway",
        )
    return available


__all__ = [
    "SizeEstimate",
    "check_context_length",
    "meta_model",
    "estimate_size",
    "free_disk_bytes",
    "check_disk",
    "estimate_peak_memory",
    "available_memory_bytes",
    "check_memory",
    "check_budget",
    "check_device",
    "check_device_options",
    "parse_device",
]
