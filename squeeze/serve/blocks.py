"""Which KV blocks and sink entries each sequence holds: free lists, block tables, token slots.

A sequence's block table lists its blocks in order; its token at position ``p`` lives in slot
``table[p // block_size] * block_size + p % block_size`` of the pool (squeeze.serve.kv_pool). Blocks come
from one free list and go back to it when the sequence finishes, fails, is cancelled or is preempted, so
after any run every block is free again. A running sequence also holds one sink entry (the
full-precision area of its first tokens), from a second free list as long as the engine's max_num_seqs.
"""

from __future__ import annotations

from collections import deque


class BlockManager:
    """Hands out ``num_blocks`` KV blocks of ``block_size`` tokens and ``sink_slots`` sink entries."""

    def __init__(self, num_blocks: int, block_size: int, sink_slots: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a KV pool needs blocks, found {num_blocks} of {block_size} tokens")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._free_sinks: deque[int] = deque(range(sink_slots))
        self._uses_sinks = sink_slots > 0  # full-precision pools keep no sink
        self.tables: dict[str, list[int]] = {}
        self.sinks: dict[str, int] = {}

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold ``tokens`` tokens."""
        return -(-tokens // self.block_size)

    def extra_blocks(self, seq_id: str, tokens: int) -> int:
        """Blocks ``seq_id`` still needs to hold ``tokens`` tokens in all."""
        return max(0, self.blocks_for(tokens) - len(self.tables.get(seq_id, ())))

    def can_grow(self, seq_id: str, tokens: int) -> bool:
        """Whether :meth:`grow` to ``tokens`` would succeed now (a new sequence also needs a sink entry)."""
        needs_sink = self._uses_sinks and seq_id not in self.sinks
        return self.extra_blocks(seq_id, tokens) <= len(self._free) and (not needs_sink or bool(self._free_sinks))

    def grow(self, seq_id: str, tokens: int) -> None:
        """Give ``seq_id`` enough blocks for ``tokens`` tokens (its sink entry on first use). Check
        :meth:`can_grow` first: RuntimeError when the pool is short."""
        if not self.can_grow(seq_id, tokens):
            raise RuntimeError(f"KV pool exhausted growing {seq_id} to {tokens} tokens")
        if self._uses_sinks and seq_id not in self.sinks:
            self.sinks[seq_id] = self._free_sinks.popleft()
        table = self.tables.setdefault(seq_id, [])
        for _ in range(self.extra_blocks(seq_id, tokens)):
            table.append(self._free.popleft())

    def release(self, seq_id: str) -> None:
        """Return every block and the sink entry of ``seq_id`` (a no-op when it holds none)."""
        self._free.extend(self.tables.pop(seq_id, ()))
        sink = self.sinks.pop(seq_id, None)
        if sink is not None:
            self._free_sinks.append(sink)

    def slots(self, seq_id: str, start: int, stop: int) -> list[int]:
        """Token slots of positions ``start..stop-1`` of ``seq_id`` (its blocks must cover them)."""
        table, size = self.tables[seq_id], self.block_size
        return [table[p // size] * size + p % size for p in range(start, stop)]

    def allocated_tokens(self) -> int:
        """Token slots in blocks held by sequences (live or not yet written)."""
        return (self.num_blocks - len(self._free)) * self.block_size


__all__ = ["BlockManager"]
