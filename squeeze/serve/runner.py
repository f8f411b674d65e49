"""One engine step through the model: ragged rows in, each row's next-token logits out, no padding anywhere.

A step feeds B rows, row b its ``n_b`` next tokens (a prompt chunk, or one token when decoding) at
positions ``computed_b ..``. The rows are packed into one sequence of N = sum n_b tokens, so every linear
layer runs on exactly the real tokens (left-padding ragged rows to the longest wasted most of a mixed
step's work: one 200-token prompt chunk beside 15 decoding rows made a (16, 200) batch). Only attention
needs the rows apart, and it gets them through two hooks transformers offers:

- the cache (:class:`PagedStepCache`): each attention layer's ``cache.update`` writes the new keys and
  values into the rows' blocks of the paged pool and returns the rows' histories, packed the same way
  (row after row, K = sum of the rows' lengths);
- the attention function, registered with transformers as ``squeeze_paged`` (:func:`paged_attention`):
  it runs transformers' own SDPA attention once per row, on that row's queries and history, with no mask
  when decoding (as ``squeeze run`` decodes) and a causal mask aligned to the row's end for prompt chunks.
  Without the step's ``squeeze_step`` keyword it is plain SDPA, so the model behaves as before everywhere
  else (``squeeze run`` in the same process, perplexity, ``generate``).

``logits_to_keep`` takes the index of each row's last token, so the LM head runs on B positions only (and on
every position of the rows whose prompt log-probabilities were asked for, :meth:`ModelRunner.run_keeping`).

Every token's bits are those ``squeeze run`` computes for it alone: per-row attention as above; the LM head
(squeeze.runtime.dense_linear) gives each row the same bits at any batch size; and the quantized linears
send each token down the path ``squeeze run`` would (:func:`squeeze.runtime.kernels.cpu_lut.row_paths`:
the tile path for the prompt tokens of a prompt longer than GEMV_MAX_ROWS, the GEMV for the rest).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from transformers.cache_utils import Cache

from squeeze.errors import ConfigError
from squeeze.models.modes import cache_kwarg, input_device
from squeeze.runtime.kernels.cpu_lut import GEMV_MAX_ROWS, RowPlan, row_paths
from squeeze.serve.blocks import BlockManager
from squeeze.serve.kv_pool import PagedKVPool, StepSlots
from squeeze.serve.scheduler import ScheduledChunk

#: The attention implementation name the engine registers with transformers and sets on the model it serves.
ATTENTION = "squeeze_paged"


@dataclass(frozen=True)
class RowSpan:
    """One row of a packed step: its queries ``q0:q1`` among the N new tokens, its history ``k0:k1`` among
    the K history tokens, and the (1, 1, n, L) bool mask its queries need (None: no mask)."""

    q0: int
    q1: int
    k0: int
    k1: int
    mask: Tensor | None


def paged_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    *,
    squeeze_step: Seq[RowSpan] | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' SDPA attention, once per row of a packed step (``query (1, Hq, N, D)``, ``key`` /
    ``value (1, Hkv, K, D)``); returns (1, N, Hq, D). Without ``squeeze_step``: plain SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if squeeze_step is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)  # type: ignore[no-any-return]
    kwargs.pop("is_causal", None)
    outputs = []
    for row in squeeze_step:
        q = query[:, :, row.q0 : row.q1]
        k, v = key[:, :, row.k0 : row.k1], value[:, :, row.k0 : row.k1]
        out, _ = sdpa_attention_forward(module, q, k, v, row.mask, **kwargs)  # (1, n, Hq, D)
        outputs.append(out)
    return torch.cat(outputs, dim=1), None


def register_attention() -> None:
    """Make ``squeeze_paged`` known to transformers (idempotent): the function, and SDPA's mask for it."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(ATTENTION, paged_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)


class PagedStepCache(Cache):
    """The cache transformers' attention layers call during one step: ``update`` goes to the paged pool."""

    def __init__(self, pool: PagedKVPool, slots: StepSlots):
        super().__init__(layers=[])
        self.pool = pool
        self.slots = slots

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args: Any, **kwargs: Any) -> Any:
        return self.pool.update(layer_idx, key_states, value_states, self.slots)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are given explicitly; nothing should derive them from the cache

    def __len__(self) -> int:
        return self.pool.shape.layers


@dataclass(frozen=True)
class _StepInputs:
    """One step's tensors: ``input_ids`` / ``position_ids`` (1, N), each row's last token index (B,), the
    pool's slots, the rows' spans."""

    input_ids: Tensor
    position_ids: Tensor
    last: Tensor
    slots: StepSlots
    rows: tuple[RowSpan, ...]
    paths: RowPlan


