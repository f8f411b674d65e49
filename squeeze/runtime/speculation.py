"""Speculative decoding over the same weights: the option, the n-gram drafter and the per-step draft length.

A drafter proposes up to k next tokens cheaply; one step of the exact path then feeds the newest token and
the k drafts together (k + 1 queries of one row) and yields the exact next token at every one of those
positions. The drafts are kept while they equal the exact tokens; the first exact token that differs (or the
one after the last draft) is kept too, so a step yields between 1 and k + 1 tokens, and every one of them is
the token plain decoding would have chosen:

* greedy: each position's token is the argmax of exact logits whose bits do not depend on how many queries
  the step held (the quantized linears and the LM head are batch-invariant; the native attention kernel
  attends every query of a row over its own prefix alone; the SDPA path attends them one at a time);
* sampling: the token at each position is drawn from the request's own generator exactly as plain decoding
  draws it, and drawing stops at the first draw that differs from the draft. For a drafter that proposes
  one token (probability 1), that is standard rejection sampling (accept with p(draft); on rejection a draw
  from p without the draft), and it consumes the generator as plain decoding does: a seeded request gives
  the same tokens with and without speculation.

Drafters (:class:`SpeculationOptions`):

* ``ngram:K``: prompt lookup, as vLLM's: the longest suffix of the tokens so far (``NGRAM_MAX`` tokens down
  to ``NGRAM_MIN``) that occurred before proposes the K tokens that followed its latest earlier occurrence.
  Free to compute; it pays where outputs copy their prompt (summaries, code edits, extraction).
* ``int8:K``: K tokens decoded greedily by the W4A8 path over the same weights and KV cache (QSpec): the
  quantized linears run their int8-activation form (squeeze.runtime.linear.drafting), the rest is unchanged.

Under load, verifying k drafts per row costs k more rows of real compute; :func:`draft_length` turns the
draft down as rows grow and off beyond a few. Torch-free: ``squeeze.api`` checks the option before loading.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from squeeze.errors import ConfigError

Drafter = Literal["off", "ngram", "int8"]
DRAFTERS: tuple[Drafter, ...] = ("off", "ngram", "int8")
#: Draft tokens per step at most (one step then feeds up to 17 tokens per row).
MAX_DRAFT = 16
#: Longest and shortest suffix the n-gram drafter looks up.
NGRAM_MAX, NGRAM_MIN = 4, 2
#: Query rows one step may verify across its batch: the per-row draft shrinks as rows grow (16: one row drafts
#: up to 15, two rows 7 each, four rows 3, eight rows 1, nine or more none). A decode step of a few rows costs
#: little more than one row (the weights are read once per step); beyond that the drafts' rows are real compute
#: that a rejected draft wastes. Measured (docs/benchmarks/serving.md): with 8, ngram:8 gave 1.45x at one
#: client; with 16, ngram:12 gave 1.65x, and 16 clients stayed at 1.0x either way.
VERIFY_ROWS = 16
_EXAMPLE = "e.g. --speculate ngram:12, --speculate int8:3 or --speculate off"


@dataclass(frozen=True)
class SpeculationOptions:
    """How decoding speculates: ``drafter`` ("off", "ngram" or "int8") and ``k`` tokens drafted per step at most.

    Checked when built (ConfigError naming ``--speculate``); :meth:`parse` reads the CLI's ``KIND:K`` form."""

    drafter: Drafter = "off"
    k: int = 8

    def __post_init__(self) -> None:
        if self.drafter not in DRAFTERS:
            raise ConfigError(
                f"--speculate drafter must be one of {', '.join(DRAFTERS)}, found {self.drafter!r}", hint=_EXAMPLE
            )
        if isinstance(self.k, bool) or not isinstance(self.k, int) or not 1 <= self.k <= MAX_DRAFT:
            raise ConfigError(f"--speculate needs 1 to {MAX_DRAFT} draft tokens, found {self.k!r}", hint=_EXAMPLE)

    @property
    def enabled(self) -> bool:
        return self.drafter != "off"

    @classmethod
    def parse(cls, value: str | SpeculationOptions | None) -> SpeculationOptions:
        """``"off"``, ``"ngram:K"``, ``"int8:K"`` (K defaults to 8), an options object, or None (off)."""
        if value is None:
            return cls()
        if isinstance(value, SpeculationOptions):
            return value
        if not isinstance(value, str):
            raise ConfigError(f"--speculate takes KIND:K, found {type(value).__name__}", hint=_EXAMPLE)
        kind, sep, count = value.strip().partition(":")
        if kind == "off" and not sep:
            return cls()
        if kind not in DRAFTERS or kind == "off":
            raise ConfigError(f"--speculate takes ngram:K, int8:K or off, found {value!r}", hint=_EXAMPLE)
        if not sep:
            return cls(kind)
        try:
            k = int(count)
        except ValueError:
            raise ConfigError(f"--speculate's K must be a whole number, found {count!r}", hint=_EXAMPLE) from None
        return cls(kind, k)

    def __str__(self) -> str:
        return "off" if not self.enabled else f"{self.drafter}:{self.k}"


def draft_length(k: int, rows: int) -> int:
    """Draft tokens per row for a step that verifies ``rows`` decoding rows, at most ``k`` (0: no drafts)."""
    if rows <= 0:
        return 0
    return max(0, min(k, VERIFY_ROWS // rows - 1))


@dataclass
class NgramIndex:
    """Prompt lookup over one sequence's tokens, kept up to date as tokens are appended.

    ``latest[n][gram]``: the end (exclusive) of the latest occurrence of each ``n``-token gram, excluding the
    sequence's own final gram, which is what is looked up. Adding a token costs one dict write per gram
    length; a lookup, one dict read per length."""

    tokens: list[int] = field(default_factory=list)
    latest: dict[int, dict[tuple[int, ...], int]] = field(
        default_factory=lambda: {n: {} for n in range(NGRAM_MIN, NGRAM_MAX + 1)}
    )

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self._index_final()
            self.tokens.append(int(token))

    def _index_final(self) -> None:
        """Record the grams ending at the current end (called before a token is appended: they stop being final)."""
        end = len(self.tokens)
        for n, table in self.latest.items():
            if end >= n:
                table[tuple(self.tokens[end - n :])] = end

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest matching suffix."""
        end = len(self.tokens)
        for n in range(NGRAM_MAX, NGRAM_MIN - 1, -1):
            if end < n:
                continue
            start = self.latest[n].get(tuple(self.tokens[end - n :]))
            if start is not None:
                return self.tokens[start : min(start + k, end)]
        return []


__all__ = [
    "DRAFTERS",
    "MAX_DRAFT",
    "NGRAM_MAX",
    "NGRAM_MIN",
    "VERIFY_ROWS",
    "Drafter",
    "NgramIndex",
    "SpeculationOptions",
    "draft_length",
]
