"""One request inside the engine: its tokens, how far its KV cache is computed, and the text it has produced.

A sequence's tokens are its prompt followed by every token chosen so far; ``computed`` of them have their
keys and values in the paged cache. Feeding ``tokens[computed:]`` (a prompt chunk, or the one newest token
when decoding) brings it up to date; a preempted sequence loses its cache (``computed = 0``) and later
recomputes all its tokens, prompt and output alike, exactly as one long prompt.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from squeeze.serve.types import FinishReason, SamplingParams


@dataclass
class TextState:
    """Incremental detokenization of a sequence's output with stop strings.

    Text is produced like transformers' TextStreamer (decode every output token so far, emit the new
    suffix), holding back a trailing incomplete character and any tail that may still become a stop string,
    so the pieces concatenate to exactly the final text (which ends before the first stop string).
    """

    stop: tuple[str, ...]
    emitted: int = 0
    text: str = ""

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
        self.text = text
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


@dataclass
class Sequence:
    """A request as the scheduler sees it (see the module docstring). ``order``: arrival rank (lower is older)."""

    seq_id: str
    prompt_ids: list[int]
    params: SamplingParams
    order: int
    arrival: float = field(default_factory=time.perf_counter)
    output_ids: list[int] = field(default_factory=list)
    computed: int = 0
    generator: torch.Generator | None = None
    text: TextState = field(default_factory=lambda: TextState(()))
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_reason: FinishReason | None = None
    preemptions: int = 0

    def __post_init__(self) -> None:
        self.text = TextState(self.params.stop)
        if self.params.temperature > 0:
            self.generator = torch.Generator()
            if self.params.seed is not None:
                self.generator.manual_seed(self.params.seed)
            else:
                self.generator.seed()

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def pending(self) -> int:
        """Tokens to feed before the next one can be chosen."""
        return self.length - self.computed


__all__ = ["Sequence", "TextState"]
