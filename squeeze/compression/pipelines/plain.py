"""The plain compress mode: one process, the whole model loaded in fp32, every stage on it in turn."""

from __future__ import annotations

import torch
from torch import nn

from squeeze.compression.assemble import seal_stage, write_stage
from squeeze.compression.bit_plan import plan_stage
from squeeze.compression.distill_stage import distill_stage
from squeeze.compression.embeddings import embedding_targets
from squeeze.compression.job import CompressJob
from squeeze.compression.pipelines.registry import Pipeline, register
from squeeze.compression.publish import publish_stage
from squeeze.compression.quantize import quantize_stage
from squeeze.compression.sensitivity import calibrate_stage, sensitivity_stage
from squeeze.compression.tuning_stage import tune_stage
from squeeze.models.source import load_model
from squeeze.models.targets import Target, target_at


def load_stage(job: CompressJob) -> None:
    """The model in fp32 and its target linears (the ones preflight found on the meta-device build)."""
    job.model, job.tokenizer = load_model(job.source, dtype=torch.float32)
    job.targets = target_modules(job.model, job.target_names)
    job.embeddings = embedding_targets(job.model, job.embedding_names)


def target_modules(net: nn.Module, names: tuple[str, ...]) -> dict[str, Target]:
    """``names`` -> the targets of ``net`` (linears, expert parameters); the meta build and the loaded model
    share one architecture, so every name is found again."""
    return {name: target_at(net, name) for name in names}


PLAIN = register(
    Pipeline(
        "plain",
        (
            ("calibrate", calibrate_stage),
            ("load", load_stage),
            ("sensitivity", sensitivity_stage),
            ("plan", plan_stage),
            ("quantize", quantize_stage),
            ("tune", tune_stage),
            ("distill", distill_stage),
            ("write", write_stage),
            ("seal", seal_stage),
            ("publish", publish_stage),
        ),
    )
)

__all__ = ["PLAIN", "load_stage", "target_modules"]
