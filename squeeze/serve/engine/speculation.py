"""Speculative decoding in the serving engine (squeeze.runtime.speculation): how many draft tokens each decoding
row may verify in a step, and the drafts themselves, from the n-gram index over the row's own tokens or from the
W4A8 path's greedy tokens (squeeze.runtime.linear.drafting).

A draft only chooses what a step feeds: the step's verification row (the newest token and the drafts) gets, at
each position, the logits decoding it alone would get, and the tokens are chosen from them as plain decoding
would (squeeze.serve.engine.sampling), so the tokens cannot change; the drafts that differ are dropped by the
scheduler's update (squeeze.serve.engine.scheduler)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch

from squeeze.runtime.linear import drafting, prepare_draft_forms
from squeeze.runtime.speculation import NgramIndex, SpeculationOptions, draft_length
from squeeze.serve.engine.runner import ModelRunner
from squeeze.serve.engine.scheduler import ScheduledChunk
from squeeze.serve.engine.sequence import Sequence

log = logging.getLogger(__name__)


class Speculator:
    """The engine's drafter (``options``: off, ``ngram:K`` or ``int8:K``) and its counters. Not thread safe: the
    engine's thread owns it."""

    def __init__(self, options: SpeculationOptions, runner: ModelRunner, max_model_len: int):
        self.options = options
        self.runner = runner
        self.max_model_len = max_model_len
        #: bytes the int8 drafter's weight forms hold beyond the weights (0 without it)
        self.draft_bytes = prepare_draft_forms(runner.model) if options.drafter == "int8" else 0
        self.drafted = 0  # draft tokens verified
        self.accepted = 0  # of those, the ones kept
        #: this step's n-gram proposal for each decoding row, by seq_id: made once by room() (its length sizes the
        #: row's blocks) and cut to the row's room by draft()
        self._proposals: dict[str, list[int]] = {}

    def admit(self, seq: Sequence) -> None:
        """Give a new sequence the n-gram drafter's index over its tokens (a constrained one drafts nothing)."""
        if self.options.drafter == "ngram" and seq.grammar is None:
            seq.ngram = NgramIndex()
            seq.ngram.extend(seq.tokens)

    def room(self, running: Iterable[Sequence]) -> Callable[[Sequence], int] | None:
        """How many draft tokens each decoding sequence may verify this step (None: speculation is off, or the
        batch has too many decoding rows for drafts to pay). Called once per step, before :meth:`draft`: the
        n-gram drafter's proposals are kept for it."""
        self._proposals = {}
        if not self.options.enabled:
            return None
        decoding = sum(seq.pending == 1 for seq in running)
        k = draft_length(self.options.k, decoding)
        if k == 0:
            return None

        def room(seq: Sequence) -> int:
            if seq.grammar is not None:  # a constrained row's mask is known for its next position only
                return 0
            left = min(seq.params.max_tokens - len(seq.output_ids) - 1, self.max_model_len - seq.length)
            cap = max(0, min(k, left))
            if seq.ngram is None or not cap:
                return cap
            proposal = self._proposals[seq.seq_id] = seq.ngram.propose(cap)
            return len(proposal)

        return room

    def draft(self, plan: list[ScheduledChunk]) -> list[ScheduledChunk]:
        """``plan`` with each chunk that has draft room turned into a verification row: its newest token and
        up to ``room`` drafted tokens (the n-gram index's proposal, or the int8 path's greedy tokens). A failed
        draft costs the speedup, never a request: the plan's rows then verify nothing."""
        if not any(chunk.room for chunk in plan):
            return plan
        try:
            drafts = self._drafts(plan)
        except Exception:  # noqa: BLE001 - see the docstring
            log.exception("drafting failed; this step verifies no drafts")
            return [ScheduledChunk(chunk.seq, chunk.tokens) for chunk in plan]
        return [
            ScheduledChunk(chunk.seq, chunk.tokens + len(drafts[row]), draft=tuple(drafts[row]))
            if drafts.get(row)
            else ScheduledChunk(chunk.seq, chunk.tokens)
            for row, chunk in enumerate(plan)
        ]

    def _drafts(self, plan: list[ScheduledChunk]) -> dict[int, list[int]]:
        if self.options.drafter != "ngram":
            return self._draft_int8(plan)
        # room() proposed for every row it gave room; the scheduler may have cut a row's room (budget, free
        # blocks), and a shorter proposal is the longer one's prefix (the same match, fewer tokens after it)
        return {
            row: self._proposals[chunk.seq.seq_id][: chunk.room]
            for row, chunk in enumerate(plan)
            if chunk.room and chunk.seq.ngram is not None
        }

    def _draft_int8(self, plan: list[ScheduledChunk]) -> dict[int, list[int]]:
        """Greedy tokens of the W4A8 path (squeeze.runtime.linear.drafting) for the rows with draft room, one
        batched step per draft position; their keys and values go to the rows' own blocks, where verification
        overwrites them with the exact path's."""
        drafts: dict[int, list[int]] = {row: [] for row, chunk in enumerate(plan) if chunk.room}
        for i in range(max((chunk.room for chunk in plan), default=0)):
            rows = [row for row in drafts if plan[row].room > i]
            step = [ScheduledChunk(plan[row].seq, 1, draft=tuple(drafts[row]), skip=i) for row in rows]
            with torch.inference_mode(), drafting():
                chosen = self.runner.run(step).argmax(dim=-1).tolist()
            for row, token in zip(rows, chosen, strict=True):
                drafts[row].append(int(token))
        return drafts

    def count(self, drafted: int, accepted: int) -> None:
        """Count a verification row's ``drafted`` draft tokens, ``accepted`` of them kept."""
        self.drafted += drafted
        self.accepted += accepted


__all__ = ["Speculator"]
