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

from squeeze.serve.types import TokenLogprob, TokenNames

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


#: The engine's :meth:`~squeeze.serve.types.EngineClient.token_names`: ``(context, entries, specials=...)``.
NameTokens = Callable[..., list[TokenNames]]


class LegacyLogprobs:
    """The ``logprobs`` object of one /v1/completions choice, built up as tokens come (streamed or not).

    ``name_tokens``: the engine's :meth:`~squeeze.serve.types.EngineClient.token_names`. ``tokens`` and the
    keys of ``top_logprobs`` are the tokens' names read in context (distinct at each position; the chosen
    token's name is a key of its own dict). ``text_offset`` indexes the choice's text: ``offset`` is where
    these tokens' text starts in it, and each token's text follows the previous one's, so
    ``text[text_offset[i]:]`` starts with token i's text.
    """

    def __init__(self, name_tokens: NameTokens, offset: int = 0) -> None:
        self.name_tokens = name_tokens
        self.offset = offset

    def render(
        self, entries: Sequence[TokenLogprob], context: Sequence[int] = (), *, specials: bool = False
    ) -> dict[str, Any]:
        """The object for ``entries``; ``context``: the ids just before them; ``specials``: the text spells
        special tokens (an echoed prompt sent as ids)."""
        named = self.name_tokens(context, entries, specials=specials) if entries else []
        offsets = []
        for token in named:
            self.offset -= token.rewrites
            offsets.append(self.offset + token.lead)
            self.offset += len(token.text)
        tops: list[dict[str, float] | None] = []
        for entry, token in zip(entries, named, strict=True):
            if entry.logprob is None:
                tops.append(None)
                continue
            top = {token.names[i]: lp for i, lp in entry.top}
            top.setdefault(token.names[entry.token_id], entry.logprob)  # as OpenAI: the chosen token is always there
            tops.append(top)
        return {
            "tokens": [token.names[e.token_id] for e, token in zip(entries, named, strict=True)],
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
    entries: Sequence[TokenLogprob], name_tokens: NameTokens, top: int, context: Sequence[int] = ()
) -> dict[str, Any]:
    """The chat ``logprobs`` object: ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}, ...]}``,
    each token named as :class:`LegacyLogprobs` names them (``bytes``: a byte token's own byte, not its
    name's); ``context``: the ids just before ``entries``."""
    named = name_tokens(context, entries) if entries else []

    def item(names: TokenNames, token: int, logprob: float) -> dict[str, Any]:
        return {"token": names.names[token], "logprob": logprob, "bytes": names.token_bytes(token)}

    content = []
    for entry, names in zip(entries, named, strict=True):
        logprob = entry.logprob if entry.logprob is not None else 0.0
        tops = [item(names, i, lp) for i, lp in entry.top[:top]]
        content.append({**item(names, entry.token_id, logprob), "top_logprobs": tops})
    return {"content": content}


__all__ = ["MAX_LOGPROBS", "token_logprobs", "LegacyLogprobs", "merge_legacy", "chat_logprobs"]
