"""The tune stage of compress (``weights.tuning``): each decoder block's LUT values and norm gains tuned
after quantization, block by block, resumable per block.

Two streams of hidden states walk the blocks side by side over the calibration windows: the original
model's (block i's output is the target of block i's tuning) and the compressed model's (block i's input
comes from the already-quantized and tuned blocks above it). For each block: the original block gives the
targets; the block's quantized weights are read from their group checkpoint, tuned (squeeze.quant.tuning),
rounded as the artifact stores them (LUTs by their format, norm gains to the artifact's dtype) and committed
to the work area (``tuned/NNNNN.safetensors``); the committed values then carry the compressed stream to the
next block. A rerun after a kill recomputes both streams through the committed blocks and tunes from the
first block without a commit, so it writes the same bytes. Only one block (and its copy being tuned) is
resident: under ``--max-memory`` the block's weights are read from the source for its turn and the hidden
states are spilled to the work area.

The write stage replaces the group checkpoints' tensors (and the norm gains) by ``job.tuned``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import shutil
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from squeeze.calibrate.block_walk import Store, model_parts, prologue
from squeeze.calibrate.windows import calibration_windows
from squeeze.compression.job import CompressJob, timed
from squeeze.config import TuningConfig
from squeeze.errors import ConfigError
from squeeze.models.modes import eval_mode
from squeeze.models.source import keep_dtype, load_tokenizer
from squeeze.quant.packing import pack_codes
from squeeze.quant.schemes import WeightFormat, format_for_module, stored_roles
from squeeze.quant.tuning import LevelsLinear, Outcome, TuningDivergedWarning, norm_gains, tune_block

#: What a block's tuning stores: the tuned weights' tensors and norm gains by artifact name, and its record.
Tuned = tuple[dict[str, torch.Tensor], dict[str, Any]]


def tune_stage(job: CompressJob) -> None:
    """Tune every block whose tuning is not committed yet; then ``job.tuned`` holds every block's result."""
    tuning = job.recipe.weights.tuning
    if tuning is None or job.calibration is None:
        return
    net = job.loaded_model()
    _embed, blocks, _norm, _head = model_parts(net)
    plan = block_groups(job, blocks)
    with timed(job.timings, "checkpoint"):
        missing = [g for _b, g in plan if not job.work.has_tuned(g, job.groups[g])]
    if missing:
        _tune_blocks(job, net, blocks, plan, tuning, last=max(b for b, g in plan if g in missing))
    job.tuned = {}
    records: dict[int, dict[str, Any]] = {}
    for _b, g in plan:
        tensors, meta = _committed(job, g)
        job.tuned.update(tensors)
        records[g] = meta
    _warn_refused(job, records)


def block_groups(job: CompressJob, blocks: nn.ModuleList, option: str = "weights.tuning") -> list[tuple[int, int]]:
    """(block index, layer group index) of every block with quantized targets, in model order; ConfigError
    for a target ``option`` (tuning, distillation) cannot rebuild (a MoE expert parameter)."""
    block_of = {id(m): i for i, block in enumerate(blocks) for m in block.modules()}
    plan: list[tuple[int, int]] = []
    for g, names in enumerate(job.groups):
        owners = {block_of.get(id(job.targets[n]), -1) for n in names if n in job.targets}
        if not owners or -1 in owners:
            continue  # an embedding's group: not in a block, not tuned
        for name in names:
            if not isinstance(job.targets[name], nn.Linear):
                raise ConfigError(
                    f"{option} trains linears, and {name} is a MoE expert parameter",
                    hint=f"remove {option} for this model",
                )
        plan.append((owners.pop(), g))
    return plan


