"""Text of generated tokens as it is produced, read after the tokens before them (the prompt's last few), in
pieces that concatenate to exactly the final text.

A token's text depends on what precedes it: a SentencePiece tokenizer (Llama 2, Mistral, Gemma) writes a
word's leading space only when the word is not the first thing decoded, and a byte-fallback or byte-level
tokenizer needs every byte of a character. So the output is decoded after a few of the tokens before it
(vLLM's detokenizer does the same with its prefix offset) and the text is what that decode adds: a
completion appended to its prompt then reads as ``decode(prompt + completion)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

#: Tokens before the output decoded with it as its left context (vLLM's detokenizer reads 5): enough for the
#: first output token's leading space and for the bytes of a character that began before it.
CONTEXT_TOKENS = 6

#: What a decode writes for the bytes of a character that have not all arrived.
INCOMPLETE = "\ufffd"


def left_context(ids: Sequence[int]) -> tuple[int, ...]:
    """The ids the text of the tokens after ``ids`` is read after: the last :data:`CONTEXT_TOKENS` of them."""
    return tuple(int(i) for i in ids[-CONTEXT_TOKENS:])


def char_start(decode: Callable[[list[int]], str], ids: Sequence[int], start: int) -> int:
    """The first index from ``start`` at which ``ids`` decode from the start of a character: a window that
    begins inside one decodes its orphan bytes as U+FFFD, and a SentencePiece byte-fallback decoder then writes
    every byte token in the same run as U+FFFD, the whole characters around them included. A token is passed
    over only when that leaves fewer leading U+FFFD (at most 3: a character's continuation bytes), so a text
    that holds U+FFFD itself keeps its context."""
    start = max(0, start)
    lead = _leading_incomplete(decode(list(ids[start:])))
    for _ in range(3):
        if not lead or start >= len(ids):
            break
        fewer = _leading_incomplete(decode(list(ids[start + 1 :])))
        if fewer >= lead:
            break
        start, lead = start + 1, fewer
    return start


def _leading_incomplete(text: str) -> int:
    return len(text) - len(text.lstrip(INCOMPLETE))


def text_after(full: str, before: str) -> str:
    """What ``full`` (the decoded context and new tokens) adds to ``before`` (the decoded context alone).

    Where the new tokens rewrite the end of the context's text (they finish a character whose bytes began in
    the context, or a byte-fallback decoder rewrites a run of bytes while one is unfinished), the text from
    where the two first differ.
    """
    if full.startswith(before):
        return full[len(before) :]
    common = 0
    for a, b in zip(before, full, strict=False):
        if a != b:
            break
        common += 1
    return full[common:]


def continuation_text(tokenizer: Any, context: Sequence[int], ids: Sequence[int]) -> str:
    """The text ``ids`` add after ``context`` (special tokens dropped, as the output text drops them)."""
    decode = _decoder(tokenizer)
    context = list(context)[char_start(decode, context, 0) :]
    return text_after(decode([*context, *ids]), decode(context) if context else "")


@dataclass
class TextState:
    """Incremental detokenization of a sequence's output, with stop strings (``squeeze run``'s streamed
    text and ``squeeze serve``'s updates).

    Text is produced like transformers' TextStreamer (decode every output token so far, here after the
    ``context`` ids (:func:`left_context` of the prompt), emit the new suffix), holding back a trailing
    incomplete character and any tail that may still become a stop string, so the pieces concatenate to
    exactly the final text (which ends before the first stop string: stop strings are searched in the
    output's text as read in context, its leading space included).
    """

    stop: tuple[str, ...] = ()
    context: tuple[int, ...] = ()
    emitted: int = 0
    _before: str | None = field(default=None, repr=False)

    def update(self, tokenizer: Any, ids: list[int], final: bool) -> tuple[str, bool]:
        """The new piece of text after ``ids`` (all output ids, end-of-sequence excluded), and whether a stop
        string ended it."""
        if self._before is None:  # the context's own text, decoded once, from the start of a character
            self.context = self.context[char_start(_decoder(tokenizer), self.context, 0) :]
            self._before = tokenizer.decode(list(self.context), skip_special_tokens=True) if self.context else ""
        text = text_after(tokenizer.decode([*self.context, *ids], skip_special_tokens=True), self._before)
        cut = min((at for at in (text.find(stop) for stop in self.stop) if at != -1), default=-1)
        stopped = cut != -1
        if stopped:
            text = text[:cut]
        ready = len(text)
        if not (final or stopped):
            ready = len(text.rstrip(INCOMPLETE))  # a multi-byte character whose bytes have not all arrived
            ready -= _held_back(text[:ready], self.stop)
        piece = text[self.emitted : ready] if ready > self.emitted else ""
        self.emitted = max(self.emitted, ready)
        return piece, stopped


def _decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    return lambda ids: str(tokenizer.decode(ids, skip_special_tokens=True))


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


__all__ = ["CONTEXT_TOKENS", "INCOMPLETE", "TextState", "char_start", "continuation_text", "left_context", "text_after"]