class ModelRunner:
    """Runs planned steps of a causal LM over a :class:`PagedKVPool` whose blocks ``blocks`` hands out.

    Sets the model's attention implementation to ``squeeze_paged`` (SDPA outside the engine's steps);
    :meth:`close` puts the previous one back. ConfigError for a model that does not run SDPA attention.
    """

    def __init__(self, model: nn.Module, pool: PagedKVPool, blocks: BlockManager):
        config: Any = getattr(model, "config", None)
        previous = getattr(config, "_attn_implementation", None)
        if previous not in ("sdpa", ATTENTION):
            raise ConfigError(
                f"squeeze serve runs attention through SDPA, and this model is set to {previous!r} attention",
                hint="serve a model whose architecture supports SDPA (the Llama family does)",
            )
        register_attention()
        config._attn_implementation = ATTENTION
        self._previous = previous if previous != ATTENTION else "sdpa"
        self.model = model
        self.pool = pool
        self.blocks = blocks
        self.device = input_device(model)
        accepted = frozenset(inspect.signature(model.forward).parameters)
        self._cache_kwarg = cache_kwarg(model)
        self._keep_kwarg = "logits_to_keep" if "logits_to_keep" in accepted else None
        # a 4-D mask makes transformers skip building one: attention here never reads it
        self._no_mask = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=self.device)

    def close(self) -> None:
        """Give the model back its previous attention implementation."""
        self.model.config._attn_implementation = self._previous  # type: ignore[union-attr]

    def run(self, plan: Seq[ScheduledChunk]) -> Tensor:
        """Feed every chunk of ``plan``; each row's next-token logits, (B, V) float32 on the CPU."""
        return self.run_keeping(plan, ())[0]

    def run_keeping(self, plan: Seq[ScheduledChunk], full: Seq[bool]) -> tuple[Tensor, dict[int, Tensor]]:
        """:meth:`run`, and for each row ``b`` with ``full[b]`` the logits at every position of its chunk,
        ``(tokens, V)`` float32 on the CPU (prompt log-probabilities need them); the LM head runs on those
        positions as well as the rows' last ones."""
        inputs = self._inputs(plan)
        keep, last, spans = inputs.last, None, {}
        if any(full):
            index: list[int] = []
            ends: list[int] = []
            for b, row in enumerate(inputs.rows):
                if b < len(full) and full[b]:
                    spans[b] = (len(index), len(index) + row.q1 - row.q0)
                    index += range(row.q0, row.q1)
                else:
                    index.append(row.q1 - 1)
                ends.append(len(index) - 1)
            keep, last = torch.tensor(index, dtype=torch.long, device=self.device), torch.tensor(ends)
        kwargs: dict[str, Any] = {self._cache_kwarg: PagedStepCache(self.pool, inputs.slots), "use_cache": True}
        with row_paths(inputs.paths):
            output = self.model(
                input_ids=inputs.input_ids,
                attention_mask=self._no_mask,
                position_ids=inputs.position_ids,
                return_dict=True,
                squeeze_step=inputs.rows,
                **({self._keep_kwarg: keep} if self._keep_kwarg else {}),
                **kwargs,
            )
        logits = output.logits[0]  # (B, V) or the kept positions', or (N, V) for a model without logits_to_keep
        if not self._keep_kwarg:
            logits = logits[keep]
        logits = logits.to(dtype=torch.float32, device="cpu", copy=True)
        if last is None:
            return logits, {}
        return logits[last], {b: logits[s:e] for b, (s, e) in spans.items()}

    def _inputs(self, plan: Seq[ScheduledChunk]) -> _StepInputs:
        sink_tokens = self.pool.sink_tokens
        tokens: list[int] = []
        positions: list[int] = []
        new_slots: list[int] = []
        new_sink_tokens: list[int] = []
        new_sink_entries: list[int] = []
        read_slots: list[int] = []
        read_positions: list[int] = []
        sink_positions: list[int] = []
        sink_entries: list[int] = []
        rows: list[RowSpan] = []
        last: list[int] = []
        tiled: list[int] = []
        gemv: list[int] = []
        for chunk in plan:
            seq = chunk.seq
            start, end = seq.computed, seq.computed + chunk.tokens
            q0, k0 = len(tokens), len(read_slots)
            prompt = len(seq.prompt_ids)
            # squeeze run prefills a prompt longer than GEMV_MAX_ROWS on the tile path, everything else on the GEMV
            split = q0 + (max(0, min(end, prompt) - start) if prompt > GEMV_MAX_ROWS else 0)
            tiled += range(q0, split)
            gemv += range(split, q0 + chunk.tokens)
            tokens += seq.tokens[start:end]
            positions += range(start, end)
            row_slots = self.blocks.slots(seq.seq_id, 0, end)
            new_slots += row_slots[start:]
            read_slots += row_slots
            read_positions += range(end)
            if sink_tokens:
                base = self.blocks.sinks[seq.seq_id] * sink_tokens
                new_sink_tokens += range(q0, q0 + max(0, min(end, sink_tokens) - start))
                new_sink_entries += range(base + start, base + max(start, min(end, sink_tokens)))
                kept = min(end, sink_tokens)
                sink_positions += range(k0, k0 + kept)
                sink_entries += range(base, base + kept)
            rows.append(RowSpan(q0, len(tokens), k0, len(read_slots), self._row_mask(chunk.tokens, end)))
            last.append(len(tokens) - 1)
        device = self.device

        def as_tensor(values: list[int]) -> Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        slots = StepSlots(
            as_tensor(new_slots),
            as_tensor(new_sink_tokens),
            as_tensor(new_sink_entries),
            as_tensor(read_slots),
            as_tensor(sink_positions),
            as_tensor(sink_entries),
            as_tensor(positions),
            as_tensor(read_positions),
        )
        paths = RowPlan(len(tokens), torch.tensor(tiled, dtype=torch.long), torch.tensor(gemv, dtype=torch.long))
        return _StepInputs(
            as_tensor(tokens)[None], as_tensor(positions)[None], as_tensor(last), slots, tuple(rows), paths
        )

    def _row_mask(self, new: int, length: int) -> Tensor | None:
        """The mask of a row's ``new`` queries over its ``length`` keys: none when decoding (one query sees every
        key) or when the queries are the whole history (SDPA's own causal mask); else causal, aligned at the end."""
        if new == 1 or new == length:
            return None
        keys = torch.arange(length, device=self.device)
        queries = torch.arange(length - new, length, device=self.device)
        return (keys[None, :] <= queries[:, None])[None, None]  # (1, 1, n, L)


__all__ = ["ATTENTION", "RowSpan", "paged_attention", "register_attention", "PagedStepCache", "ModelRunner"]
