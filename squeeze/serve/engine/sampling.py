"""Choosing each request's next token from its logits row, independently of the rest of the batch.

Greedy (argmax) when ``temperature == 0``, as ``squeeze run``; else transformers' temperature / top-p
warpers (the same ones ``squeeze run`` applies, squeeze.runtime.sampling_params.warpers) and a draw from the
request's own generator, so a seeded request samples the same tokens whatever shares its batch.
"""

from __future__ import annotations

from functools import lru_cache
from typing import cast

import torch
from torch import Tensor
from transformers import LogitsProcessorList

from squeeze.runtime.sampling_params import warpers
from squeeze.serve.engine.sequence import Sequence


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


__all__ = ["choose_token"]
