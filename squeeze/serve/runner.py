"""One engine step through the model: ragged rows in, each row's next-token logits out.

A step feeds B rows, row b its ``n_b`` next tokens (a prompt chunk, or one token when decoding) at
positions ``computed_b ..``. The rows are left-padded to the longest (t tokens), so every row's last
column is its newest token and ``logits_to_keep=1`` gives exactly the logits needed. Attention reads
each row's whole history from the paged pool through a transformers Cache (:class:`PagedStepCache`)
whose ``update`` writes the new keys and values into the rows' blocks and returns the rows' histories,
(B, H, L, D), L the longest; an explicit (B, 1, t, L) mask lets each real query see its own row's
positions up to its own, and each padding query only position 0 (so no softmax row is empty).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from transformers.cache_utils import Cache

from squeeze.models.modes import cache_kwarg, input_device
from squeeze.serve.blocks import BlockManager
from squeeze.serve.kv_pool import PagedKVPool, StepSlots
from squeeze.serve.scheduler import ScheduledChunk


class PagedStepCache(Cache):
    """The cache transformers' attention layers call during one step: ``update`` goes to the paged pool."""

    def __init__(self, pool: PagedKVPool, slots: StepSlots):
        super().__init__(layers=[])
        self.pool = pool
        self.slots = slots

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args: Any, **kwargs: Any) -> Any:
        return self.pool.update(layer_idx, key_states, value_states, self.slots)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions and the mask are given explicitly; nothing should derive them from the cache

    def __len__(self) -> int:
        return self.pool.shape.layers


class ModelRunner:
    """Runs planned steps of a causal LM over a :class:`PagedKVPool` whose blocks ``blocks`` hands out."""

    def __init__(self, model: nn.Module, pool: PagedKVPool, blocks: BlockManager, *, pad_id: int = 0):
        self.model = model
        self.pool = pool
        self.blocks = blocks
        self.pad_id = pad_id
        self.device = input_device(model)
        accepted = frozenset(inspect.signature(model.forward).parameters)
        self._cache_kwarg = cache_kwarg(model)
        self._keep_kwarg = "logits_to_keep" if "logits_to_keep" in accepted else None
        implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
        self._bool_mask = implementation in ("sdpa", "flex_attention")  # eager adds the mask to the scores

    def run(self, plan: Seq[ScheduledChunk]) -> Tensor:
        """Feed every chunk of ``plan``; each row's next-token logits, (B, V) float32 on the CPU."""
        inputs = self._inputs(plan)
        kwargs: dict[str, Any] = {self._cache_kwarg: PagedStepCache(self.pool, inputs.slots), "use_cache": True}
        if self._keep_kwarg:
            kwargs[self._keep_kwarg] = 1
        output = self.model(
            input_ids=inputs.input_ids,
            attention_mask=inputs.mask,
            position_ids=inputs.position_ids,
            return_dict=True,
            **kwargs,
        )
        return output.logits[:, -1].to(dtype=torch.float32, device="cpu", copy=True)  # (B, V)

    def _inputs(self, plan: Seq[ScheduledChunk]) -> _StepInputs:
        rows = len(plan)
        width = max(chunk.tokens for chunk in plan)  # t
        starts = [chunk.seq.computed for chunk in plan]
        ends = [chunk.seq.computed + chunk.tokens for chunk in plan]
        length = max(ends)  # L
        input_ids = torch.full((rows, width), self.pad_id, dtype=torch.long)
        first_col = torch.tensor([width - chunk.tokens for chunk in plan])  # (B,) first real column
        new_rows: list[int] = []
        new_cols: list[int] = []
        new_slots: list[int] = []
        new_sink: list[int] = []
        sink_tokens = self.pool.sink_tokens
        tables = torch.zeros((rows, self.blocks.blocks_for(length)), dtype=torch.long)
        sink_base = torch.zeros(rows, dtype=torch.long)
        for b, chunk in enumerate(plan):
            seq, start, end = chunk.seq, starts[b], ends[b]
            input_ids[b, width - chunk.tokens :] = torch.tensor(seq.tokens[start:end])
            new_rows += [b] * chunk.tokens
            new_cols += range(width - chunk.tokens, width)
            new_slots += self.blocks.slots(seq.seq_id, start, end)
            table = self.blocks.tables[seq.seq_id]
            tables[b, : len(table)] = torch.tensor(table)
            if sink_tokens:
                base = self.blocks.sinks[seq.seq_id] * sink_tokens
                sink_base[b] = base
                new_sink += [base + p if p < sink_tokens else -1 for p in range(start, end)]
            else:
                new_sink += [-1] * chunk.tokens
        columns = torch.arange(width)
        # query position of each column: computed_b + (c - first_col_b); padding columns get 0
        query_pos = torch.tensor(starts)[:, None] + columns[None, :] - first_col[:, None]  # (B, t)
        real = columns[None, :] >= first_col[:, None]
        query_pos = query_pos.masked_fill(~real, 0)
        positions = torch.arange(length)
        size = self.blocks.block_size
        read_slots = tables.gather(1, (positions // size).expand(rows, -1)) * size + positions % size  # (B, L)
        sink = min(length, sink_tokens)
        read_sink = sink_base[:, None] + torch.arange(sink)[None, :]  # (B, s)
        allowed = positions[None, None, :] <= query_pos[:, :, None]  # (B, t, L)
        device = self.device
        mask = allowed[:, None].to(device)
        if not self._bool_mask:
            mask = (
                torch.zeros(allowed.shape, dtype=self.pool.dtype)
                .masked_fill_(~allowed, torch.finfo(self.pool.dtype).min)[:, None]
                .to(device)
            )
        slots = StepSlots(
            new_rows=torch.tensor(new_rows, device=device),
            new_cols=torch.tensor(new_cols, device=device),
            new_slots=torch.tensor(new_slots, device=device),
            new_sink=torch.tensor(new_sink, device=device),
            read_slots=read_slots.to(device),
            read_sink=read_sink.to(device),
        )
        return _StepInputs(input_ids.to(device), query_pos.to(device), mask, slots)


@dataclass(frozen=True)
class _StepInputs:
    """The tensors of one step: ``input_ids`` / ``position_ids`` (B, t), ``mask`` (B, 1, t, L), the slots."""

    input_ids: Tensor
    position_ids: Tensor
    mask: Tensor
    slots: StepSlots


__all__ = ["PagedStepCache", "ModelRunner"]
