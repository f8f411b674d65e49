"""Text of generated tokens as it is produced: pieces that concatenate to exactly the final text."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class TextState:
    """Incremental detokenization of a sequence's output, with stop strings (``squeeze run``'s streamed
    text and ``squeeze serve``'s updates).

    Text is produced like transformers' TextStreamer (decode every output token so far, emit the new
    suffix), holding back a trailing incomplete character and any tail that may still become a stop string,
    so the pieces concatenate to exactly the final text (which ends before the first stop string).
    """

    stop: tuple[str, ...] = ()
    emitted: int = 0

    def update(self, tokenizer: Any, ids: list[int], final: bool) -> tuple[str, bool]:
        """The new piece of text after ``ids`` (all output ids, end-of-sequence excluded), and whether a stop
        string ended it."""
        text = tokenizer.decode(ids, skip_special_tokens=True)
        cut = min((at for at in (text.find(stop) for stop in self.stop) if at != -1), default=-1)
        stopped = cut != -1
        if stopped:
            text = text[:cut]
        ready = len(text)
        if not (final or stopped):
            ready = len(text.rstrip("\ufffd"))  # a multi-byte character whose bytes have not all arrived
            ready -= _held_back(text[:ready], self.stop)
        piece = text[self.emitted : ready] if ready > self.emitted else ""
        self.emitted = max(self.emitted, ready)
        return piece, stopped


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


__all__ = ["TextState"]
