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

from squeeze.runtime.speculation import NgramIndex
from squeeze.runtime.text_stream import TextState, left_context
from squeeze.serve.types import FinishReason, SamplingParams, TokenLogprob


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
    #: The names of the prompt's full blocks in the prefix cache (squeeze.serve.engine.prefix_cache), once looked up.
    block_names: list[bytes] | None = None
    #: The prompt's log-probabilities so far (requests with ``prompt_logprobs``), the first token's None.
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    #: The request's grammar matcher (xgrammar, squeeze.serve.engine.grammar), advanced with each chosen token; None
    #: without structured output. It is the sequence's: a preemption recomputes the KV and leaves it alone.
    grammar: Any = None
    #: The n-gram drafter's index over the sequence's tokens (speculative decoding with ``ngram:K``), kept up to
    #: date as tokens are chosen; None when the sequence does not speculate that way.
    ngram: NgramIndex | None = None

    def __post_init__(self) -> None:
        # the output's text is read after the prompt's last tokens (its first word's leading space, a character
        # whose bytes began in the prompt): a completion appended to its prompt reads as the two decoded together
        self.text = TextState(self.params.stop, context=left_context(self.prompt_ids))
        if self.params.temperature > 0:
            self.generator = torch.Generator()
            if self.params.seed is not None:
                self.generator.manual_seed(self.params.seed)
            else:
                self.generator.seed()

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_range(self, start: int, stop: int) -> list[int]:
        """``tokens[start:stop]`` without building the whole list (a step takes a row's newest tokens only)."""
        prompt = len(self.prompt_ids)
        if stop <= prompt:
            return self.prompt_ids[start:stop]
        if start >= prompt:
            return self.output_ids[start - prompt : stop - prompt]
        return self.prompt_ids[start:] + self.output_ids[: stop - prompt]

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def pending(self) -> int:
        """Tokens to feed before the next one can be chosen."""
        return self.length - self.computed


__all__ = ["Sequence"]
