"""Log-probabilities: computed from a step's logits (the engine's side) and written in OpenAI's two shapes.

They are the model's own distribution, as vLLM documents its: the fp32 log-softmax of the logits, before
temperature and top-p, so a token's value is the negative of the per-token NLL ``squeeze eval`` sums (same
tokens, same cache). /v1/completions uses the legacy shape (``tokens``, ``token_logprobs``,
``top_logprobs`` as a list of ``{token: logprob}`` dicts, ``text_offset``), chat the current one
(``content``: one object per token with ``token``, ``logprob``, ``bytes`` and ``top_logprobs``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from squeeze.serve.types import TokenLogprob

#: OpenAI's limit on ``logprobs`` (completions) and ``top_logprobs`` (chat).
MAX_LOGPROBS = 20


def token_logprobs(logits: Tensor, targets: Sequence[int], top: int) -> list[TokenLogprob]:
    """The log-probability of ``targets[i]`` under ``logits[i]`` (``(n, V)``, read as fp32) and the ``top`` most
    likely tokens there."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    index = torch.tensor(list(targets), dtype=torch.long, device=logp.device)[:, None]
    chosen = logp.gather(1, index)[:, 0].tolist()
    if top > 0:
        values, ids = logp.topk(min(top, logp.shape[-1]), dim=-1)
        tops = [tuple(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
    else:
        tops = [() for _ in chosen]
    return [TokenLogprob(int(t), float(c), k) for t, c, k in zip(targets, chosen, tops, strict=True)]


TokenText = Callable[..., list[str]]


class LegacyLogprobs:
    """The ``logprobs`` object of one /v1/completions choice, built up as tokens come (streamed or not).

    ``token_text(ids, in_context=...)``: the engine's :meth:`~squeeze.serve.types.EngineClient.token_strings`.
    ``text_offset`` counts characters from ``offset`` (the length of what the choice's text starts with that
    these tokens do not cover), each token's string after the previous one's, as vLLM counts.
    """

    def __init__(self, token_text: TokenText, offset: int = 0) -> None:
        self.token_text = token_text
        self.offset = offset

    def render(self, entries: Sequence[TokenLogprob], context: Sequence[int] = ()) -> dict[str, Any]:
        """The object for ``entries``; ``context``: the ids just before them (for the first token's spacing)."""
        ids = [e.token_id for e in entries]
        strings = self.token_text([*context, *ids], in_context=True)[len(context) :] if ids else []
        alternatives = sorted({i for e in entries for i, _ in e.top} - set(ids))
        names = dict(zip(alternatives, self.token_text(alternatives, in_context=False), strict=True))
        names.update(zip(ids, self.token_text(ids, in_context=False), strict=True))
        offsets = []
        for text in strings:
            offsets.append(self.offset)
            self.offset += len(text)
        tops: list[dict[str, float] | None] = []
        for entry in entries:
            if entry.logprob is None:
                tops.append(None)
                continue
            top = {names[i]: lp for i, lp in entry.top}
            top.setdefault(names[entry.token_id], entry.logprob)  # as OpenAI: the chosen token is always there
            tops.append(top)
        return {
            "tokens": strings,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": tops,
            "text_offset": offsets,
        }


def merge_legacy(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One legacy object from several (echoed prompt, then completion)."""
    merged: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for part in parts:
        for key, values in merged.items():
            values.extend(part[key])
    return merged


def chat_logprobs(
    entries: Sequence[TokenLogprob], token_text: TokenText, top: int, context: Sequence[int] = ()
) -> dict[str, Any]:
    """The chat ``logprobs`` object: ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}, ...]}``;
    ``context``: the ids just before ``entries`` (for the first token's spacing)."""
    ids = [e.token_id for e in entries]
    strings = token_text([*context, *ids], in_context=True)[len(context) :] if ids else []
    alternatives = sorted({i for e in entries for i, _ in e.top})
    names = dict(zip(alternatives, token_text(alternatives, in_context=False), strict=True))

    def item(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8", "surrogatepass"))}

    content = []
    for text, entry in zip(strings, entries, strict=True):
        logprob = entry.logprob if entry.logprob is not None else 0.0
        tops = [item(names[i], lp) for i, lp in entry.top[:top]]
        content.append({**item(text, logprob), "top_logprobs": tops})
    return {"content": content}


__all__ = ["MAX_LOGPROBS", "token_logprobs", "LegacyLogprobs", "merge_legacy", "chat_logprobs"]
