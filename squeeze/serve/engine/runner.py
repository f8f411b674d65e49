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

A natively attended step of a Llama-shaped model (squeeze.runtime.fast_path.fast_path_supported, as for squeeze
run) runs squeeze.runtime.fast_path's flat forward instead: the same operations and bits, with each layer's KV
write and native attention called directly instead of through the two hooks.

``logits_to_keep`` takes the index of each row's last token, so the LM head runs on B positions only (and on
every position of the rows whose prompt log-probabilities were asked for, :meth:`ModelRunner.run_keeping`).

Every token's bits are those ``squeeze run`` computes for it alone: per-row attention as above; the LM head
(squeeze.runtime.dense_linear) gives each row the same bits at any batch size; and the quantized linears
are batch-invariant: one native matmul at every row count, each output summed in one fixed order
(squeeze.runtime.kernels.cpu_lut; with int8 activations the W4A8 kernel's exact integer sums). Tokens a
preempted sequence generated are recomputed with attention one query at a time, as they were decoded (:class:`RowSpan`).
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
from squeeze.runtime.attention import native_kernels, scaling_of
from squeeze.runtime.fast_path import fast_forward, fast_path_supported
from squeeze.runtime.kernels.cpu_attention import AttentionKernels, RaggedRows, attend
from squeeze.serve.engine.blocks import BlockManager
from squeeze.serve.engine.kv_pool import PagedKVPool, StepSlots
from squeeze.serve.engine.scheduler import ScheduledChunk

#: The attention implementation name the engine registers with transformers and sets on the model it serves.
ATTENTION = "squeeze_paged"


@dataclass(frozen=True)
class RowSpan:
    """One row of a packed step: its queries ``q0:q1`` among the N new tokens, its history ``k0:k1`` among
    the K history tokens, and the (1, 1, n, L) bool mask its first ``chunk`` queries need (None: no mask).

    ``chunk`` (None: all of them): how many leading queries are prompt tokens, attended as one chunk; the rest
    are tokens the sequence generated (recomputed after a preemption), each attended alone over its own prefix
    as when it was decoded, so that its bits are the decode step's (SDPA over a chunk gives a query other bits
    than SDPA over that query alone)."""

    q0: int
    q1: int
    k0: int
    k1: int
    mask: Tensor | None
    chunk: int | None = None


@dataclass(frozen=True)
class NativeStep:
    """One step attended by the native kernel (squeeze.runtime.attention): the pool's stores are read in place
    for the step's ``rows``; ``positions``: the longest row history."""

    kernels: AttentionKernels
    pool: PagedKVPool
    rows: RaggedRows
    positions: int

    def attend(self, module: nn.Module, query: Tensor, scaling: float | None) -> Tensor:
        """``query (1, Hq, N, D)`` of layer ``module.layer_idx``; (1, N, Hq, D)."""
        stores = self.pool.kernel_stores(module.layer_idx, self.positions)  # type: ignore[arg-type]
        if stores is None:  # ModelRunner checked the pool's layout before choosing the kernel
            raise RuntimeError("the native attention cannot read this KV pool")
        flat = query[0].transpose(0, 1)  # (N, Hq, D)
        scale = scaling_of(module, query.shape[-1], scaling)
        return attend(self.kernels, flat, self.pool.shape.kv_heads, self.rows, *stores, scale)[None]


def paged_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    *,
    squeeze_step: Seq[RowSpan] | None = None,
    squeeze_native: NativeStep | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' SDPA attention, once per row of a packed step (``query (1, Hq, N, D)``, ``key`` /
    ``value (1, Hkv, K, D)``); returns (1, N, Hq, D). With ``squeeze_native``: the whole step in one native
    call over the pool (``key`` / ``value`` unused). Without ``squeeze_step``: plain SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if squeeze_native is not None:
        return squeeze_native.attend(module, query, kwargs.get("scaling")), None
    if squeeze_step is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)  # type: ignore[no-any-return]
    kwargs.pop("is_causal", None)
    outputs = []
    for row in squeeze_step:
        n = row.q1 - row.q0
        chunk = n if row.chunk is None else row.chunk
        if chunk:  # the chunk sees the keys up to its last query
            stop = row.k1 - (n - chunk)
            q = query[:, :, row.q0 : row.q0 + chunk]
            k, v = key[:, :, row.k0 : stop], value[:, :, row.k0 : stop]
            out, _ = sdpa_attention_forward(module, q, k, v, row.mask, **kwargs)  # (1, chunk, Hq, D)
            outputs.append(out)
        for j in range(chunk, n):  # generated tokens, recomputed: one query over its own prefix, no mask
            stop = row.k1 - (n - 1 - j)
            q = query[:, :, row.q0 + j : row.q0 + j + 1]
            k, v = key[:, :, row.k0 : stop], value[:, :, row.k0 : stop]
            out, _ = sdpa_attention_forward(module, q, k, v, None, **kwargs)  # (1, 1, Hq, D)
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

    def __init__(self, pool: PagedKVPool, slots: StepSlots, native: bool = False):
        super().__init__(layers=[])
        self.pool = pool
        self.slots = slots
        self.native = native  # the native attention reads the pool in place: nothing to read back

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args: Any, **kwargs: Any) -> Any:
        if self.native:
            self.pool.write(layer_idx, key_states, value_states, self.slots)
            return key_states, value_states
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
        # a quantized pool is attended by the native kernel whenever squeeze run would attend its cache so
        # (squeeze.runtime.attention.native_kernels): the same kernel gives a request the same text
        kernels = native_kernels(model) if pool.spec is not None else None
        self._kernels = kernels if kernels is not None and pool.kernel_stores(0, 1) is not None else None
        # natively attended steps of a Llama-shaped model skip transformers' module tree (squeeze run decides alike)
        self._fast = self._kernels is not None and self._keep_kwarg is not None and fast_path_supported(model)

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
        native = self._native(inputs)
        cache = PagedStepCache(self.pool, inputs.slots, native=native is not None)
        kwargs: dict[str, Any] = {self._cache_kwarg: cache, "use_cache": True}
        if native is not None:
            kwargs["squeeze_native"] = native
        if native is not None and self._fast:
            logits = self._fast_logits(native, inputs, keep)
        else:
            output = self.model(
                input_ids=inputs.input_ids,
                attention_mask=self._no_mask,
                position_ids=inputs.position_ids,
                return_dict=True,
                squeeze_step=inputs.rows,
                **({self._keep_kwarg: keep} if self._keep_kwarg else {}),
                **kwargs,
            )
            logits = output.logits[0]  # (B, V) or the kept positions', or (N, V) without logits_to_keep
        if not self._keep_kwarg:
            logits = logits[keep]
        logits = logits.to(dtype=torch.float32, device="cpu", copy=True)
        if last is None:
            return logits, {}
        return logits[last], {b: logits[s:e] for b, (s, e) in spans.items()}

    def _fast_logits(self, native: NativeStep, inputs: _StepInputs, keep: Tensor) -> Tensor:
        """The kept positions' logits (k, V) by squeeze.runtime.fast_path: each layer writes its keys / values into
        the pool and attends natively, as :class:`PagedStepCache` and :func:`paged_attention` do in the model's
        forward."""
        pool, slots = self.pool, inputs.slots

        def attend(module: nn.Module, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
            pool.write(module.layer_idx, key, value, slots)  # type: ignore[arg-type]
            return native.attend(module, query, getattr(module, "scaling", None))

        return fast_forward(self.model, inputs.input_ids, inputs.position_ids, attend, keep)[0]

    def _inputs(self, plan: Seq[ScheduledChunk]) -> _StepInputs:
        """The step's tensors. Python work per row is constant (plus its new tokens): the slots of every row's
        history come from the block table tensors in a few tensor operations (:func:`step_slots`)."""
        sink_tokens = self.pool.sink_tokens
        tokens: list[int] = []
        starts: list[int] = []
        ends: list[int] = []
        tables: list[Tensor] = []
        new_sink_tokens: list[int] = []
        new_sink_entries: list[int] = []
        sink_positions: list[int] = []
        sink_entries: list[int] = []
        rows: list[RowSpan] = []
        last: list[int] = []
        q0 = k0 = 0
        for chunk in plan:
            seq = chunk.seq
            start, end = chunk.start, chunk.start + chunk.tokens
            q1, k1 = q0 + chunk.tokens, k0 + end
            tokens += chunk.token_ids()
            starts.append(start)
            ends.append(end)
            tables.append(self.blocks.table_tensor(seq.seq_id)[: self.blocks.blocks_for(end)])
            if sink_tokens:
                base = self.blocks.sinks[seq.seq_id] * sink_tokens
                new_sink_tokens += range(q0, q0 + max(0, min(end, sink_tokens) - start))
                new_sink_entries += range(base + start, base + max(start, min(end, sink_tokens)))
                kept = min(end, sink_tokens)
                sink_positions += range(k0, k0 + kept)
                sink_entries += range(base, base + kept)
            rows.append(self._row_span(chunk, q0, k0))
            last.append(q1 - 1)
            q0, k0 = q1, k1
        device = self.device

        def as_tensor(values: list[int]) -> Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        read_slots, read_positions, new_slots, new_positions = (
            t.to(device) for t in step_slots(tables, starts, ends, self.blocks.block_size)
        )
        slots = StepSlots(
            new_slots,
            as_tensor(new_sink_tokens),
            as_tensor(new_sink_entries),
            read_slots,
            as_tensor(sink_positions),
            as_tensor(sink_entries),
            new_positions,
            read_positions,
        )
        return _StepInputs(as_tensor(tokens)[None], new_positions[None], as_tensor(last), slots, tuple(rows))

    def _row_span(self, chunk: ScheduledChunk, q0: int, k0: int) -> RowSpan:
        """The row of ``chunk`` whose queries start at ``q0`` and whose keys start at ``k0`` in the step."""
        seq = chunk.seq
        start, end = chunk.start, chunk.start + chunk.tokens
        q1, k1 = q0 + chunk.tokens, k0 + end
        # a chunk that runs past the prompt recomputes generated tokens (after a preemption), or verifies drafts
        # (speculative decoding): those attend alone, each over its own prefix, as when decoded one at a time
        in_prompt = max(0, min(end, len(seq.prompt_ids)) - start)
        if in_prompt == chunk.tokens:
            return RowSpan(q0, q1, k0, k1, self._row_mask(chunk.tokens, end))
        mask = self._row_mask(in_prompt, start + in_prompt) if in_prompt else None
        return RowSpan(q0, q1, k0, k1, mask, in_prompt)

    def _native(self, inputs: _StepInputs) -> NativeStep | None:
        """The step's rows as the native kernel reads them (None: this runner attends with SDPA)."""
        if self._kernels is None:
            return None
        slots = inputs.slots
        q_offsets = torch.tensor([0, *(row.q1 for row in inputs.rows)], dtype=torch.long)
        k_offsets = torch.tensor([0, *(row.k1 for row in inputs.rows)], dtype=torch.long)
        sink_of = None
        if self.pool.sink_tokens:
            sink_of = torch.full((slots.read_slots.numel(),), -1, dtype=torch.long)
            sink_of[slots.sink_positions.cpu()] = slots.sink_entries.cpu()
        rows = RaggedRows(q_offsets, k_offsets, slots.read_slots.cpu().contiguous(), sink_of)
        longest = max((row.k1 - row.k0 for row in inputs.rows), default=0)
        return NativeStep(self._kernels, self.pool, rows, longest)

    def _row_mask(self, new: int, length: int) -> Tensor | None:
        """The mask of a row's ``new`` queries over its ``length`` keys: none when decoding (one query sees every
        key) or when the queries are the whole history (SDPA's own causal mask); else causal, aligned at the end."""
        if new == 1 or new == length:
            return None
        keys = torch.arange(length, device=self.device)
        queries = torch.arange(length - new, length, device=self.device)
        return (keys[None, :] <= queries[:, None])[None, None]  # (1, 1, n, L)


def step_slots(
    tables: Seq[Tensor], starts: Seq[int], ends: Seq[int], block_size: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The slots and positions of a step's rows, as int64 tensors, from their block tables.

    Row ``b`` holds positions ``0..ends[b]-1`` in blocks ``tables[b]`` (at least ``ceil(ends[b] / block_size)``
    of them, int64) and feeds positions ``starts[b]..ends[b]-1``. Returns ``read_slots`` / ``read_positions``
    (K,): every row's history, row after row (K = sum of ends), and ``new_slots`` / ``new_positions`` (N,):
    the new tokens' (N = sum of ends - starts), each the slot ``table[p // block_size] * block_size +
    p % block_size`` of position ``p``.
    """
    counts = torch.tensor([t.numel() for t in tables], dtype=torch.long)
    flat = torch.cat(list(tables)) if tables else torch.empty(0, dtype=torch.long)  # (NB,)
    rows = torch.repeat_interleave(torch.arange(len(tables)), counts)  # (NB,) the row of each block
    local = torch.arange(flat.numel()) - (torch.cumsum(counts, 0) - counts)[rows]  # block index in its row
    offsets = torch.arange(block_size)
    positions = (local[:, None] * block_size + offsets).reshape(-1)  # (NB * block_size,)
    slots = (flat[:, None] * block_size + offsets).reshape(-1)
    token_rows = torch.repeat_interleave(rows, block_size)
    read = positions < torch.tensor(list(ends), dtype=torch.long)[token_rows]
    new = read & (positions >= torch.tensor(list(starts), dtype=torch.long)[token_rows])
    return slots[read], positions[read], slots[new], positions[new]


__all__ = [
    "ATTENTION",
    "RowSpan",
    "NativeStep",
    "paged_attention",
    "register_attention",
    "PagedStepCache",
    "ModelRunner",
    "step_slots",
]
