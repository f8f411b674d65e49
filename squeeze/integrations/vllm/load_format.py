"""``load_format="squeeze"``: vLLM loads exactly the bytes squeeze hashed.

vLLM's default loader reads (memory-maps) the safetensors files itself, after the config verified them:
a file rewritten in between would not be caught. This loader instead reads every file of the artifact once
into memory while hashing it, checks the manifest, and hands vLLM tensors that are views of those bytes
(as :func:`squeeze.load` does), named as vLLM's model reads them (:func:`.artifact.checkpoint_renames`: an
artifact of a model whose modules transformers renames, Mixtral's, loads only this way). Memory: the
artifact's bytes, held while the weights load.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from typing import Any

import torch
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from squeeze.integrations.vllm.artifact import (
    artifact_directory,
    checkpoint_renames,
    renamed,
    verified_tensors,
    verify,
)

LOAD_FORMAT = "squeeze"


class SqueezeModelLoader(DefaultModelLoader):
    """vLLM's default loader, with the weights read through squeeze's verified path."""

    counter_before_loading_weights: float  # the base class's load timer (0.0 until loading starts)

    def get_all_weights(self, model_config: Any, model: torch.nn.Module) -> Generator[tuple[str, torch.Tensor]]:
        report = verify(artifact_directory(model_config.model), capture=True)
        if self.counter_before_loading_weights == 0.0:
            self.counter_before_loading_weights = time.perf_counter()
        renames = checkpoint_renames(getattr(model_config.hf_config, "model_type", None))
        for name, tensor in verified_tensors(report):
            yield renamed(name, renames), tensor

    def download_model(self, model_config: Any) -> None:
        artifact_directory(model_config.model)  # artifacts are local; nothing is downloaded


__all__ = ["SqueezeModelLoader", "LOAD_FORMAT"]
