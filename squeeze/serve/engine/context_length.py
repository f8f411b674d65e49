"""How many tokens the serving engine lets a request's prompt and completion use (squeeze.serve.engine.engine)."""

from __future__ import annotations

from typing import Any

from squeeze.errors import ConfigError


def model_context(model_config: Any, max_model_len: int | None) -> int:
    """The context requests may use: ``max_model_len``, at most the model's (and its sliding window, which the
    engine's full-attention mask does not apply); ConfigError when it asks for more."""
    context = getattr(model_config, "max_position_embeddings", None)
    window = getattr(model_config, "sliding_window", None)
    if isinstance(window, int) and getattr(model_config, "use_sliding_window", True) is not False:
        context = min(context, window) if isinstance(context, int) else window
    if not isinstance(context, int):
        if max_model_len is None:
            raise ConfigError("the model's config gives no context length", hint="pass --max-model-len")
        return max_model_len
    if max_model_len is None:
        return context
    if max_model_len > context:
        raise ConfigError(
            f"--max-model-len {max_model_len} is more than the model's context of {context} tokens",
            hint=f"pass --max-model-len {context} or less",
        )
    return max_model_len


def check_block_size(block_size: int, context: int) -> None:
    """ConfigError when a KV block holds more tokens than a request may use (``context``): every sequence would
    take one block and leave most of it empty, and the pool's memory would go to slots nothing can fill."""
    if block_size > context:
        raise ConfigError(
            f"--block-size {block_size} is more than the context of {context} tokens a request may use",
            hint=f"pass --block-size 16 (the default), at most {context}",
        )


__all__ = ["check_block_size", "model_context"]
