"""``squeeze run``'s token loop with speculative decoding (squeeze.runtime.speculation): the same tokens as
:func:`squeeze.runtime.decode.decode`, fewer forwards where drafts are accepted.

Each round: the drafter proposes d tokens per row after the newest chosen one (the n-gram index of the row's
tokens, or d greedy steps of the W4A8 path whose keys and values are cropped off again); one forward feeds
the newest token and the drafts, d + 1 positions per row, and returns the logits of every position. The
tokens are then chosen position by position exactly as plain decoding chooses them (the same warpers, the
same ``torch.multinomial`` call on the same generator, so greedy and seeded runs give the same tokens), for as
long as every unfinished row's choice equals its draft. The cache, mask and positions are cropped back to the
tokens kept.

The logits of a position do not depend on how many positions the forward fed: the quantized linears and the
LM head of an artifact are batch-invariant, the native attention kernel attends every query alone over its
own prefix, and on the SDPA path the verifying forward attends its queries one at a time
(:func:`verify_attention`) with the mask plain decoding gives a single query. A batch of rows keeps, each
round, the drafts every row accepted (the shortest run), so rows stay aligned as the left-padded batch needs.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from transformers import LogitsProcessorList

from squeeze.runtime.decode import DecodeOptions, DecodeState, TokensFn, choose_tokens, decode_step
from squeeze.runtime.fast_path import fast_forward
from squeeze.runtime.linear import drafting
from squeeze.runtime.speculation import NgramIndex, SpeculationOptions


@dataclass
class SpeculationCounts:
    """Draft positions a run verified, and those it kept (per round: every row's, so the batch's shortest run)."""

    drafted: int = 0
    accepted: int = 0


#: The attention implementation name of a verifying forward on the SDPA path.
VERIFY_ATTENTION = "squeeze_verify"


def verify_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' SDPA attention for ``query (B, Hq, T, D)`` over ``key`` / ``value (B, Hkv, L, D)``, one
    query at a time: query j sees keys ``0 .. L - T + j`` under row j of the mask, or no mask when that row lets
    every row see every key (as transformers gives one decoding query); (B, T, Hq, D)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    kwargs.pop("is_causal", None)
    new, length = query.shape[2], key.shape[2]
    outputs = []
    for j in range(new):
        stop = length - new + j + 1
        mask = None
        if attention_mask is not None:
            mask = attention_mask[:, :, j : j + 1, :stop]
            if mask.dtype == torch.bool and bool(mask.all()):
                mask = None
        out, _ = sdpa_attention_forward(
            module, query[:, :, j : j + 1], key[:, :, :stop], value[:, :, :stop], mask, **kwargs
        )
        outputs.append(out)
    return torch.cat(outputs, dim=1), None


@functools.cache
def _register_verify_attention() -> None:
    """Register :data:`VERIFY_ATTENTION` (:func:`verify_attention`, with SDPA's mask) in transformers' global
    attention registries: once per process, not on every verifying forward."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(VERIFY_ATTENTION, verify_attention)
    AttentionMaskInterface.register(VERIFY_ATTENTION, sdpa_mask)


@contextmanager
def _verifying(model: nn.Module) -> Iterator[None]:
    """Within: a model on transformers' SDPA attends through :func:`verify_attention` (other implementations,
    such as the native run's, already attend each query alone)."""
    config: Any = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa":
        yield
        return
    _register_verify_attention()
    config._attn_implementation = VERIFY_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"


def decode_speculative(
    model: nn.Module,
    state: DecodeState,
    options: DecodeOptions,
    speculation: SpeculationOptions,
    on_tokens: TokensFn | None = None,
    counts: SpeculationCounts | None = None,
) -> Tensor:
    """:func:`squeeze.runtime.decode.decode` with drafts: up to ``options.max_new_tokens`` tokens per row after
    prefill, (B, steps) int64; the same tokens. ``on_tokens`` sees each position's tokens, (B,) on the CPU.
    ``counts``: draft positions verified and kept are added to it."""
    processors = options.processors()
    start, limit = state.tokens.shape[1], options.max_new_tokens
    indexes = _ngram_indexes(state) if speculation.drafter == "ngram" else None
    produced, done = 0, False
    while not done:
        # the newest chosen token is the last of state.tokens, not fed yet; everything before it is in the cache
        if produced == 0:
            done, produced = _choose(state, options, processors, produced, on_tokens)
            _index(indexes, state, 1)
            continue
        chosen = state.tokens[:, -1]
        drafts = _propose(model, state, chosen, min(speculation.k, limit - produced - 1), indexes)
        if drafts.shape[1] == 0:
            decode_step(model, state, chosen)
            done, produced = _choose(state, options, processors, produced, on_tokens)
            _index(indexes, state, 1)
            continue
        logits = _verify(model, state, chosen, drafts)  # (B, 1 + d, V)
        kept = 0
        for i in range(drafts.shape[1] + 1):
            before = state.unfinished.bool()
            state.logits = logits[:, i]
            done, produced = _choose(state, options, processors, produced, on_tokens)
            mismatch = bool(((state.tokens[:, -1] != drafts[:, i]) & before).any()) if i < drafts.shape[1] else True
            if done or mismatch:
                break
            kept += 1
        _index(indexes, state, kept + 1)
        _crop(state, drafts.shape[1] - kept)  # the fed drafts after the kept ones
        if counts is not None:
            counts.drafted += drafts.shape[1]
            counts.accepted += kept
    return state.tokens[:, start:]


def _choose(
    state: DecodeState,
    options: DecodeOptions,
    processors: LogitsProcessorList,
    produced: int,
    on_tokens: TokensFn | None,
) -> tuple[bool, int]:
    """Choose every row's next token from ``state.logits`` as plain decoding does; (whether decoding is over,
    tokens produced so far)."""
    chosen = choose_tokens(state, options, processors)
    if on_tokens is not None:
        on_tokens(chosen.cpu())
    produced += 1
    return produced == options.max_new_tokens or not bool(state.unfinished.any()), produced


def _index(indexes: list[NgramIndex] | None, state: DecodeState, count: int) -> None:
    """Add each row's ``count`` newest tokens to its n-gram index."""
    if indexes is not None:
        for row, index in enumerate(indexes):
            index.extend(state.tokens[row, -count:].tolist())


def _ngram_indexes(state: DecodeState) -> list[NgramIndex]:
    """One n-gram index per row over its unpadded prompt."""
    indexes = []
    for row in range(state.tokens.shape[0]):
        index = NgramIndex()
        index.extend(state.tokens[row][state.attention_mask[row].bool()].tolist())
        indexes.append(index)
    return indexes


def _propose(
    model: nn.Module, state: DecodeState, chosen: Tensor, room: int, indexes: list[NgramIndex] | None
) -> Tensor:
    """(B, d) int64 drafts after ``chosen (B,)``, d <= ``room`` (0 columns: nothing to verify this round)."""
    if room <= 0:
        return torch.empty((chosen.shape[0], 0), dtype=torch.long)
    if indexes is not None:
        proposals = [index.propose(room) for index in indexes]
        width = max(len(p) for p in proposals)
        if width == 0:
            return torch.empty((chosen.shape[0], 0), dtype=torch.long)
        # a shorter proposal is padded with its row's newest token: a guess like any other, checked as one
        rows = [p + [int(c)] * (width - len(p)) for p, c in zip(proposals, chosen.tolist(), strict=True)]
        return torch.tensor(rows, dtype=torch.long, device=chosen.device)
    return _draft_int8(model, state, chosen, room)


def _draft_int8(model: nn.Module, state: DecodeState, chosen: Tensor, room: int) -> Tensor:
    """``room`` greedy tokens of the W4A8 path after ``chosen``; the cache, mask and positions are as before."""
    saved = (state.tokens, state.attention_mask, state.positions, state.logits)
    drafts = []
    token = chosen
    with drafting():
        for _ in range(room):
            decode_step(model, state, token)
            token = torch.argmax(state.logits, dim=-1)
            drafts.append(token)
    state.cache.crop(-room)
    state.tokens, state.attention_mask, state.positions, state.logits = saved
    return torch.stack(drafts, dim=1)


def _verify(model: nn.Module, state: DecodeState, chosen: Tensor, drafts: Tensor) -> Tensor:
    """Feed ``chosen (B,)`` and ``drafts (B, d)`` in one forward; the logits of all d + 1 positions, (B, d + 1, V)
    float32. The mask and positions grow by d + 1 (cropped back by :func:`_crop`)."""
    ids = torch.cat([chosen[:, None], drafts], dim=1).contiguous()
    n = ids.shape[1]
    state.attention_mask = torch.cat([state.attention_mask, state.attention_mask.new_ones(ids.shape)], dim=-1)
    positions = state.positions + torch.arange(1, n + 1, device=ids.device)
    state.positions = positions[:, -1:]
    if state.fast_attend is not None:
        logits = fast_forward(model, ids, positions, state.fast_attend, n)
    else:
        kwargs = dict(state.forward_kwargs)
        if "position_ids" in kwargs:
            kwargs["position_ids"] = positions
        if "logits_to_keep" in kwargs:
            kwargs["logits_to_keep"] = n
        with _verifying(model):
            output = model(input_ids=ids, attention_mask=state.attention_mask, return_dict=True, **kwargs)
        logits = output.logits
    return logits[:, -n:].to(dtype=torch.float32, device=ids.device, copy=True)


def _crop(state: DecodeState, remove: int) -> None:
    """Drop the last ``remove`` fed positions from the cache, the mask and the positions."""
    if remove <= 0:
        return
    state.cache.crop(-remove)
    state.attention_mask = state.attention_mask[:, :-remove]
    state.positions = state.positions - remove


__all__ = ["VERIFY_ATTENTION", "SpeculationCounts", "decode_speculative", "verify_attention"]
