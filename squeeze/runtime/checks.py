"""Generation options, checked before anything expensive runs: the prompts, sampling, the device, the context.

Each raises ConfigError (a usage error, exit code 2) with a hint naming the CLI flag that fixes it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from squeeze.errors import ConfigError


class Prompts(list[str]):
    """Prompts that :func:`check_prompts` checked: passed on as they are, not checked again."""


def check_prompts(prompts: str | Sequence[str]) -> Prompts:
    """The prompts as a list; ConfigError for no prompt or an empty (or whitespace-only) one. Prompts it
    returned before come back as they are."""
    if isinstance(prompts, Prompts):
        return prompts
    return Prompts(_checked_prompts([prompts] if isinstance(prompts, str) else list(prompts)))


def _checked_prompts(prompts: list[str]) -> list[str]:
    if not prompts:
        raise ConfigError("no prompt given", hint="pass a PROMPT, or --prompts-file with one prompt per line")
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, str) or not prompt.strip():
            where = "the prompt" if len(prompts) == 1 else f"prompt {i + 1} of {len(prompts)}"
            raise ConfigError(f"{where} is empty; expected some text to continue", hint="pass a non-empty prompt")
    return prompts


def resolve_device(name: str) -> torch.device:
    """``cpu``, ``cuda`` or ``cuda:N`` as a torch.device; ConfigError when it is unknown or unavailable."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"unknown device {name!r}; expected cpu, cuda or cuda:N", hint="--device cpu") from exc
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ConfigError(f"device {name!r} is not supported; expected cpu, cuda or cuda:N", hint="--device cpu")
    if not torch.cuda.is_available():
        raise ConfigError(
            f"device {name!r} requested, but torch.cuda.is_available() is False on this machine",
            hint="use --device cpu, or install a CUDA build of torch on a machine with a GPU",
        )
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(
            f"device {name!r} requested, but only {torch.cuda.device_count()} CUDA device(s) exist",
            hint="--device cuda:0",
        )
    return device


def check_context(prompt_tokens: Sequence[int], max_new_tokens: int, context: int) -> None:
    """Refuse (ConfigError) prompts that leave no room for ``max_new_tokens`` in a ``context``-token model.

    ``prompt_tokens``: each prompt's token count (a batch is padded to the longest). A prompt that alone
    fills the context is too long whatever ``--max-new-tokens`` is, so the hint says to shorten it; only
    when at least one new token fits does the hint suggest a smaller ``--max-new-tokens``.
    """
    longest = max(prompt_tokens)
    if longest + max_new_tokens <= context:
        return
    which = (
        f"prompt {prompt_tokens.index(longest) + 1} of {len(prompt_tokens)}" if len(prompt_tokens) > 1 else "the prompt"
    )
    if longest >= context:  # no --max-new-tokens helps: not even one new token fits
        room = context - max_new_tokens
        raise ConfigError(
            f"{which} is too long: it has {longest} tokens, and the model's context is {context} tokens for the "
            "prompt and the new tokens together",
            hint=(
                f"shorten {which} to at most {room} tokens for --max-new-tokens {max_new_tokens}"
                if room >= 1
                else f"shorten {which} and lower --max-new-tokens so that together they fit in {context} tokens"
            ),
        )
    raise ConfigError(
        f"{which} ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's context of "
        f"{context} tokens",
        hint=f"use --max-new-tokens {context - longest} or less, or shorten {which}",
    )


__all__ = ["Prompts", "check_prompts", "resolve_device", "check_context"]
