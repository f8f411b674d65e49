"""Perplexity, paper protocol (GPTQ/SqueezeLLM), plus lm-eval-style word perplexity.

Protocol: tokenize the joined text once (no special tokens), cut non-overlapping windows of ``seq_len``
tokens from the start, drop the remainder, score each window independently (``seq_len - 1`` next-token
predictions), and report ``exp(mean NLL)`` over all predicted tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from squeeze.calibrate.windows import tokenize_text
from squeeze.errors import ConfigError
from squeeze.models.modes import cache_kwarg, eval_mode, input_device

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase
    from transformers.cache_utils import Cache

Progress = Callable[[int, int], None]
#: Makes a fresh KV cache (e.g. a SqueezeKVCache) for one batch of windows; None scores without a cache.
CacheFactory = Callable[[], "Cache"]

# Cross-entropy is computed over this many positions at a time, so the fp32 log-softmax workspace stays at
# (B, 256, V) instead of a second (B, T, V) tensor next to the logits (V = 49152 for SmolLM2).
_CE_CHUNK = 256


@dataclass(frozen=True)
class PerplexityResult:
    """Perplexity of a model on a text.

    ``perplexity = exp(nll)``, ``nll`` the mean per-token NLL (nats) over ``n_tokens`` predicted tokens
    (``n_windows * (seq_len - 1)``). ``word_perplexity = exp(total NLL / n_words)``, ``n_words`` the
    whitespace-separated words of the text the windows cover (NaN and 0 when no tokenizer was given).
    """

    perplexity: float
    word_perplexity: float
    nll: float
    n_windows: int
    n_tokens: int
    n_words: int
    seq_len: int


def perplexity(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    text: str,
    *,
    seq_len: int = 512,
    max_windows: int | None = None,
    batch_size: int = 1,
    progress: Progress | None = None,
    kv_cache: CacheFactory | None = None,
) -> PerplexityResult:
    """Perplexity of ``model`` on ``text`` with the paper protocol (see the module docstring).

    ``kv_cache``: score every window through a fresh cache from this factory (a quantized KV cache sees
    its error on every attention call, prefill included).
    """
    ids = tokenize_text(text, tokenizer)[None, :]  # (1, N)
    return perplexity_from_ids(
        model,
        ids,
        seq_len=seq_len,
        max_windows=max_windows,
        batch_size=batch_size,
        tokenizer=tokenizer,
        progress=progress,
        kv_cache=kv_cache,
    )


def perplexity_from_ids(
    model: nn.Module,
    ids: torch.Tensor,
    *,
    seq_len: int = 512,
    max_windows: int | None = None,
    batch_size: int = 1,
    tokenizer: PreTrainedTokenizerBase | None = None,
    progress: Progress | None = None,
    kv_cache: CacheFactory | None = None,
) -> PerplexityResult:
    """Perplexity on pre-tokenized int64 ``ids (1, N)`` (or ``(N,)``): tokenize once, score several models.

    ``tokenizer`` is only used to decode the covered tokens for the word count; without it
    ``word_perplexity`` is NaN and ``n_words`` 0.
    """
    windows = _cut_windows(ids, seq_len, max_windows)  # (n, T)
    if batch_size < 1:
        raise ConfigError(f"perplexity batch_size must be >= 1, found {batch_size}")
    _check_context_length(model, seq_len)
    n = windows.shape[0]
    device = input_device(model)
    total_nll = 0.0  # float64 sum over windows: fp32 loses digits over tens of thousands of tokens
    with torch.inference_mode(), eval_mode(model):
        for start in range(0, n, batch_size):
            batch = windows[start : start + batch_size].to(device)  # (B, T)
            total_nll += float(_sum_nll(model, batch, kv_cache))
            if progress is not None:
                progress(min(start + batch_size, n), n)
    n_tokens = n * (seq_len - 1)
    nll = total_nll / n_tokens
    n_words = 0
    word_ppl = float("nan")
    if tokenizer is not None:
        covered = windows.flatten().tolist()
        text = tokenizer.decode(covered, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        n_words = len(str(text).split())  # one sequence in, one string out
        word_ppl = _safe_exp(total_nll / n_words) if n_words else float("nan")
    return PerplexityResult(
        perplexity=_safe_exp(nll),
        word_perplexity=word_ppl,
        nll=nll,
        n_windows=n,
        n_tokens=n_tokens,
        n_words=n_words,
        seq_len=seq_len,
    )


def _cut_windows(ids: torch.Tensor, seq_len: int, max_windows: int | None) -> torch.Tensor:
    """Non-overlapping windows from the start of int64 ``ids``, remainder dropped: ``(n, seq_len)``."""
    if ids.ndim == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.ndim != 1:
        raise ConfigError(
            f"perplexity ids must have shape (1, N) or (N,), found {tuple(ids.shape)}",
            hint="tokenize the joined text once into one row",
        )
    if ids.dtype != torch.long:
        raise ConfigError(f"perplexity ids must be int64 token ids, found {ids.dtype}")
    if seq_len < 2:
        raise ConfigError(f"perplexity seq_len must be >= 2 (one prediction needs two tokens), found {seq_len}")
    if max_windows is not None and max_windows < 1:
        raise ConfigError(f"max_windows must be >= 1 or None, found {max_windows}")
    n = ids.numel() // seq_len
    if n == 0:
        raise ConfigError(
            f"evaluation text is too short: it has {ids.numel()} tokens, one window needs {seq_len}",
            hint="use a longer text or a smaller seq_len",
        )
    if max_windows is not None:
        n = min(n, max_windows)
    return ids[: n * seq_len].view(n, seq_len)


def _check_context_length(model: nn.Module, seq_len: int) -> None:
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(limit, int) and seq_len > limit:
        raise ConfigError(
            f"seq_len {seq_len} exceeds the model's context length {limit}", hint=f"use seq_len <= {limit}"
        )


def _sum_nll(model: nn.Module, ids: torch.Tensor, kv_cache: CacheFactory | None = None) -> torch.Tensor:
    """Summed next-token NLL (fp64 scalar) of int64 ``ids (B, T)``: ``B * (T - 1)`` predictions."""
    if kv_cache is None:
        logits = model(input_ids=ids, use_cache=False).logits  # (B, T, V)
    else:
        logits = model(input_ids=ids, use_cache=True, **{cache_kwarg(model): kv_cache()}).logits  # (B, T, V)
    t = ids.shape[1]
    total = torch.zeros((), dtype=torch.float64, device=logits.device)
    for s in range(0, t - 1, _CE_CHUNK):
        e = min(s + _CE_CHUNK, t - 1)
        chunk = logits[:, s:e].float()  # (B, c, V) fp32: log-softmax in fp32 even for bf16/fp16 models
        target = ids[:, s + 1 : e + 1].to(logits.device)  # (B, c): position p predicts token p + 1
        total += F.cross_entropy(chunk.flatten(0, 1), target.flatten(), reduction="sum").double()
    return total


def token_nlls(model: nn.Module, ids: torch.Tensor, kv_cache: CacheFactory | None = None) -> torch.Tensor:
    """Each next-token NLL of int64 ``ids (B, T)`` as :func:`perplexity` computes them (one forward pass,
    fp32 log-softmax): ``(B, T - 1)`` float32 on the CPU, entry ``p`` for token ``p + 1``."""
    return next_token_scores(model, ids, kv_cache)[0]


def next_token_scores(
    model: nn.Module, ids: torch.Tensor, kv_cache: CacheFactory | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`token_nlls` and, beside it, the model's greedy choice at each position (``(B, T - 1)`` int64):
    what a log-likelihood benchmark needs (lm-evaluation-harness's ``is_greedy``)."""
    with torch.inference_mode(), eval_mode(model):
        ids = ids.to(input_device(model))
        if kv_cache is None:
            logits = model(input_ids=ids, use_cache=False).logits  # (B, T, V)
        else:
            logits = model(input_ids=ids, use_cache=True, **{cache_kwarg(model): kv_cache()}).logits
        t = ids.shape[1]
        nlls, greedy = [], []
        for s in range(0, t - 1, _CE_CHUNK):
            e = min(s + _CE_CHUNK, t - 1)
            chunk = logits[:, s:e].float()  # (B, c, V)
            target = ids[:, s + 1 : e + 1].to(logits.device)
            nll = F.cross_entropy(chunk.flatten(0, 1), target.flatten(), reduction="none")
            nlls.append(nll.view(ids.shape[0], e - s).cpu())
            greedy.append(chunk.argmax(dim=-1).cpu())
        if not nlls:
            empty = torch.zeros((ids.shape[0], 0))
            return empty, empty.long()
        return torch.cat(nlls, dim=1), torch.cat(greedy, dim=1)


def _safe_exp(x: float) -> float:
    try:
        return math.exp(x)
    except OverflowError:
        return float("inf")


__all__ = ["PerplexityResult", "perplexity", "perplexity_from_ids", "token_nlls", "next_token_scores"]
