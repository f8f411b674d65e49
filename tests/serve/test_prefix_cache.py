"""Prefix caching, in the block manager: names chained over the prefix, shared blocks, idle blocks, eviction."""

from __future__ import annotations

import pytest
import torch

from squeeze.serve.engine.blocks import BlockManager
from squeeze.serve.engine.prefix_cache import PrefixCache, block_names, cache_root
from squeeze.serve.engine.runner import step_slots


def test_a_block_name_covers_its_tokens_and_every_token_before_them() -> None:
    root = cache_root("int4", 4)
    a = block_names(root, list(range(10)), 4)
    assert len(a) == 2  # full blocks only
    assert block_names(root, [*range(8), 99, 98], 4) == a  # the partial tail is not named
    b = block_names(root, [0, 1, 2, 7, *range(4, 8)], 4)
    assert b[0] != a[0] and b[1] != a[1]  # same tokens 4..7, another prefix
    assert block_names(cache_root("int8", 8), list(range(8)), 4) != a  # other settings
    cache = PrefixCache(4, "int4")
    assert cache.names(list(range(8))) == block_names(cache_root(4, "int4"), list(range(8)), 4)


def _cached_manager(blocks: int = 6, sink_slots: int = 2, sink_tokens: int = 2) -> BlockManager:
    return BlockManager(blocks, 4, sink_slots, sink_tokens=sink_tokens, prefix_cache=PrefixCache(4, "test"))


def _run(manager: BlockManager, seq_id: str, names: list[bytes], tokens: int) -> list[int]:
    """Admit ``seq_id`` with what is cached, compute all its tokens, name its blocks; its cached blocks."""
    cached = manager.cached(names, tokens)
    manager.admit(seq_id, cached, tokens)
    manager.commit(seq_id, names, tokens)
    manager.check()
    return cached


def test_a_shared_prefix_is_held_by_both_and_idles_in_the_cache_once_released() -> None:
    manager = _cached_manager()
    names = block_names(b"r", list(range(12)), 4)  # 3 full blocks; the sink is 2 tokens: in block 0
    assert _run(manager, "a", names, 12) == []
    # b: the same 12 tokens and 2 more; a fully cached prompt recomputes its last block's tokens
    assert _run(manager, "b", names, 14) == manager.tables["a"]
    assert manager.tables["b"][:3] == manager.tables["a"] and manager.sinks["b"] == manager.sinks["a"]
    c = _run(manager, "c", names, 12)
    assert c == manager.tables["a"][:2] and manager.tables["c"][2] not in manager.tables["a"]  # its last token
    assert manager.free_blocks == 6 - 3 - 1 - 1 and manager.cached_blocks == 0
    manager.release("a")
    manager.release("c")
    assert manager.free_blocks == 6 - 4 and manager.cached_blocks == 0  # b still holds a's blocks
    manager.release("b")
    manager.check()
    assert manager.free_blocks == 6 and manager.cached_blocks == 3  # a's named blocks idle, the rest free
    first = manager.cached(names, 12)[0]
    assert manager._sink_of == {first: 0} and list(manager._free_sinks) == [1]  # a's first block keeps its entry


def test_idle_blocks_are_evicted_tail_first_when_the_pool_needs_them() -> None:
    manager = _cached_manager(blocks=4, sink_slots=2)
    names = block_names(b"r", list(range(16)), 4)
    _run(manager, "a", names, 16)
    table = list(manager.tables["a"])
    manager.release("a")
    assert manager.cached_blocks == 4 and manager.free_blocks == 4
    other = block_names(b"r", [9] * 8, 4)
    _run(manager, "b", other, 6)  # 2 blocks: a's last two go, its first two stay reusable
    assert set(manager.tables["b"]) == set(table[2:])
    assert manager.cached(names, 16) == table[:2]
    manager.release("b")  # its first block is named, its second free
    _run(manager, "c", names, 9)
    assert manager.tables["c"][:2] == table[:2] and manager.cached_blocks == 1
    manager.release("c")
    manager.check()
    assert manager.free_blocks == 4


def test_a_held_block_is_never_evicted_and_admission_counts_idle_hits_as_taken() -> None:
    manager = _cached_manager(blocks=3, sink_slots=2)
    names = block_names(b"r", list(range(8)), 4)
    _run(manager, "a", names, 9)  # 3 blocks, 2 named
    manager.release("a")
    assert manager.cached_blocks == 2 and manager.free_blocks == 3
    cached = manager.cached(names, 9)
    assert len(cached) == 2
    assert not manager.can_admit("b", cached, 13)  # 2 cached + 2 new: only 1 block is left once they are held
    manager.admit("b", cached, 12)
    assert not manager.can_grow("x", 1)  # every block is held: nothing to evict
    with pytest.raises(RuntimeError, match="exhausted"):
        manager.grow("x", 1)
    manager.check()


def test_a_hit_must_cover_every_sink_token_and_takes_the_first_blocks_sink_entry() -> None:
    manager = _cached_manager(blocks=8, sink_slots=2, sink_tokens=6)  # the sink spans 2 blocks
    names = block_names(b"r", list(range(12)), 4)
    _run(manager, "a", names, 12)
    assert manager.cached(names[:1], 12) == []  # one block: not all the sink tokens
    assert len(manager.cached(names, 12)) == 2
    # sink entries: the two running sequences hold both; a third sequence must wait for one
    _run(manager, "b", block_names(b"r", [5] * 4, 4), 4)
    assert not manager.can_admit("c", [], 4)
    manager.release("a")  # its first block idles with its entry: a new sequence takes it by evicting that block
    assert manager.can_admit("c", [], 4)
    _run(manager, "c", block_names(b"r", [6] * 4, 4), 4)
    assert manager.cached(names, 12) == []  # a's prefix lost its first block
    manager.release("b")
    manager.release("c")
    manager.check()
    assert manager.free_blocks == 8


def test_without_a_cache_nothing_is_shared_or_kept() -> None:
    manager = BlockManager(4, 4, 1)
    names = block_names(b"r", list(range(8)), 4)
    assert manager.cached(names, 9) == []
    manager.admit("a", [], 9)
    manager.commit("a", names, 9)
    manager.release("a")
    assert manager.free_blocks == 4 and manager.cached_blocks == 0
    manager.check()


def test_step_slots_follow_the_block_tables() -> None:
    manager = BlockManager(num_blocks=8, block_size=4, sink_slots=0)
    manager.grow("a", 3)
    manager.grow("b", 5)
    manager.grow("a", 10)
    rows = [("a", 6, 10), ("b", 0, 5)]
    tables = [manager.table_tensor(s)[: manager.blocks_for(end)] for s, _, end in rows]
    read, read_pos, new, new_pos = step_slots(tables, [r[1] for r in rows], [r[2] for r in rows], 4)
    want_read = manager.slots("a", 0, 10) + manager.slots("b", 0, 5)
    assert read.tolist() == want_read and read.dtype == torch.long
    assert read_pos.tolist() == [*range(10), *range(5)]
    assert new.tolist() == manager.slots("a", 6, 10) + manager.slots("b", 0, 5)
    assert new_pos.tolist() == [*range(6, 10), *range(5)]
