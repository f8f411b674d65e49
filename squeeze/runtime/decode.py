"""The token loop behind :func:`squeeze.runtime.generate.generate`: prefill, then one decode step per token.

:func:`prefill` runs the (left-padded) prompt batch through the model once, filling the KV cache, and
returns a :class:`DecodeState` holding the next-token logits. :func:`decode` then chooses a token per row
(greedy, or sampled with temperature / top-p), feeds it back with :func:`decode_step`, and stops after
``max_new_tokens`` tokens or once every row has produced an end-of-sequence token.

The loop feeds the model exactly what transformers' ``model.generate`` feeds it (position ids from the
attention mask, the growing 2-D mask, ``logits_to_keep=1``, the caller's cache) and uses transformers'
own temperature / top-p warpers under the same conditions, then ``torch.multinomial``: greedy runs, and
sampled runs after the same ``torch.manual_seed``, give the same tokens as ``model.generate``. What it
does not apply is anything else a model's ``generation_config`` may ask for (repetition penalty, minimum
length...): only the options here shape the choice.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn
from transformers import LogitsProcessorList

from squeeze.models.modes import cache_kwarg
from squeeze.runtime.fast_path import AttendFn, fast_forward, fast_path_supported
from squeeze.runtime.sampling_params import SamplingParams

#: Called with each step's chosen tokens, (B,) int64 on the CPU (the streamer that times and prints them).
TokensFn = Callable[[torch.Tensor], None]


@dataclass(frozen=True)
class DecodeOptions:
    """How one batch decodes: its :class:`SamplingParams` (checked when built; trusted here), and the batch's
    token ids. Rows that produced one of ``eos_ids`` are finished: they are fed ``pad_id`` from then on, and
    decoding stops when all are finished."""

    sampling: SamplingParams
    pad_id: int = 0
    eos_ids: frozenset[int] = field(default_factory=frozenset)

    @property
    def max_new_tokens(self) -> int:
        return self.sampling.max_tokens

    @property
    def do_sample(self) -> bool:
        return self.sampling.do_sample

    def processors(self) -> LogitsProcessorList:
        """transformers' warpers, in ``generate``'s order and on its conditions (a no-op one is left out)."""
        return self.sampling.processors()


@dataclass
class DecodeState:
    """What the loop carries from one step to the next (B rows; T grows by one per step).

    tokens: (B, T) int64, the left-padded prompt followed by every chosen token. attention_mask: (B, T)
    int64, 0 on the padding. positions: (B, 1) int64, each row's position of its last token (padding does
    not count). cache: the KV cache the forwards fill. logits: (B, V) float32, the next-token logits of
    the last forward. unfinished: (B,) int64, 1 while a row has not produced an end-of-sequence token.
    forward_kwargs: what every forward of the run takes besides its inputs (the cache under the model's
    keyword, ``use_cache``, ``logits_to_keep`` and a ``position_ids`` slot where the model accepts them).
    """

    tokens: torch.Tensor
    attention_mask: torch.Tensor
    positions: torch.Tensor
    cache: Any
    logits: torch.Tensor
    unfinished: torch.Tensor
    forward_kwargs: dict[str, Any] = field(default_factory=dict)
    #: set when the run attends natively and the model has the Llama shape: every forward is
    #: squeeze.runtime.fast_path's flat one, with this ``attend`` (the cache's write, then the native kernel)
    fast_attend: AttendFn | None = None


def prefill(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    cache: Any,
    extra_kwargs: dict[str, Any] | None = None,
) -> DecodeState:
    """Run the prompt batch (``input_ids`` / ``attention_mask``: (B, T) int64, left-padded) through ``model``.

    Fills ``cache`` and returns the state whose ``logits`` give each row's first new token. ``extra_kwargs``:
    passed to every forward of the run (squeeze.runtime.attention.native_run's).
    """
    # the padding sits left of the prompt: positions count real tokens only (padding gets 0, as in generate)
    positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
    unfinished = torch.ones(input_ids.shape[0], dtype=torch.long, device=input_ids.device)
    state = DecodeState(
        tokens=input_ids,
        attention_mask=attention_mask,
        positions=positions,
        cache=cache,
        logits=torch.empty(0),
        unfinished=unfinished,
        forward_kwargs=_forward_kwargs(model, cache) | (extra_kwargs or {}),
        fast_attend=_fast_attend(model, cache, (extra_kwargs or {}).get("squeeze_kv")),
    )
    state.logits = _forward(model, state, input_ids)
    state.positions = positions[:, -1:]
    return state


def choose_tokens(state: DecodeState, options: DecodeOptions, processors: LogitsProcessorList) -> torch.Tensor:
    """The next token of every row, (B,) int64, from ``state.logits``; appended to ``state.tokens``.

    Finished rows get ``options.pad_id``; a row that chose an end-of-sequence token is marked finished.
    """
    scores = processors(cast(torch.LongTensor, state.tokens), state.logits)
    if options.do_sample:
        chosen = torch.multinomial(nn.functional.softmax(scores, dim=-1), num_samples=1).squeeze(1)
    else:
        chosen = torch.argmax(scores, dim=-1)
    if options.eos_ids:  # without an end-of-sequence token no row finishes early, and none is padded
        chosen = chosen * state.unfinished + options.pad_id * (1 - state.unfinished)
        eos = torch.tensor(sorted(options.eos_ids), dtype=chosen.dtype, device=chosen.device)
        state.unfinished = state.unfinished & ~torch.isin(chosen, eos)
    state.tokens = torch.cat([state.tokens, chosen[:, None]], dim=-1)
    return chosen


def decode_step(model: nn.Module, state: DecodeState, tokens: torch.Tensor) -> None:
    """Feed the chosen ``tokens`` ((B,) int64) through ``model`` one position further; updates ``state``."""
    state.attention_mask = torch.cat(
        [state.attention_mask, state.attention_mask.new_ones((tokens.shape[0], 1))], dim=-1
    )
    state.positions = state.positions + 1
    state.logits = _forward(model, state, tokens[:, None])


def decode(
    model: nn.Module, state: DecodeState, options: DecodeOptions, on_tokens: TokensFn | None = None
) -> torch.Tensor:
    """Choose up to ``options.max_new_tokens`` tokens per row after :func:`prefill`; (B, steps) int64.

    ``on_tokens(tokens)`` sees every step's tokens as soon as they are chosen. Rows finished early hold
    ``options.pad_id`` after their end-of-sequence token. No forward runs after the last token.
    """
    processors = options.processors()
    start = state.tokens.shape[1]
    for step in range(options.max_new_tokens):
        chosen = choose_tokens(state, options, processors)
        if on_tokens is not None:
            on_tokens(chosen.cpu())
        if step + 1 == options.max_new_tokens or not bool(state.unfinished.any()):
            break
        decode_step(model, state, chosen)
    return state.tokens[:, start:]


def _forward(model: nn.Module, state: DecodeState, input_ids: torch.Tensor) -> torch.Tensor:
    """One forward of ``input_ids`` ((B, t) int64) at ``state``'s mask, positions and cache; the last
    position's logits as (B, V) float32 (a copy: a view would keep the prefill's (B, T, V) logits alive)."""
    if state.fast_attend is not None:
        logits = fast_forward(model, input_ids.contiguous(), state.positions, state.fast_attend, 1)
        return logits[:, -1].to(copy=True, dtype=torch.float32, device=input_ids.device)
    kwargs = dict(state.forward_kwargs)
    if "position_ids" in kwargs:
        kwargs["position_ids"] = state.positions
    output = model(input_ids=input_ids.contiguous(), attention_mask=state.attention_mask, return_dict=True, **kwargs)
    return output.logits[:, -1].to(copy=True, dtype=torch.float32, device=input_ids.device)


def _fast_attend(model: nn.Module, cache: Any, native: Any) -> AttendFn | None:
    """The flat forward's ``attend`` for a run whose forwards attend natively through ``native`` (a
    squeeze.runtime.attention.RunAttention), when the model has the Llama shape; else None (transformers'
    forward). The same decision squeeze serve takes (squeeze.serve.engine.runner.ModelRunner)."""
    if native is None or not fast_path_supported(model):
        return None

    def attend(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        cache.update(key, value, module.layer_idx)  # stores the codes; the kernel reads them in place
        return native.attend(module, query, getattr(module, "scaling", None))  # type: ignore[no-any-return]

    return attend


def _forward_kwargs(model: nn.Module, cache: Any) -> dict[str, Any]:
    """The keyword arguments every forward of a run takes (looked up once per run, not per token)."""
    try:
        accepted = frozenset(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        accepted = frozenset()
    kwargs: dict[str, Any] = {cache_kwarg(model): cache, "use_cache": True}
    if "position_ids" in accepted:
        kwargs["position_ids"] = None  # filled per forward
    if "logits_to_keep" in accepted:  # the LM head on the last position only, as generate asks for
        kwargs["logits_to_keep"] = 1
    return kwargs


__all__ = ["DecodeOptions", "DecodeState", "prefill", "choose_tokens", "decode_step", "decode"]
