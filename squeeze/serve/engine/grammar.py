"""Structured output in ``squeeze serve``: a request's grammar (a JSON schema, a regular expression, a list of
choices) compiled by xgrammar into a token mask applied to its logits before each token is chosen.

Why xgrammar: it is vLLM's default structured-output backend (and SGLang's), installs from PyPI as a CPU
wheel for this Python and torch, compiles JSON schemas, regular expressions and EBNF, and fills a request's
next-token bitmask in tens of microseconds from a pushdown automaton it precomputes per vocabulary.

How it runs: the HTTP layer compiles a request's grammar before submitting it (:meth:`GrammarBackend.compile`,
a 400 naming the problem when it does not compile; compiled grammars are cached by their text); the engine
gives the sequence its own :class:`xgrammar.GrammarMatcher` when the request arrives. Each step, the bitmasks
of the rows that choose a token are filled on a worker thread while the model runs (:class:`StepMasks`), and
each constrained row's logits are masked (a copy: log-probabilities stay the model's) before greedy or sampled
choice; the matcher then accepts the chosen token. End-of-sequence is allowed only once the grammar is
complete, and the request finishes when the matcher accepts it. The matcher belongs to the sequence: a
preempted sequence recomputes its KV (and a prefix-cache hit skips some) without touching it. Unconstrained
rows are never touched.

JSON schemas compile without free whitespace (one line, ``", "`` and ``": "`` separators): small models left
free to write whitespace tend to write nothing else until ``max_tokens``.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from squeeze.runtime.sampling_params import StructuredOutput
from squeeze.serve.types import RequestError

if TYPE_CHECKING:
    import torch

    from squeeze.serve.engine.scheduler import ScheduledChunk

#: The JSON schema of ``response_format: {"type": "json_object"}``: any JSON object.
JSON_OBJECT_SCHEMA = '{"type": "object"}'


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as exc:  # the serve extra installs it
        raise RequestError(
            "structured output (response_format, guided_*, tool_choice required or a named function) needs the "
            "xgrammar package, which is not installed",
            hint="pip install 'squeeze[serve]'",
        ) from exc
    return xgrammar


def _library_message(exc: Exception) -> str:
    """xgrammar's error text without its C++ source location (``[12:41:08] /project/cpp/x.cc:94: ...``)."""
    text = str(exc).strip()
    return re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", text) or type(exc).__name__


class GrammarBackend:
    """xgrammar over one tokenizer: compiles grammars (cached) and makes matchers. Built lazily: a server whose
    requests never ask for structured output never imports xgrammar. Thread-safe (the HTTP layer compiles on
    its tokenizer thread, the engine makes matchers on the event loop's)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: Iterable[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = sorted(stop_ids)
        self._compiler: Any = None
        self._lock = threading.Lock()
        self._cache: dict[StructuredOutput, Any] = {}

    def _compiler_for(self) -> Any:
        with self._lock:
            if self._compiler is None:
                xgr = _xgrammar()
                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_ids or None
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def compile(self, structured: StructuredOutput, param: str = "response_format") -> Any:
        """The compiled grammar of ``structured`` (cached); RequestError (param ``param``) naming the problem
        when it does not compile."""
        with self._lock:
            found = self._cache.get(structured)
        if found is not None:
            return found
        compiler = self._compiler_for()
        try:
            if structured.kind == "json_schema":
                compiled = compiler.compile_json_schema(structured.spec, any_whitespace=False)
            elif structured.kind == "regex":
                compiled = compiler.compile_regex(structured.spec)
            else:
                choices = json.loads(structured.spec)
                compiled = compiler.compile_regex("|".join(re.escape(c) for c in choices))
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError / ValueError with the reason
            raise RequestError(
                f"the {structured.kind.replace('_', ' ')} does not compile into a grammar: {_library_message(exc)}",
                hint="fix the schema or expression (xgrammar's support: JSON Schema draft 2020-12 subset, "
                "Python-style regular expressions)",
                param=param,
            ) from exc
        with self._lock:
            self._cache[structured] = compiled
        return compiled

    def matcher(self, structured: StructuredOutput) -> Any:
        """A new matcher at the start of ``structured``'s grammar, ending on the model's end-of-sequence ids."""
        return _xgrammar().GrammarMatcher(self.compile(structured), override_stop_tokens=self.stop_ids or None)


class StepMasks:
    """The bitmasks of one step's constrained rows, filled on a worker thread while the model runs.

    ``start(plan)`` before the model's step: the rows whose sequence has a grammar and chooses a token this step
    (its pending tokens all in this chunk) get their masks filled; ``masked(row, logits)`` waits for the fill
    and returns the row's logits with the disallowed tokens at -inf (a copy). Nothing is imported or allocated
    before the first constrained row.
    """

    def __init__(self, vocab_size: int, max_rows: int) -> None:
        self.vocab_size = vocab_size
        self.max_rows = max_rows
        self._xgr: Any = None
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future[None] | None = None
        #: seconds spent filling masks, and steps that filled any (for the report on their cost)
        self.fill_seconds = 0.0
        self.fills = 0

    def _ready(self, rows: int) -> None:
        if self._xgr is None:
            self._xgr = _xgrammar()
            self._batch = self._xgr.BatchGrammarMatcher(max_threads=1)
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="squeeze-grammar")
            self.bitmask = self._xgr.allocate_token_bitmask(max(rows, self.max_rows), self.vocab_size)
        elif rows > self.bitmask.shape[0]:  # (rows, ceil(V / 32)) int32
            self.bitmask = self._xgr.allocate_token_bitmask(rows, self.vocab_size)

    def start(self, plan: Sequence[ScheduledChunk]) -> None:
        """Begin filling the masks of ``plan``'s constrained rows that choose a token this step."""
        rows = [
            (row, c.seq.grammar)
            for row, c in enumerate(plan)
            if c.seq.grammar is not None and c.tokens == c.seq.pending and c.seq.params.max_tokens > 0
        ]
        self._pending = None
        if rows:
            self._ready(len(plan))
            assert self._pool is not None
            self._pending = self._pool.submit(self._fill, [m for _, m in rows], [r for r, _ in rows])

    def _fill(self, matchers: list[Any], indices: list[int]) -> None:
        began = time.perf_counter()
        self._batch.batch_fill_next_token_bitmask(matchers, self.bitmask, indices)
        self.fill_seconds += time.perf_counter() - began
        self.fills += 1

    def masked(self, row: int, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (V,) float32 of ``row`` with the tokens its grammar forbids at -inf (a new tensor)."""
        if self._pending is not None:
            self._pending.result()
            self._pending = None
        scores = logits[None].clone()
        self._xgr.apply_token_bitmask_inplace(scores, self.bitmask[row : row + 1], vocab_size=self.vocab_size)
        return scores[0]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


__all__ = ["JSON_OBJECT_SCHEMA", "GrammarBackend", "StepMasks"]
