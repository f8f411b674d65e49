"""Continuous batching: which sequences run in the next step, and how many of their tokens.

Every step is planned afresh, so requests join and leave between steps. Under a budget of
``max_batch_tokens`` tokens per step, the plan takes, in this order:

1. every running sequence that is decoding (one token each), oldest first;
2. the next prompt chunk of every running sequence still prefilling (chunked prefill), oldest first;
3. waiting sequences, first come first served, while fewer than ``max_num_seqs`` run and the pool has the
   blocks for their first chunk. A sequence whose prompt starts with blocks in the prefix cache
   (squeeze.serve.engine.prefix_cache) takes them and starts computing after them.

A running sequence whose next tokens need a block the pool no longer has takes it from the youngest running
sequence: that one is preempted (its blocks go back to the pool, its cache is dropped) and returns to the
front of the queue, to be recomputed when there is room. Decoding sequences are never starved by prompts:
they are planned first, and only preemption (youngest first) ever takes their blocks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from squeeze.serve.engine.blocks import BlockManager
from squeeze.serve.engine.sequence import Sequence


@dataclass(frozen=True)
class ScheduledChunk:
    """``tokens`` tokens of ``seq`` to feed this step, from position ``seq.computed + skip``.

    Speculative decoding (squeeze.runtime.speculation): ``room``, the draft tokens the row's blocks were grown
    for (the scheduler's plan); ``draft``, the drafted tokens, which follow the sequence's own tokens (a
    verification row feeds the newest token and every draft: ``tokens == 1 + len(draft)``; the int8 drafter's
    row ``i`` feeds draft ``i - 1`` alone, ``skip == i``)."""

    seq: Sequence
    tokens: int
    room: int = 0
    draft: tuple[int, ...] = ()
    skip: int = 0

    @property
    def start(self) -> int:
        """The position of the chunk's first token."""
        return self.seq.computed + self.skip

    def token_ids(self) -> list[int]:
        """The ids the chunk feeds: positions ``start .. start + tokens - 1`` of the sequence and its drafts."""
        start, stop, length = self.start, self.start + self.tokens, self.seq.length
        ids = self.seq.token_range(start, min(stop, length))
        if stop > length:
            ids += self.draft[max(0, start - length) : stop - length]
        return ids


class Scheduler:
    """Queues, running set and the per-step plan (see the module docstring). Not thread safe: the engine's
    thread owns it."""

    def __init__(self, blocks: BlockManager, *, max_num_seqs: int, max_batch_tokens: int):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_batch_tokens = max_batch_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # oldest first
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Drop ``seq`` wherever it is (finished, cancelled or failed) and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.release(seq.seq_id)

    def schedule(self, room: Callable[[Sequence], int] | None = None) -> list[ScheduledChunk]:
        """The next step's plan; grows the planned sequences' block tables (preempting when the pool is short).

        ``room(seq)``: draft tokens a decoding sequence may verify this step (speculative decoding); its blocks
        grow for them too when the pool has them free and the budget allows (drafts never preempt)."""
        budget = self.max_batch_tokens
        plan: list[ScheduledChunk] = []
        decoding = [s for s in self.running if s.pending == 1]
        prefilling = [s for s in self.running if s.pending > 1]
        for seq in decoding + prefilling:
            if budget == 0:
                break
            if seq not in self.running:  # preempted earlier in this loop
                continue
            tokens = min(seq.pending, budget)
            if self._make_room(seq, seq.computed + tokens):
                extra = min(room(seq), budget - tokens) if room is not None and seq.pending == 1 else 0
                if extra > 0 and self.blocks.can_grow(seq.seq_id, seq.computed + tokens + extra):
                    self.blocks.grow(seq.seq_id, seq.computed + tokens + extra)
                else:
                    extra = 0
                plan.append(ScheduledChunk(seq, tokens, room=extra))
                budget -= tokens + extra
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]  # new or preempted: nothing computed
            cached = self._cached(seq)
            start = len(cached) * self.blocks.block_size
            tokens = min(seq.length - start, budget)
            if not self.blocks.can_admit(seq.seq_id, cached, start + tokens):
                break  # admission never preempts: the queue waits for blocks to come back
            self.waiting.popleft()
            self.blocks.admit(seq.seq_id, cached, start + tokens)
            seq.computed = start
            if self.blocks.cache is not None:
                self.blocks.cache.record(seq.length, start)
            self.running.append(seq)
            plan.append(ScheduledChunk(seq, tokens))
            budget -= tokens
        return plan

    def _cached(self, seq: Sequence) -> list[int]:
        """The cached blocks ``seq`` can start from (none without a prefix cache, and none for a request that
        asks for its prompt's log-probabilities: those need the logits of every prompt position). Its own full
        blocks are still named, so later requests can reuse them."""
        cache = self.blocks.cache
        if cache is None:
            return []
        if seq.params.prompt_logprobs is not None:
            if seq.block_names is None:
                seq.block_names = cache.names(seq.prompt_ids)
            return []
        if seq.block_names is None:
            seq.block_names = cache.names(seq.prompt_ids)
        return self.blocks.cached(seq.block_names, seq.length)

    def _make_room(self, seq: Sequence, tokens: int) -> bool:
        """Grow ``seq`` to ``tokens`` tokens, preempting the youngest running sequences as needed; False when
        ``seq`` itself had to be preempted."""
        while not self.blocks.can_grow(seq.seq_id, tokens):
            victim = max(self.running, key=lambda s: s.order)
            self.preempt(victim)
            if victim is seq:
                return False
        self.blocks.grow(seq.seq_id, tokens)
        return True

    def preempt(self, seq: Sequence) -> None:
        """Drop ``seq``'s cache and queue it first, to be recomputed (prompt and output so far)."""
        self.running.remove(seq)
        self.blocks.release(seq.seq_id)
        seq.computed = 0
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)


__all__ = ["ScheduledChunk", "Scheduler"]
