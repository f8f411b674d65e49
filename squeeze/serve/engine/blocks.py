"""Which KV blocks and sink entries each sequence holds: reference counts, block tables, token slots.

A sequence's block table lists its blocks in order; its token at position ``p`` lives in slot
``table[p // block_size] * block_size + p % block_size`` of the pool (squeeze.serve.engine.kv_pool). Blocks are
counted: a block holding a cached prompt prefix (squeeze.serve.engine.prefix_cache) may be in several tables at
once. A block nobody holds is free: in the free list, or, when it still holds a named prefix block, idle
in the prefix cache until it is reused or evicted (least recently released first) for a block the pool
needs. So after any run every block is free again, and the idle ones are counted apart
(:attr:`BlockManager.cached_blocks`).

A quantized pool also keeps every sequence's first ``sink_tokens`` tokens in full precision, in a sink
entry (one of ``sink_slots``, the engine's max_num_seqs). An entry belongs to the first block of a table:
sequences that share that block (a cached prefix covering every sink token) share its entry, and an idle
cached first block keeps its entry until it is evicted. Running sequences hold at most one entry each, so
a sequence admitted while fewer than ``sink_slots`` run always finds one (free, or taken from an idle block).

Each table is also kept as an int64 tensor, grown as blocks are added (:meth:`BlockManager.table_tensor`),
so a step builds its slot indices with tensor operations rather than a Python loop over every row's history.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence as Seq

import torch
from torch import Tensor

from squeeze.serve.engine.prefix_cache import PrefixCache


class BlockManager:
    """Hands out ``num_blocks`` KV blocks of ``block_size`` tokens and ``sink_slots`` sink entries (holding
    ``sink_tokens`` tokens each); with a ``prefix_cache``, full prompt blocks are shared and kept."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        sink_slots: int,
        *,
        sink_tokens: int = 1,
        prefix_cache: PrefixCache | None = None,
    ):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a KV pool needs blocks, found {num_blocks} of {block_size} tokens")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.cache = prefix_cache
        self._free: deque[int] = deque(range(num_blocks))
        self._free_sinks: deque[int] = deque(range(sink_slots))
        self._uses_sinks = sink_slots > 0  # full-precision pools keep no sink
        # a hit must cover every sink token or none: a sequence writes the sink entry only of a fresh first block
        self._sink_blocks = self.blocks_for(sink_tokens) if self._uses_sinks else 0
        self._refs = [0] * num_blocks
        self._sink_of: dict[int, int] = {}  # first block of a table -> its sink entry
        self._idle_sinks: OrderedDict[int, None] = OrderedDict()  # idle cached blocks with an entry, LRU first
        self._named: dict[str, int] = {}  # per sequence: leading blocks already offered to the cache
        self._tensors: dict[str, Tensor] = {}
        self.tables: dict[str, list[int]] = {}
        self.sinks: dict[str, int] = {}

    @property
    def free_blocks(self) -> int:
        """Blocks no sequence holds (the cached ones among them: :attr:`cached_blocks`)."""
        return len(self._free) + self.cached_blocks

    @property
    def cached_blocks(self) -> int:
        """Blocks no sequence holds that still hold a cached prompt prefix (reused, or evicted when needed)."""
        return self.cache.idle if self.cache is not None else 0

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold ``tokens`` tokens."""
        return -(-tokens // self.block_size)

    def extra_blocks(self, seq_id: str, tokens: int) -> int:
        """Blocks ``seq_id`` still needs to hold ``tokens`` tokens in all."""
        return max(0, self.blocks_for(tokens) - len(self.tables.get(seq_id, ())))

    # --- admission --------------------------------------------------------------------------------------

    def cached(self, names: Seq[bytes], tokens: int) -> list[int]:
        """The cached blocks a new sequence of ``tokens`` tokens whose full prompt blocks are ``names``
        (squeeze.serve.engine.prefix_cache.block_names) can start from: never the block of its last token (it must
        compute that token), and none unless they cover every sink token. Takes nothing."""
        if self.cache is None or tokens < 1:
            return []
        found = self.cache.lookup(names, min(len(names), (tokens - 1) // self.block_size))
        return found if len(found) >= self._sink_blocks else []

    def can_admit(self, seq_id: str, cached: Seq[int], tokens: int) -> bool:
        """Whether :meth:`admit` would succeed now."""
        if seq_id in self.tables:
            return self.can_grow(seq_id, tokens)
        idle_taken = sum(self.cache.is_idle(b) for b in cached) if self.cache is not None else 0
        needed = self.blocks_for(tokens) - len(cached)
        if needed > self.free_blocks - idle_taken:
            return False
        return bool(cached) or not self._uses_sinks or bool(self._free_sinks or self._idle_sinks)

    def admit(self, seq_id: str, cached: Seq[int], tokens: int) -> None:
        """Start ``seq_id``'s table with the ``cached`` blocks (from :meth:`cached`) and grow it to ``tokens``
        tokens; it takes its sink entry (that of its first cached block, else a fresh one). RuntimeError when
        the pool is short (check :meth:`can_admit` first)."""
        if seq_id in self.tables:
            raise RuntimeError(f"sequence {seq_id} already holds blocks")
        if not self.can_admit(seq_id, cached, tokens):
            raise RuntimeError(f"KV pool exhausted admitting {seq_id} with {tokens} tokens")
        for block in cached:
            self._hold(block)
        self.tables[seq_id] = []
        self._named[seq_id] = len(cached)
        self._append(seq_id, list(cached))
        if self._uses_sinks:
            self.sinks[seq_id] = self._sink_of[cached[0]] if cached else self._new_sink()
        self.grow(seq_id, tokens)
        if self._uses_sinks and not cached:
            self._sink_of[self.tables[seq_id][0]] = self.sinks[seq_id]

    # --- growth and release -----------------------------------------------------------------------------

    def can_grow(self, seq_id: str, tokens: int) -> bool:
        """Whether :meth:`grow` to ``tokens`` would succeed now (a new sequence also needs a sink entry)."""
        if seq_id not in self.tables:
            return self.can_admit(seq_id, (), tokens)
        return self.extra_blocks(seq_id, tokens) <= self.free_blocks

    def grow(self, seq_id: str, tokens: int) -> None:
        """Give ``seq_id`` enough blocks for ``tokens`` tokens (a new sequence: :meth:`admit` with nothing
        cached). Check :meth:`can_grow` first: RuntimeError when the pool is short."""
        if seq_id not in self.tables:
            self.admit(seq_id, (), tokens)
            return
        if not self.can_grow(seq_id, tokens):
            raise RuntimeError(f"KV pool exhausted growing {seq_id} to {tokens} tokens")
        extra = self.extra_blocks(seq_id, tokens)
        if extra:
            self._append(seq_id, [self._new_block() for _ in range(extra)])

    def shrink(self, seq_id: str, tokens: int) -> None:
        """Keep only the blocks ``seq_id``'s first ``tokens`` tokens need (at least one); the rest go back to the
        pool (speculative decoding's rejected drafts: their blocks were never named in the prefix cache, which
        names full prompt blocks only)."""
        table = self.tables.get(seq_id)
        keep = max(1, self.blocks_for(tokens))
        if table is None or len(table) <= keep:
            return
        for block in table[keep:]:
            self._refs[block] -= 1
            if self._refs[block] == 0 and not (self.cache is not None and self.cache.named(block)):
                self._free.append(block)
        del table[keep:]

    def release(self, seq_id: str) -> None:
        """Drop ``seq_id``'s hold on its blocks and sink entry (a no-op when it holds none). A block nobody
        holds any more goes to the free list, or idles in the prefix cache when it is named there."""
        table = self.tables.pop(seq_id, [])
        self.sinks.pop(seq_id, None)
        self._named.pop(seq_id, None)
        self._tensors.pop(seq_id, None)
        for block in table:
            self._refs[block] -= 1
            if self._refs[block] == 0 and not (self.cache is not None and self.cache.named(block)):
                self._free.append(block)
                entry = self._sink_of.pop(block, None)
                if entry is not None:
                    self._free_sinks.append(entry)
        # the table's tail first: evicted before the prefix it extends, which more requests share
        for block in reversed(table):
            if self._refs[block] == 0 and self.cache is not None and self.cache.named(block):
                self.cache.park(block)
                if block in self._sink_of:
                    self._idle_sinks[block] = None

    def commit(self, seq_id: str, names: Seq[bytes], computed: int) -> None:
        """``seq_id`` has ``computed`` tokens in the pool: name its full prompt blocks among them (``names``,
        one per full prompt block) in the prefix cache, so that later requests can reuse them."""
        if self.cache is None or seq_id not in self.tables:
            return
        start, stop = self._named[seq_id], min(len(names), computed // self.block_size)
        table = self.tables[seq_id]
        for index in range(start, stop):
            self.cache.name(table[index], names[index])
        self._named[seq_id] = max(start, stop)

    # --- slots ------------------------------------------------------------------------------------------

    def slots(self, seq_id: str, start: int, stop: int) -> list[int]:
        """Token slots of positions ``start..stop-1`` of ``seq_id`` (its blocks must cover them)."""
        table, size = self.tables[seq_id], self.block_size
        return [table[p // size] * size + p % size for p in range(start, stop)]

    def table_tensor(self, seq_id: str) -> Tensor:
        """``seq_id``'s block table as an int64 CPU tensor (a view: do not keep it past the next growth)."""
        return self._tensors[seq_id][: len(self.tables[seq_id])]

    def allocated_tokens(self) -> int:
        """Token slots in blocks held by sequences (live or not yet written)."""
        return (self.num_blocks - self.free_blocks) * self.block_size

    def check(self) -> None:
        """RuntimeError when the books do not balance: every block held (counted once per table holding it),
        free or idle in the cache, exactly once; sink entries those of the tables' first blocks, or free."""
        refs = [0] * self.num_blocks
        for table in self.tables.values():
            for block in table:
                refs[block] += 1
        idle = set(self.cache.oldest_idle()) if self.cache is not None else set()
        free = set(self._free)
        problems = []
        if refs != self._refs:
            problems.append("reference counts differ from the tables")
        held = {b for b in range(self.num_blocks) if refs[b]}
        if held & (idle | free) or idle & free or len(held) + len(idle) + len(free) != self.num_blocks:
            problems.append("a block is held and free, or neither")
        if len(free) != len(self._free):
            problems.append("a block is twice in the free list")
        for seq_id, entry in self.sinks.items():
            if self._sink_of.get(self.tables[seq_id][0]) != entry:
                problems.append(f"{seq_id}'s sink entry is not its first block's")
        bound = set(self._sink_of.values())
        if bound & set(self._free_sinks) or len(bound) != len(self._sink_of):
            problems.append("a sink entry is bound twice, or bound and free")
        if problems:
            raise RuntimeError("block manager inconsistent: " + "; ".join(problems))

    # --- internals --------------------------------------------------------------------------------------

    def _hold(self, block: int) -> None:
        self._refs[block] += 1
        if self._refs[block] == 1 and self.cache is not None:
            self.cache.take(block)
            self._idle_sinks.pop(block, None)

    def _new_block(self) -> int:
        """A block for new tokens: a free one, else the least recently released idle cached block."""
        if self._free:
            block = self._free.popleft()
        else:
            if self.cache is None:
                raise RuntimeError("KV pool exhausted")
            block = self.cache.evict()
            self._idle_sinks.pop(block, None)
            entry = self._sink_of.pop(block, None)
            if entry is not None:
                self._free_sinks.append(entry)
        self._refs[block] = 1
        return block

    def _new_sink(self) -> int:
        """A sink entry: a free one, else that of the least recently released idle cached first block
        (evicted: its prefix can no longer be read back without its sink tokens)."""
        if self._free_sinks:
            return self._free_sinks.popleft()
        if self.cache is None or not self._idle_sinks:
            raise RuntimeError("no sink entry left")
        block, _ = self._idle_sinks.popitem(last=False)
        self.cache.evict(block)
        self._free.append(block)
        return self._sink_of.pop(block)

    def _append(self, seq_id: str, blocks: list[int]) -> None:
        table = self.tables[seq_id]
        n, k = len(table), len(blocks)
        tensor = self._tensors.get(seq_id)
        if tensor is None or n + k > tensor.numel():
            grown = torch.empty(max(16, 2 * (n + k)), dtype=torch.long)
            if tensor is not None:
                grown[:n] = tensor[:n]
            self._tensors[seq_id] = tensor = grown
        if k:
            tensor[n : n + k] = torch.tensor(blocks, dtype=torch.long)
        table.extend(blocks)


__all__ = ["BlockManager"]