def _tune_blocks(
    job: CompressJob,
    net: nn.Module,
    blocks: nn.ModuleList,
    plan: list[tuple[int, int]],
    tuning: TuningConfig,
    last: int,
) -> None:
    """Walk the two streams from block 0 to block ``last``, tuning and committing each block not committed."""
    assert job.calibration is not None
    windows = calibration_windows(job.calibration, job.tokenizer or load_tokenizer(job.source))
    windows = windows[: max(1, min(len(windows), tuning.tokens // windows.shape[1]))]
    materialize = job.lazy.materialized if job.lazy is not None else resident
    spill = job.work.root / "tuning-activations" if job.max_memory is not None else None
    group_of = dict(plan)
    kept = keep_dtype(job.source, job.recipe.output.keep_dtype)
    n = len(windows)
    try:
        store = Store(spill)
        with torch.inference_mode(False), eval_mode(net), no_grad_flags(net):
            embed, _blocks, norm, _head = model_parts(net)
            kwargs = prologue(net, windows, embed, blocks, norm, materialize, store, False)
            for w in range(n):
                store.put(f"q0-{w}", store.get(f"h0-{w}"))
            for i in range(last + 1):
                with materialize(blocks[i]):
                    _step_block(job, i, blocks[i], group_of.get(i), store, kwargs[i], n, tuning, kept)
                kwargs[i] = []
                if job.progress:
                    job.progress("tune", i + 1, last + 1)
    finally:
        if spill is not None:
            shutil.rmtree(spill, ignore_errors=True)


def _step_block(
    job: CompressJob,
    i: int,
    block: nn.Module,
    group: int | None,
    store: Store,
    kwargs: list[dict[str, Any]],
    n: int,
    tuning: TuningConfig,
    kept: torch.dtype,
) -> None:
    """Block ``i``: its targets (original stream), its tuning (committed unless it was), the compressed stream
    carried through the committed values. Stream keys: ``h{i}-{w}`` original, ``q{i}-{w}`` compressed."""
    with torch.no_grad():
        for w in range(n):
            store.put(f"h{i + 1}-{w}", _out(block(store.take(f"h{i}-{w}"), **kwargs[w])))
    if group is None:  # a block without quantized targets: the compressed stream goes through it unchanged
        quantized: nn.Module = block
    else:
        names = job.groups[group]
        with timed(job.timings, "checkpoint"):
            done = job.work.has_tuned(group, names)
        if not done:
            tensors, meta = _tune_one(job, block, group, store, kwargs, i, n, tuning, kept)
            with timed(job.timings, "checkpoint"):
                job.work.save_tuned(group, tensors, meta)
        tensors, _meta = _committed(job, group)
        quantized, _levels = rebuilt_block(job, block, tuned_weights(job, group, tensors), tensors)
    with torch.no_grad():
        for w in range(n):
            store.put(f"q{i + 1}-{w}", _out(quantized(store.take(f"q{i}-{w}"), **kwargs[w])))


def _tune_one(
    job: CompressJob,
    block: nn.Module,
    group: int,
    store: Store,
    kwargs: list[dict[str, Any]],
    i: int,
    n: int,
    tuning: TuningConfig,
    kept: torch.dtype,
) -> Tuned:
    """Block ``i`` (group ``group``) tuned from its quantized weights: the tensors to store and the record."""
    names = job.groups[group]
    weights = quantized_weights(job, group)
    candidate, levels = _levels_block(job, block, weights)
    gains = norm_gains(candidate, levels)
    params = [m.levels for m in levels.values()] + list(gains.values())
    for p in params:
        p.requires_grad_(True)
    with torch.enable_grad():
        outcome = tune_block(
            candidate,
            params,
            inputs=lambda w: store.get(f"q{i}-{w}"),
            targets=lambda w: store.get(f"h{i + 1}-{w}"),
            kwargs=lambda w: kwargs[w],
            n_windows=n,
            options=tuning,
            seed=tuning.seed * 1_000_003 + i,
            movers=list(levels.values()),
        )
    meta: dict[str, Any] = {"modules": names, **_record(outcome)}
    if outcome.status != "tuned":
        return {}, meta
    tensors: dict[str, torch.Tensor] = {}
    for name, module in levels.items():
        weight = weights[name]
        if tuning.code_moves:  # the codes may have moved (weights.tuning.code_moves): store the tuned ones
            codes = module.codes.detach().to(device="cpu", dtype=torch.uint8)
            weight = dataclasses.replace(weight, packed=pack_codes(codes, weight.bits))
        tensors.update(weight.with_levels(module.levels.detach().cpu()).to_tensors(name))
    prefix = block_prefix(job, block)
    for rel, gain in gains.items():
        tensors[f"{prefix}.{rel}"] = gain.detach().to(kept).cpu()
    return tensors, meta


def _record(outcome: Outcome) -> dict[str, Any]:
    return {
        "status": outcome.status,
        "initial_loss": outcome.initial_loss,
        "best_loss": outcome.best_loss,
        "steps": outcome.steps,
    }


def quantized_weights(job: CompressJob, group: int) -> dict[str, WeightFormat]:
    """Group ``group``'s quantized weights, rebuilt by their registered formats from its checkpoint."""
    names = job.groups[group]
    with timed(job.timings, "checkpoint"):
        found = job.work.load_group(group, names)
    if found is None:
        from squeeze.errors import ResumeError

        raise ResumeError(
            f"layer group checkpoint {job.work.group_path(group)} is missing or unreadable",
            hint="rerun the same command: the group is quantized again",
        )
    tensors, meta = found
    weights: dict[str, WeightFormat] = {}
    for name in names:
        spec = meta["specs"][name]
        dtypes = {role: t.dtype for role in stored_roles() if (t := tensors.get(f"{name}.{role}")) is not None}
        cls = format_for_module(spec.get("method"), dtypes)
        assert cls is not None, f"{name}: a format this squeeze wrote"
        weights[name] = cls.from_spec(tensors, name, spec)
    return weights


def _levels_block(
    job: CompressJob, block: nn.Module, weights: dict[str, WeightFormat], *, originals: bool = True
) -> tuple[nn.Module, dict[str, LevelsLinear]]:
    """A copy of ``block`` whose quantized linears are LevelsLinear modules (a format without levels: its
    dequantized weight, fixed); returns it and its LevelsLinear modules by target name. ``originals``: each
    LevelsLinear keeps its original weight (what moved codes are nearest to; 4 bytes a weight)."""
    candidate = copy.deepcopy(block)
    for p in candidate.parameters():
        p.requires_grad_(False)
    prefix = block_prefix(job, block)
    device = next(iter(block.parameters())).device
    levels: dict[str, LevelsLinear] = {}
    for name, weight in weights.items():
        rel = name.removeprefix(prefix + ".")
        original = candidate.get_submodule(rel)
        bias = getattr(original, "bias", None)
        if weight.tunable:
            # the original weight (the block is the source model's): what moved codes are nearest to
            kept = getattr(original, "weight", None) if originals else None
            module: nn.Module = LevelsLinear(weight, bias, device, original=kept)
            levels[name] = module  # type: ignore[assignment]
        else:
            assert isinstance(original, nn.Linear)
            module = original
            module.weight.data = weight.dequantize().to(device)
        parent, _, attr = rel.rpartition(".")
        setattr(candidate.get_submodule(parent) if parent else candidate, attr, module)
    return candidate, levels


def tuned_weights(job: CompressJob, group: int, tensors: dict[str, torch.Tensor]) -> dict[str, WeightFormat]:
    """Group ``group``'s quantized weights with the tuned tensors in ``tensors`` (a block's committed ones, or
    every block's: names select) replacing theirs."""
    weights = quantized_weights(job, group)
    for name in list(weights):
        if f"{name}.weight_packed" in tensors:
            spec = weights[name].module_spec()
            merged = {
                **weights[name].to_tensors(name),
                **{k: v for k, v in tensors.items() if k.startswith(name + ".")},
            }
            weights[name] = type(weights[name]).from_spec(merged, name, spec)
    return weights


def rebuilt_block(
    job: CompressJob, block: nn.Module, weights: dict[str, WeightFormat], tensors: dict[str, torch.Tensor]
) -> tuple[nn.Module, dict[str, LevelsLinear]]:
    """``block`` as the artifact will hold it, and its LevelsLinear modules by target name: ``weights`` (its
    group's, as :func:`tuned_weights` gives them) in place of its linears, the tuned norm gains of ``tensors``
    (a block's committed ones, or every block's: names select) in place of its gains (a refused or unchanged
    block: as quantized)."""
    candidate, levels = _levels_block(job, block, weights, originals=False)
    prefix = block_prefix(job, block)
    with torch.no_grad():
        for rel, gain in norm_gains(candidate, {}).items():
            stored = tensors.get(f"{prefix}.{rel}")
            if stored is not None:
                gain.copy_(stored.to(gain.dtype))
    return candidate, levels


def _committed(job: CompressJob, group: int) -> Tuned:
    with timed(job.timings, "checkpoint"):
        found = job.work.load_tuned(group, job.groups[group])
    if found is None:
        from squeeze.errors import ResumeError

        raise ResumeError(
            f"the tuning checkpoint of layer group {group} in {job.work.root} is missing or unreadable",
            hint="rerun the same command: the block is tuned again",
        )
    return found


def block_prefix(job: CompressJob, block: nn.Module) -> str:
    for name, module in job.loaded_model().named_modules():
        if module is block:
            return name
    raise ValueError("the block is not in the model")  # pragma: no cover - blocks come from model_parts


def _warn_refused(job: CompressJob, records: dict[int, dict[str, Any]]) -> None:
    refused = [g for g, meta in records.items() if meta.get("status") == "refused"]
    if refused:
        warnings.warn(
            f"the tuning loss diverged in {len(refused)} block(s) (layer groups {refused}): they keep their "
            "quantized values; lower weights.tuning.lr to tune them",
            TuningDivergedWarning,
            stacklevel=2,
        )


def _out(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


def resident(*_modules: nn.Module) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


@contextlib.contextmanager
def no_grad_flags(net: nn.Module) -> Iterator[None]:
    """No parameter of the model requires grad while the stage runs (only a tuned copy's levels and gains do);
    every flag is restored afterwards."""
    flags = [(p, p.requires_grad) for p in net.parameters()]
    for p, _ in flags:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


__all__ = [
    "block_groups",
    "block_prefix",
    "no_grad_flags",
    "quantized_weights",
    "rebuilt_block",
    "resident",
    "tune_stage",
    "tuned_weights",
]
