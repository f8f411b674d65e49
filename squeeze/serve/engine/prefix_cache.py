"""Prefix caching: full KV blocks of prompt tokens, found again by a name chained over the prefix.

Block ``i`` of a prompt is named ``sha256(name of block i-1 | the block's token ids)``; block 0's parent is
a root that folds in everything else that decides what the block stores: the pool's cache (bits, kind,
sink tokens, block size, dtype). Two
prompts give block ``i`` the same name exactly when they share its tokens and every token before it under
the same settings; its keys and values were then computed from the same tokens at the same positions (a
rotating key centre included: squeeze.quant.kv.KeyRotation), so the quantized codes are reused as they
are: the bits a whole prefill stores. The rest of the prompt is then computed as a chunk over them, which
gives a whole prefill's bits only where attention and the linears are invariant to the number of queries
(the test models; on SmolLM2 they differ by float rounding: docs/guide/serve.md). The pool belongs to
one server run: a cache with other settings is another pool, never reused.

Only full blocks of prompt tokens are named (generated tokens were computed one step at a time, a prompt
as one prefill: their bits may differ), and a request always computes its last prompt token (it needs
that token's logits), so a hit stops at the block before the one holding it: a request never writes into
a block it shares, and no copy on write is needed. The block manager (squeeze.serve.engine.blocks) counts who
holds each block; this module only knows names and the blocks nobody holds that are still named (the
least recently released is evicted first when the pool needs a block).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence as Seq


def cache_root(*settings: object) -> bytes:
    """The parent name of every prompt's block 0 under ``settings`` (anything whose ``repr`` is stable)."""
    return hashlib.sha256(repr(settings).encode()).digest()


def block_names(root: bytes, token_ids: Seq[int], block_size: int) -> list[bytes]:
    """The names of the full blocks of ``token_ids`` (``len // block_size`` of them), 32-byte digests."""
    names: list[bytes] = []
    parent = root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        digest = hashlib.sha256(parent)
        digest.update(array("q", token_ids[start : start + block_size]).tobytes())
        parent = digest.digest()
        names.append(parent)
    return names


class PrefixCache:
    """Named blocks (``name -> block``) and, among them, those no sequence holds, least recently released
    first. Counts the tokens looked up and found (Prometheus: ``squeeze_prefix_cache_*_total``).

    ``block_size``: tokens per block; ``settings``: what decides a block's contents besides its tokens
    (the pool's cache kind, bits, sink tokens, dtype: see the module docstring), folded into every name.
    """

    def __init__(self, block_size: int, *settings: object) -> None:
        self.block_size = block_size
        self._root = cache_root(block_size, *settings)
        self._block_of: dict[bytes, int] = {}
        self._name_of: dict[int, bytes] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # named, held by nobody: evictable, LRU first
        self.queries = 0
        self.hits = 0

    def names(self, prompt_ids: Seq[int]) -> list[bytes]:
        """The names of a prompt's full blocks."""
        return block_names(self._root, prompt_ids, self.block_size)

    def __len__(self) -> int:
        """Named blocks, held or not."""
        return len(self._name_of)

    @property
    def idle(self) -> int:
        """Named blocks no sequence holds (free to evict)."""
        return len(self._idle)

    def lookup(self, names: Seq[bytes], limit: int) -> list[int]:
        """The blocks of the longest prefix of ``names`` (at most ``limit``) that is cached."""
        found: list[int] = []
        for name in names[:limit]:
            block = self._block_of.get(name)
            if block is None:
                break
            found.append(block)
        return found

    def name(self, block: int, name: bytes) -> bool:
        """Give ``block`` (just computed, held) ``name``; False when another block has it already (that one
        stays cached, and this one is freed when released)."""
        if name in self._block_of or block in self._name_of:
            return False
        self._block_of[name] = block
        self._name_of[block] = name
        return True

    def named(self, block: int) -> bool:
        return block in self._name_of

    def is_idle(self, block: int) -> bool:
        return block in self._idle

    def park(self, block: int) -> None:
        """``block`` (named) is held by nobody now: evictable, most recently released."""
        self._idle[block] = None

    def take(self, block: int) -> None:
        """A sequence holds ``block`` again: no longer evictable (a no-op when it was held)."""
        self._idle.pop(block, None)

    def oldest_idle(self) -> list[int]:
        """The evictable blocks, least recently released first."""
        return list(self._idle)

    def evict(self, block: int | None = None) -> int:
        """Forget ``block`` (default: the least recently released idle one) and return it. KeyError when it is
        not idle."""
        if block is None:
            block = next(iter(self._idle))
        del self._idle[block]
        del self._block_of[self._name_of.pop(block)]
        return block

    def record(self, queried: int, hit: int) -> None:
        """A request asked for ``queried`` tokens and found ``hit`` of them cached."""
        self.queries += queried
        self.hits += hit


__all__ = ["cache_root", "block_names", "PrefixCache"]
