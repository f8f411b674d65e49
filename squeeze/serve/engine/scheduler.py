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

After the step, :meth:`Scheduler.update` takes the plan and the tokens chosen for it (squeeze.serve.engine.sampling)
and does each row's bookkeeping: what is computed, the prefix cache's block names, the tokens appended, the stop
checks (end of sequence, stop strings, ``max_tokens``, the context), the drafts a verification row keeps and the
blocks it no longer needs, and the outputs the requests are sent.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

from squeeze.serve.engine.blocks import BlockManager
from squeeze.serve.engine.sequence import Sequence
from squeeze.serve.types import FinishReason, RequestOutput, TokenLogprob


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


@dataclass(frozen=True)
class Sampled:
    """The tokens a step chose for one row (squeeze.serve.engine.sampling), in order: one for a plain row; for a
    verification row the exact token at each position while the drafts equal it, through the first that differs
    (or the last position). ``logprobs``: each token's entries (empty when the request asks for none)."""

    tokens: tuple[int, ...]
    logprobs: tuple[tuple[TokenLogprob, ...], ...]


@dataclass(frozen=True)
class StopRule:
    """What ends a request besides its own options: the model's end-of-sequence ids, the context length, and the
    tokenizer its text (and so its stop strings) is read with."""

    eos_ids: frozenset[int]
    max_model_len: int
    tokenizer: Any


class Scheduler:
    """Queues, running set, the per-step plan and each step's bookkeeping (see the module docstring). Not thread
    safe: the engine's thread owns it. ``stops``: needed by :meth:`update` only."""

    def __init__(
        self, blocks: BlockManager, *, max_num_seqs: int, max_batch_tokens: int, stops: StopRule | None = None
    ):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_batch_tokens = max_batch_tokens
        self.stops = stops
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # oldest first
        self.preemptions = 0
        self.finished = 0  # requests finished, however
        self.generated = 0  # tokens chosen and kept
        self.drafted = 0  # draft tokens verified
        self.accepted = 0  # of those, the ones kept

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

    # --- after the step ------------------------------------------------------------------------------------

    def update(self, plan: Seq[ScheduledChunk], sampled: Seq[Sampled | None]) -> list[tuple[Sequence, RequestOutput]]:
        """Each row's bookkeeping once the step has run (see the module docstring): ``sampled[row]``, the tokens
        chosen for ``plan[row]`` (None for a row that chose none: mid-prompt, or a request that only scores its
        prompt). The outputs to send, in order, one token each at most, with the sequence each is for."""
        outputs: list[tuple[Sequence, RequestOutput]] = []
        for chunk, chosen in zip(plan, sampled, strict=True):
            seq = chunk.seq
            if chunk.draft:
                outputs += self._verified(chunk, chosen)
                continue
            seq.computed += chunk.tokens
            if seq.block_names:
                self.blocks.commit(seq.seq_id, seq.block_names, seq.computed)
            if seq.pending:  # mid-prompt: no token to choose yet
                continue
            if seq.params.max_tokens == 0:  # score only: the prompt is in, nothing to generate
                outputs.append((seq, self.finish(seq, "length")))
            elif chosen is not None:
                outputs.append((seq, self._append(seq, chosen.tokens[0], chosen.logprobs[0])))
        return outputs

    def _verified(self, chunk: ScheduledChunk, chosen: Sampled | None) -> list[tuple[Sequence, RequestOutput]]:
        """A verification row's tokens appended while the request goes on; the KV of the rejected drafts is dropped
        (the sequence's computed count stops before them, and blocks it no longer needs go back to the pool)."""
        seq, base = chunk.seq, chunk.seq.computed
        outputs: list[tuple[Sequence, RequestOutput]] = []
        for i, (token, logprobs) in enumerate(zip(chosen.tokens, chosen.logprobs, strict=True) if chosen else ()):
            seq.computed = base + i + 1  # positions through base + i hold the exact keys and values of seq's tokens
            outputs.append((seq, self._append(seq, token, logprobs)))
            if outputs[-1][1].finished:
                break
        self.drafted += len(chunk.draft)
        self.accepted += max(0, len(outputs) - 1)
        if not (outputs and outputs[-1][1].finished):
            self.blocks.shrink(seq.seq_id, seq.computed + 1)
        return outputs

    def _append(self, seq: Sequence, token: int, logprobs: tuple[TokenLogprob, ...]) -> RequestOutput:
        """Append the chosen ``token`` to ``seq`` and check whether that ends the request: its output."""
        stops = self.stops
        if stops is None:
            raise RuntimeError("Scheduler.update needs the scheduler's stop rule (stops=)")
        grammar_done = False
        if seq.grammar is not None:
            if not seq.grammar.accept_token(token):  # the mask allowed it: a grammar library defect
                return self.finish(seq, "error", error=f"the grammar refused token {token}, which its mask allowed")
            grammar_done = seq.grammar.is_terminated()  # it accepted an end-of-sequence token
        seq.output_ids.append(token)
        if seq.ngram is not None:
            seq.ngram.extend((token,))
        self.generated += 1
        eos = (token in stops.eos_ids and not seq.params.ignore_eos) or grammar_done
        text_ids = seq.output_ids[:-1] if eos else seq.output_ids
        out_of_room = len(seq.output_ids) >= seq.params.max_tokens or seq.length >= stops.max_model_len
        piece, stopped = seq.text.update(stops.tokenizer, text_ids, final=eos or out_of_room)
        reason: FinishReason | None = "stop" if (eos or stopped) else ("length" if out_of_room else None)
        if reason is None:
            return _output(seq, piece, (token,), None, logprobs=logprobs)
        return self.finish(seq, reason, piece=piece, token_ids=(token,), logprobs=logprobs)

    def finish(
        self,
        seq: Sequence,
        reason: FinishReason,
        *,
        piece: str = "",
        token_ids: tuple[int, ...] = (),
        error: str | None = None,
        logprobs: tuple[TokenLogprob, ...] = (),
    ) -> RequestOutput:
        """End ``seq`` (wherever it is: its blocks go back to the pool): its last output."""
        self.remove(seq)
        self.finished += 1
        prompt_logprobs = None
        if seq.params.prompt_logprobs is not None:
            prompt_logprobs = tuple(seq.prompt_logprobs) or (TokenLogprob(seq.prompt_ids[0], None),)
        return _output(seq, piece, token_ids, reason, error=error, logprobs=logprobs, prompt_logprobs=prompt_logprobs)

    def preempt(self, seq: Sequence) -> None:
        """Drop ``seq``'s cache and queue it first, to be recomputed (prompt and output so far)."""
        self.running.remove(seq)
        self.blocks.release(seq.seq_id)
        seq.computed = 0
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)


def _output(
    seq: Sequence,
    piece: str,
    token_ids: tuple[int, ...],
    reason: FinishReason | None,
    *,
    error: str | None = None,
    logprobs: tuple[TokenLogprob, ...] = (),
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None,
) -> RequestOutput:
    return RequestOutput(
        request_id=seq.seq_id,
        text=piece,
        token_ids=token_ids,
        finished=reason is not None,
        finish_reason=reason,
        prompt_tokens=len(seq.prompt_ids),
        completion_tokens=len(seq.output_ids),
        error=error,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )


__all__ = ["Sampled", "ScheduledChunk", "Scheduler", "StopRule"]
