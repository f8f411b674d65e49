"""Block tables: growth, slots, release, exhaustion."""

from __future__ import annotations

import pytest

from squeeze.serve.engine.blocks import BlockManager


def test_blocks_grow_lazily_and_slots_follow_the_table() -> None:
    blocks = BlockManager(num_blocks=4, block_size=4, sink_slots=2)
    blocks.grow("a", 3)
    blocks.grow("b", 5)
    blocks.grow("a", 6)
    assert blocks.tables == {"a": [0, 3], "b": [1, 2]}
    assert blocks.slots("a", 2, 6) == [2, 3, 12, 13]
    assert blocks.free_blocks == 0 and blocks.allocated_tokens() == 16
    assert set(blocks.sinks.values()) == {0, 1}
    assert not blocks.can_grow("a", 9)
    with pytest.raises(RuntimeError, match="exhausted"):
        blocks.grow("a", 9)
    blocks.release("b")
    blocks.release("b")  # idempotent
    assert blocks.free_blocks == 2 and "b" not in blocks.sinks
    blocks.grow("c", 8)
    assert blocks.tables["c"] == [1, 2] and blocks.sinks["c"] == 1


def test_a_new_sequence_needs_a_sink_entry_when_sinks_are_used() -> None:
    blocks = BlockManager(num_blocks=8, block_size=4, sink_slots=1)
    blocks.grow("a", 1)
    assert not blocks.can_grow("b", 1)  # blocks free, but no sink entry
    assert BlockManager(8, 4, sink_slots=0).can_grow("b", 1)
