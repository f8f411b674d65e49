"""The distill stage of compress (``weights.distill``): the LUT values and norm gains of the whole compressed
model trained end to end against the original model's next-token distribution, after quantization and after
the block-wise tune stage (squeeze.quant.distill has the math).

The student is the loaded model with every decoder block rebuilt from its layer group's checkpoint and the
tune stage's results (each quantized linear a LevelsLinear: its row's levels gathered by its codes); it shares
the embedding and the LM head with the original (both frozen) and holds its own norm gains. The training
windows are the calibration windows (at most ``tokens`` of them) and ``generated_samples`` sequences the
original model samples itself (committed to the work area, so a rerun trains on the same tokens); an eighth
of each source is held out for the early stop. The loop's state is committed after every held-out score, so
a run killed mid-stage resumes from its last score with the same window order and Adam moments; the result
(tensors rounded as the artifact stores them) is committed once and joins ``job.tuned``, which the write
stage uses in place of the quantized tensors. The whole model is resident and the stage runs on the host:
``--max-memory`` refuses a recipe with ``weights.distill`` in preflight.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from typing import Any

import torch
from torch import nn

from squeeze.calibrate.block_walk import model_parts
from squeeze.calibrate.generated import sample_windows_from_model, start_token
from squeeze.calibrate.windows import calibration_windows
from squeeze.compression.job import CompressJob, timed
from squeeze.compression.tuning_stage import block_groups, no_grad_flags, rebuilt_block, tuned_weights
from squeeze.config import DistillConfig
from squeeze.models.modes import eval_mode
from squeeze.models.source import keep_dtype, load_tokenizer
from squeeze.quant.distill import DistillState, distill, log_probs
from squeeze.quant.schemes import WeightFormat
from squeeze.quant.tuning import LevelsLinear, TuningDivergedWarning, norm_gains, split_windows


def distill_stage(job: CompressJob) -> None:
    """Distil unless the result is committed; then ``job.tuned`` holds it and ``job.distill`` its record."""
    config = job.recipe.weights.distill
    if config is None or job.calibration is None:
        return
    net = job.loaded_model()
    _embed, blocks, _norm, _head = model_parts(net)
    plan = block_groups(job, blocks, option="weights.distill")
    covered = sorted(name for _b, g in plan for name in job.groups[g])
    with timed(job.timings, "checkpoint"):
        found = job.work.load_distill("result", covered)
    if found is None:
        tensors, meta = _distil(job, net, plan, config, covered)
        with timed(job.timings, "checkpoint"):
            job.work.save_distill("result", tensors, meta)
    else:
        tensors, meta = found
    job.tuned.update(tensors)
    job.distill = {k: v for k, v in meta.items() if k != "modules"}
    if meta.get("status") == "refused":
        warnings.warn(
            "the distillation loss diverged: the model keeps its quantized (and tuned) values; lower "
            "weights.distill.lr to distil it",
            TuningDivergedWarning,
            stacklevel=2,
        )


def _distil(
    job: CompressJob, net: nn.Module, plan: list[tuple[int, int]], config: DistillConfig, covered: list[str]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Train the student; the tensors replacing the artifact's (none unless it beat the start) and the record."""
    assert job.calibration is not None
    tokenizer = job.tokenizer or load_tokenizer(job.source)
    text = calibration_windows(job.calibration, tokenizer)
    seq_len = text.shape[1]
    text = text[: max(1, min(len(text), config.tokens // seq_len))]
    generated = _generated(job, net, config, seq_len, tokenizer)
    ids = torch.cat([text, generated])
    train, held = split_windows(len(text))
    if len(generated):
        extra_train, extra_held = split_windows(len(generated))
        train += [len(text) + w for w in extra_train]
        held += [len(text) + w for w in extra_held]
    with torch.inference_mode(False), eval_mode(net), no_grad_flags(net):
        student, weights, levels, gains = _student(job, net, plan)
        params = [m.levels for m in levels.values()] + list(gains.values())
        for p in params:
            p.requires_grad_(True)
        progress = job.progress
        with torch.enable_grad():
            outcome = distill(
                lambda x: student(input_ids=x, use_cache=False).logits,
                params,
                windows=lambda w: ids[w : w + 1],
                teacher=lambda x: log_probs(net(input_ids=x, use_cache=False).logits),
                train=train,
                held=held,
                options=config,
                seed=config.seed,
                state=_resumed(job, params, covered),
                checkpoint=lambda state: _save_state(job, state, covered),
                progress=(lambda done, total: progress("distill", done, total)) if progress else None,
            )
    meta: dict[str, Any] = {
        "modules": covered,
        **dataclasses.asdict(outcome),  # status, initial_loss, best_loss, steps
        "windows": len(text),
        "generated": len(generated),
        "held_out": len(held),
    }
    if outcome.status != "distilled":
        return {}, meta
    return _tensors(job, weights, levels, gains), meta


def _student(
    job: CompressJob, net: nn.Module, plan: list[tuple[int, int]]
) -> tuple[nn.Module, dict[str, WeightFormat], dict[str, LevelsLinear], dict[str, nn.Parameter]]:
    """The compressed model to train; the quantized (and tuned) weights it was built from and its LevelsLinear
    modules, both by target name; its norm gains by artifact name. Parameters outside the norm gains are
    shared with ``net`` (deepcopy's memo), so only the gains and the rebuilt blocks take new memory."""
    gains = norm_gains(net, {})
    shared = {id(p): p for name, p in net.named_parameters() if name not in gains}
    student = copy.deepcopy(net, memo=dict(shared))
    _embed, originals, _norm, _head = model_parts(net)
    _embed, blocks, _norm, _head = model_parts(student)
    weights: dict[str, WeightFormat] = {}
    levels: dict[str, LevelsLinear] = {}
    for b, g in plan:
        group = tuned_weights(job, g, job.tuned)
        candidate, found = rebuilt_block(job, originals[b], group, job.tuned)
        blocks[b] = candidate
        weights.update(group)
        levels.update(found)
    for p in student.parameters():
        p.requires_grad_(False)
    student.eval()
    return student, weights, levels, norm_gains(student, levels)


def _tensors(
    job: CompressJob,
    weights: dict[str, WeightFormat],
    levels: dict[str, LevelsLinear],
    gains: dict[str, nn.Parameter],
) -> dict[str, torch.Tensor]:
    """The trained values as the artifact stores them: each LUT by its format (``weights``, the student's
    starting weights), norm gains in the kept dtype."""
    tensors: dict[str, torch.Tensor] = {}
    for name, module in levels.items():
        tensors.update(weights[name].with_levels(module.levels.detach().cpu()).to_tensors(name))
    kept = keep_dtype(job.source, job.recipe.output.keep_dtype)
    for name, gain in gains.items():
        tensors[name] = gain.detach().to(kept).cpu()
    return tensors


def _generated(job: CompressJob, net: nn.Module, config: DistillConfig, seq_len: int, tokenizer: Any) -> torch.Tensor:
    """int64 (generated_samples, seq_len): the original model's own samples, committed once and read back."""
    if not config.generated_samples:
        return torch.empty(0, seq_len, dtype=torch.int64)
    seed = job.seed * 1_000_003 + config.seed
    key = [f"generated:{config.generated_samples}x{seq_len}:seed{seed}"]
    with timed(job.timings, "checkpoint"):
        found = job.work.load_distill("generated", key)
    if found is not None:
        return found[0]["ids"]
    progress = job.progress
    with timed(job.timings, "generate"):
        ids = sample_windows_from_model(
            net,
            config.generated_samples,
            seq_len,
            start=start_token(tokenizer),
            seed=seed,
            progress=(lambda done, total: progress("generate", done, total)) if progress else None,
        )
    with timed(job.timings, "checkpoint"):
        job.work.save_distill("generated", {"ids": ids}, {"modules": key})
    return ids


_PARTS = ("initial", "params", "best", "exp_avg", "exp_avg_sq")


def _save_state(job: CompressJob, state: DistillState, covered: list[str]) -> None:
    tensors = {
        f"{part}.{i}": value.detach().cpu().clone() for part in _PARTS for i, value in enumerate(getattr(state, part))
    }
    meta = {
        "modules": covered,
        "step": state.step,
        "initial_loss": state.initial_loss,
        "best_loss": state.best_loss,
        "stale": state.stale,
        "done": state.done,
    }
    with timed(job.timings, "checkpoint"):
        job.work.save_distill("state", tensors, meta)


def _resumed(job: CompressJob, params: list[nn.Parameter], covered: list[str]) -> DistillState | None:
    """The last committed state of this run's loop, or None (none yet, or one that does not fit ``params``)."""
    with timed(job.timings, "checkpoint"):
        found = job.work.load_distill("state", covered)
    if found is None:
        return None
    tensors, meta = found
    values: dict[str, list[torch.Tensor]] = {}
    for part in _PARTS:
        values[part] = [tensors.get(f"{part}.{i}", torch.empty(0)) for i in range(len(params))]
        if any(v.shape != p.shape for v, p in zip(values[part], params, strict=True)):
            return None  # another model's state: trained again from the start
    return DistillState(
        step=int(meta["step"]),
        initial_loss=float(meta["initial_loss"]),
        best_loss=float(meta["best_loss"]),
        stale=int(meta["stale"]),
        done=bool(meta["done"]),
        **values,
    )


__all__ = ["distill_stage"]
