"""Where a model's greedy choice first departs from a given token sequence (another engine's output).

Two engines computing the same model in different orders agree token for token except where the top two
choices were within rounding of each other. Teacher-forced on the other engine's tokens, the model shows
the first step where it would have chosen differently, and by how much it preferred its own choice there.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def first_divergence(model: nn.Module, prompt_ids: Sequence[int], tokens: Sequence[int]) -> tuple[int, float] | None:
    """(step, gap) of the first of ``tokens`` (generated after ``prompt_ids``) that is not ``model``'s greedy
    choice, where ``gap`` is the log-probability of its own choice minus that of the given token (>= 0);
    None when every token is its greedy choice. One teacher-forced forward pass of a causal LM."""
    if not prompt_ids or not tokens:
        return None
    ids = torch.tensor([list(prompt_ids) + list(tokens)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()  # (steps, vocab)
    logprobs = torch.log_softmax(logits, dim=-1)
    choices = logprobs.argmax(dim=-1)
    given = torch.tensor(list(tokens))
    differ = (choices != given).nonzero()
    if not differ.numel():
        return None
    step = int(differ[0, 0])
    return step, float(logprobs[step, choices[step]] - logprobs[step, given[step]])


__all__ = ["first_divergence"]
