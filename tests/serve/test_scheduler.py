"""The step plan: decode first, chunked prefill under the token budget, admission, preemption of the youngest."""

from __future__ import annotations

from squeeze.serve.engine.blocks import BlockManager
from squeeze.serve.engine.scheduler import Sampled, ScheduledChunk, Scheduler, StopRule
from squeeze.serve.engine.sequence import Sequence
from squeeze.serve.types import SamplingParams


def _seq(order: int, prompt: int) -> Sequence:
    return Sequence(f"s{order}", list(range(1, prompt + 1)), SamplingParams(max_tokens=64), order=order)


def _run(scheduler: Scheduler) -> list[tuple[str, int]]:
    """Plan one step and pretend it ran: the chunks are computed, finished prompts get a token."""
    plan = scheduler.schedule()
    for chunk in plan:
        chunk.seq.computed += chunk.tokens
        if chunk.seq.pending == 0:
            chunk.seq.output_ids.append(7)
    return [(c.seq.seq_id, c.tokens) for c in plan]


def test_prompts_are_chunked_under_the_budget_and_decodes_go_first() -> None:
    scheduler = Scheduler(BlockManager(64, 4, 0), max_num_seqs=8, max_batch_tokens=10)
    scheduler.add(_seq(1, 3))
    scheduler.add(_seq(2, 12))
    assert _run(scheduler) == [("s1", 3), ("s2", 7)]
    scheduler.add(_seq(3, 4))
    assert _run(scheduler) == [("s1", 1), ("s2", 5), ("s3", 4)]  # s1 decodes first, s2 finishes its prompt
    assert _run(scheduler) == [("s1", 1), ("s2", 1), ("s3", 1)]


def test_at_most_max_num_seqs_run_and_the_rest_wait_in_order() -> None:
    scheduler = Scheduler(BlockManager(64, 4, 0), max_num_seqs=2, max_batch_tokens=100)
    for order in (1, 2, 3):
        scheduler.add(_seq(order, 2))
    assert _run(scheduler) == [("s1", 2), ("s2", 2)]
    scheduler.remove(scheduler.running[0])  # s1 finishes: its place and blocks go to s3
    assert _run(scheduler) == [("s2", 1), ("s3", 2)]
    assert scheduler.blocks.free_blocks == 64 - 2


def test_the_youngest_sequence_is_preempted_and_recomputed_later() -> None:
    blocks = BlockManager(num_blocks=4, block_size=4, sink_slots=0)
    scheduler = Scheduler(blocks, max_num_seqs=4, max_batch_tokens=100)
    scheduler.add(_seq(1, 4))
    scheduler.add(_seq(2, 8))
    assert _run(scheduler) == [("s1", 4), ("s2", 8)]  # 3 of 4 blocks
    # s1 decodes into a second block, the last free one; s2 would need a fourth: s2, the youngest, is preempted
    assert _run(scheduler) == [("s1", 1)]
    s2 = scheduler.waiting[0]
    assert s2.seq_id == "s2" and s2.computed == 0 and s2.output_ids == [7] and scheduler.preemptions == 1
    assert blocks.tables.keys() == {"s1"}
    assert _run(scheduler) == [("s1", 1)]  # s2 needs 3 blocks, 2 are free: admission waits, never preempts
    scheduler.remove(scheduler.running[0])
    assert _run(scheduler) == [("s2", 9)]  # prompt and output recomputed as one prompt
    assert blocks.free_blocks == 1


def test_a_sequence_that_cannot_grow_preempts_itself_when_it_is_the_youngest() -> None:
    blocks = BlockManager(num_blocks=2, block_size=4, sink_slots=0)
    scheduler = Scheduler(blocks, max_num_seqs=4, max_batch_tokens=100)
    scheduler.add(_seq(1, 4))
    scheduler.add(_seq(2, 4))
    _run(scheduler)
    old, young = scheduler.running
    young.output_ids.clear()
    young.computed = 3  # young decodes into its own block; old needs a new one: young goes
    assert _run(scheduler) == [("s1", 1)]
    assert [s.seq_id for s in scheduler.waiting] == ["s2"] and old.computed == 5


class _Letters:
    """A tokenizer whose token ``t`` reads as one letter (``a`` + t % 26)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + t % 26) for t in ids)


EOS = 99


def _verifying(draft: tuple[int, ...], max_tokens: int = 64) -> tuple[Scheduler, ScheduledChunk]:
    """A scheduler whose one sequence (prompt 1..5, decoding) is planned as a verification row of ``draft``."""
    scheduler = Scheduler(
        BlockManager(64, 4, 0), max_num_seqs=4, max_batch_tokens=100, stops=StopRule(frozenset({EOS}), 64, _Letters())
    )
    seq = Sequence("v", [1, 2, 3, 4, 5], SamplingParams(max_tokens=max_tokens), order=1)
    scheduler.add(seq)
    scheduler.update(scheduler.schedule(), [Sampled((6,), ((),))])  # the prompt in, token 6 chosen
    [chunk] = scheduler.schedule(lambda s: len(draft))
    assert chunk.room == len(draft)
    return scheduler, ScheduledChunk(seq, 1 + len(draft), draft=draft)


def test_an_update_keeps_the_drafts_that_held_and_drops_the_blocks_of_the_rest() -> None:
    """Issue 49 item 6: the scheduler's update does a verification row's bookkeeping: tokens through the first
    differing one appended and sent one by one, the computed count stopping before the rejected drafts, the
    blocks past them returned, the counters."""
    scheduler, chunk = _verifying((7, 8, 9, 10, 11, 13, 14))
    assert scheduler.blocks.tables["v"] == [0, 1, 2, 3]  # 6 tokens and 7 drafts, in blocks of 4
    outputs = scheduler.update([chunk], [Sampled((7, 8, 12), ((), (), ()))])  # drafts 7, 8 held; 12 != 9
    assert [(o.token_ids, o.text, o.finished, o.completion_tokens) for _, o in outputs] == [
        ((7,), "h", False, 2),
        ((8,), "i", False, 3),
        ((12,), "m", False, 4),
    ]
    seq = chunk.seq
    assert seq.output_ids == [6, 7, 8, 12] and seq.computed == 8 and seq.pending == 1
    assert scheduler.blocks.tables["v"] == [0, 1, 2]  # 9 tokens (the next one's slot too): the last block went back
    assert scheduler.blocks.free_blocks == 61
    assert (scheduler.drafted, scheduler.accepted, scheduler.generated) == (7, 2, 4)


def test_an_update_stops_a_verification_row_at_its_end_of_sequence() -> None:
    """The tokens chosen after one that ends the request are dropped, and the request's blocks are freed."""
    scheduler, chunk = _verifying((7, EOS, 9))
    outputs = scheduler.update([chunk], [Sampled((7, EOS, 9, 10), ((), (), (), ()))])
    assert [(o.token_ids, o.text, o.finish_reason) for _, o in outputs] == [((7,), "h", None), ((EOS,), "", "stop")]
    assert chunk.seq.output_ids == [6, 7, EOS] and scheduler.running == [] and "v" not in scheduler.blocks.tables
    assert (scheduler.drafted, scheduler.accepted, scheduler.finished) == (3, 1, 1)
