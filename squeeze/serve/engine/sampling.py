"""Choosing each request's next token from its logits row, independently of the rest of the batch.

Greedy (argmax) when ``temperature == 0``, as ``squeeze run``; else transformers' temperature / top-p
warpers (the same ones ``squeeze run`` applies, squeeze.runtime.sampling_params.warpers) and a draw from the
request's own generator, so a seeded request samples the same tokens whatever shares its batch.

:func:`sample_step` reads a whole step's logits: each row's chosen tokens (a verification row's, position by
position while its drafts hold), their log-probabilities, and the prompt log-probabilities a request asked
for. What the tokens do to their requests is the scheduler's update (squeeze.serve.engine.scheduler).
"""

from __future__ import annotations

from functools import lru_cache
from typing import cast

import torch
from torch import Tensor
from transformers import LogitsProcessorList

from squeeze.runtime.sampling_params import warpers
from squeeze.serve.engine.grammar import StepMasks
from squeeze.serve.engine.scheduler import Sampled, ScheduledChunk
from squeeze.serve.engine.sequence import Sequence
from squeeze.serve.logprobs import token_logprobs
from squeeze.serve.types import TokenLogprob


@lru_cache(maxsize=256)
def _processors(temperature: float, top_p: float) -> LogitsProcessorList:
    return warpers(temperature, top_p)


def choose_token(seq: Sequence, logits: Tensor) -> int:
    """The next token of ``seq`` from its logits ``(V,)`` float32."""
    params = seq.params
    if params.temperature == 0 or seq.generator is None:
        return int(torch.argmax(logits))
    # the warpers take the ids so far; temperature and top-p never read them
    ids = cast(torch.LongTensor, torch.empty((1, 0), dtype=torch.long))
    scores = _processors(float(params.temperature), float(params.top_p))(ids, logits[None])  # (1, V)
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, num_samples=1, generator=seq.generator))


def sample_step(
    plan: list[ScheduledChunk], logits: Tensor, row_logits: dict[int, Tensor], masks: StepMasks
) -> list[Sampled | None]:
    """The tokens chosen for each row of ``plan`` (None for a row that chooses none: mid-prompt, or a request
    that only scores its prompt), from the step's ``logits (B, V)`` and the full rows' ``row_logits`` ({row:
    (tokens, V)}: verification rows, and prompt chunks whose log-probabilities were asked for, which are recorded
    here); a constrained row's logits are masked first (``masks``, filled while the model ran)."""
    sampled: list[Sampled | None] = []
    for row, chunk in enumerate(plan):
        seq = chunk.seq
        if chunk.draft:
            sampled.append(_verification(seq, chunk.draft, row_logits[row]))
            continue
        if row in row_logits:
            record_prompt_logprobs(chunk, row_logits[row])
        if seq.computed + chunk.tokens < seq.length or seq.params.max_tokens == 0:
            sampled.append(None)
            continue
        token = choose_token(seq, logits[row] if seq.grammar is None else masks.masked(row, logits[row]))
        sampled.append(Sampled((token,), (_logprobs(seq, logits[row], token),)))
    return sampled


def _verification(seq: Sequence, draft: tuple[int, ...], logits: Tensor) -> Sampled:
    """A verification row's tokens (``logits (1 + k, V)``): the exact token at each position, chosen as plain
    decoding would, while the drafts equal it; through the first that differs, or the last position."""
    tokens: list[int] = []
    logprobs: list[tuple[TokenLogprob, ...]] = []
    for i in range(len(draft) + 1):
        token = choose_token(seq, logits[i])
        tokens.append(token)
        logprobs.append(_logprobs(seq, logits[i], token))
        if i == len(draft) or token != draft[i]:
            break
    return Sampled(tuple(tokens), tuple(logprobs))


def _logprobs(seq: Sequence, logits: Tensor, token: int) -> tuple[TokenLogprob, ...]:
    """The chosen ``token``'s log-probability entry from its unmasked ``logits (V,)``, if the request asked."""
    top = seq.params.logprobs
    return () if top is None else tuple(token_logprobs(logits[None], [token], top))


def wants_prompt_logits(chunk: ScheduledChunk) -> bool:
    """Whether ``chunk`` covers prompt positions whose log-probabilities its request asked for and lacks."""
    seq = chunk.seq
    prompt = len(seq.prompt_ids)
    return seq.params.prompt_logprobs is not None and len(seq.prompt_logprobs) < prompt and seq.computed < prompt - 1


def record_prompt_logprobs(chunk: ScheduledChunk, logits: Tensor) -> None:
    """Add the prompt log-probabilities ``logits`` (every position of ``chunk``, ``(tokens, V)``) give: position
    p predicts prompt token p + 1. A preempted sequence's recomputed positions are not recorded twice."""
    seq = chunk.seq
    start, prompt = seq.computed, seq.prompt_ids
    recorded = seq.prompt_logprobs
    if not recorded:
        recorded.append(TokenLogprob(prompt[0], None))
    first = max(start, len(recorded) - 1)
    stop = min(start + chunk.tokens, len(prompt) - 1)
    if stop > first:
        top = seq.params.prompt_logprobs or 0
        recorded += token_logprobs(logits[first - start : stop - start], prompt[first + 1 : stop + 1], top)


__all__ = ["choose_token", "record_prompt_logprobs", "sample_step", "wants_prompt_logits"]
