"""A serving engine over a tiny random Llama (no artifact, no compression): what the structured-output and tool
tests drive, in the engine and through the HTTP app."""

from __future__ import annotations

from typing import Any

import torch

from squeeze.serve.engine.engine import Engine
from squeeze.serve.types import EngineConfig
from tests.conftest import build_tiny_tokenizer, tiny_llama_config


def tiny_model(text: str, chat_template: str | None = None) -> tuple[Any, Any]:
    """A tiny random Llama (seeded) and its own tokenizer (``chat_template`` replacing the tiny one). Every width
    is a multiple of 32, so that a row's logits do not depend on the rest of the batch (see the wide32_artifact
    fixture): an unconstrained request's tokens can be compared bit for bit beside constrained ones."""
    from transformers import LlamaForCausalLM

    tokenizer = build_tiny_tokenizer(text)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    torch.manual_seed(0)
    return LlamaForCausalLM(
        tiny_llama_config(tokenizer, intermediate_size=128, max_position_embeddings=1024)
    ).eval(), tokenizer


def make_engine(model_and_tokenizer: tuple[Any, Any], **options: Any) -> Engine:
    """An engine over the model (16-bit KV; 2 MiB of it unless ``kv_memory_bytes`` says otherwise), named "tiny"."""
    model, tokenizer = model_and_tokenizer
    options.setdefault("kv_memory_bytes", 2 << 20)
    return Engine(model, tokenizer, EngineConfig(**options), None, model_name="tiny")
