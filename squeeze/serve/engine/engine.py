"""The serving engine: requests in, tokens out, one continuously batched model step at a time.

The engine owns a thread that loops: take new requests and cancellations from its inbox, plan a step
(squeeze.serve.engine.scheduler), run it through the model over the paged KV pool (squeeze.serve.engine.runner), choose
the next token of every sequence whose pending tokens are all in (squeeze.serve.engine.sampling), and send each
request its update. Requests live on the asyncio side as :class:`RequestHandle` objects: updates reach
their queue through ``loop.call_soon_threadsafe``, and cancelling one (a client that went away) is a
message in the inbox, handled before the next step, which returns its blocks to the pool.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any

import torch
from torch import nn

from squeeze.models.modes import input_device
from squeeze.quant.kv_bytes import kv_geometry
from squeeze.quant.kv_spec import KVSpec
from squeeze.runtime.generate import eos_token_ids
from squeeze.runtime.linear import drafting, prepare_draft_forms
from squeeze.runtime.speculation import NgramIndex, draft_length
from squeeze.runtime.stored_dtype import compute_dtype
from squeeze.serve.engine.blocks import BlockManager
from squeeze.serve.engine.context_length import check_block_size, model_context
from squeeze.serve.engine.grammar import GrammarBackend, StepMasks
from squeeze.serve.engine.kv_pool import AttentionShape, PagedKVPool
from squeeze.serve.engine.prefix_cache import PrefixCache
from squeeze.serve.engine.request_handle import RequestHandle
from squeeze.serve.engine.runner import ModelRunner
from squeeze.serve.engine.sampling import choose_token
from squeeze.serve.engine.scheduler import ScheduledChunk, Scheduler
from squeeze.serve.engine.sequence import Sequence
from squeeze.serve.engine.tokenizer import EngineTokenizer
from squeeze.serve.logprobs import token_logprobs
from squeeze.serve.types import (
    EngineConfig,
    EngineStats,
    EngineStoppedError,
    FinishReason,
    LatencyObserver,
    QueueFullError,
    RequestError,
    RequestOutput,
    SamplingParams,
    StructuredOutput,
    TokenLogprob,
    check_prompt,
)

log = logging.getLogger(__name__)


class Engine(EngineTokenizer):
    """Continuous batching over a paged KV cache for one loaded causal LM (see the module docstring).

    ``kv_spec``: the quantized cache (int8 / int4, calibrated or dynamic), or None for full precision.
    Raises ConfigError when the options do not fit the model: a ``max_model_len`` beyond its context, a
    ``block_size`` beyond the context, a ``kv_memory_bytes`` that cannot hold one full-context sequence.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        config: EngineConfig,
        kv_spec: KVSpec | None,
        *,
        model_name: str = "squeeze",
    ):
        model_config: Any = model.config
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.model_name = model_name
        self.max_model_len = model_context(model_config, config.max_model_len)
        check_block_size(config.block_size, self.max_model_len)
        self.observer: LatencyObserver | None = None
        layers, kv_heads, head_dim = kv_geometry(model_config)
        # the full-precision pool holds what the layers compute (float32 for squeeze.load), decided at load: the
        # first parameter is the embedding, which an artifact may keep in float16
        dtype = compute_dtype(model)
        self.pool = PagedKVPool.sized(
            kv_spec,
            AttentionShape(layers, kv_heads, head_dim),
            memory_bytes=config.kv_memory_bytes,
            block_size=config.block_size,
            sequences=config.max_num_seqs,
            dtype=dtype,
            min_tokens=self.max_model_len,
            device=input_device(model),
        )
        sink_slots = config.max_num_seqs if self.pool.sink_tokens else 0
        cache = None
        if config.prefix_cache:  # what a block holds besides its tokens' keys and values: see prefix_cache
            cache = PrefixCache(config.block_size, self.pool.label, self.pool.bits, self.pool.sink_tokens, str(dtype))
        self.blocks = BlockManager(
            self.pool.num_blocks,
            config.block_size,
            sink_slots,
            sink_tokens=self.pool.sink_tokens,
            prefix_cache=cache,
        )
        self.scheduler = Scheduler(
            self.blocks, max_num_seqs=config.max_num_seqs, max_batch_tokens=config.max_batch_tokens
        )
        self.runner = ModelRunner(model, self.pool, self.blocks)
        self.eos_ids = frozenset(eos_token_ids(model, tokenizer))
        self.vocab_size = int(model_config.vocab_size)
        self.grammar = GrammarBackend(tokenizer, self.vocab_size, self.eos_ids)
        self.masks = StepMasks(self.vocab_size, config.max_num_seqs)  # the constrained rows' masks, each step
        self.speculation = config.speculation
        #: bytes the int8 drafter's weight forms hold beyond the weights (0 without it)
        self.draft_bytes = prepare_draft_forms(model) if self.speculation.drafter == "int8" else 0
        self._drafted = 0
        self._accepted = 0
        self._handles: dict[str, RequestHandle] = {}
        self._seqs: dict[str, Sequence] = {}
        self._inbox: deque[tuple[str, Any]] = deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._driver: threading.Thread | None = None  # the caller's thread, when it runs the loop (run())
        self._done = threading.Event()  # set when the loop has stopped
        self._accepting = True
        self._stop = False
        self._order = 0
        self._finished = 0
        self._prompt_tokens = 0
        self._generated = 0
        self._utilisation = (0.0, 0)  # sum of per-step shares, steps

    # --- the event loop's side --------------------------------------------------------------------------

    @property
    def max_num_seqs(self) -> int:
        """Sequences one step may batch (requests with ``n`` > this are refused)."""
        return self.config.max_num_seqs

    @property
    def max_queue(self) -> int:
        """Requests waiting at most (a request with more choices than this is refused: it could never queue)."""
        return self.config.max_queue

    def submit(self, prompt_ids: Seq[int], params: SamplingParams, request_id: str) -> RequestHandle:
        if not self._accepting:
            raise EngineStoppedError("the server is shutting down and takes no new requests")
        prompt = list(prompt_ids)
        check_prompt(prompt, params.max_tokens, self.max_model_len)
        matcher = None if params.structured is None else self.grammar.matcher(params.structured)
        with self._cond:
            waiting = self._waiting()
            if waiting >= self.config.max_queue:
                raise QueueFullError(f"{waiting} requests are already waiting (--max-queue {self.config.max_queue})")
            if request_id in self._handles:
                raise RequestError(f"request id {request_id} is already in use")
            handle = RequestHandle(self, request_id, asyncio.get_running_loop())
            self._handles[request_id] = handle
            self._order += 1
            seq = Sequence(request_id, prompt, params, order=self._order, grammar=matcher)
            self._inbox.append(("add", seq))
            self._cond.notify()
        return handle

    def compile_grammar(self, structured: StructuredOutput, param: str) -> None:
        """Compile ``structured`` (cached for :meth:`submit`): RequestError (param ``param``) naming the problem
        when it does not compile. Called on the HTTP layer's tokenizer thread, before submitting."""
        self.grammar.compile(structured, param)

    def _waiting(self) -> int:
        """Requests queued: in the scheduler's queue, or submitted and not yet taken from the inbox."""
        return len(self.scheduler.waiting) + sum(kind == "add" for kind, _ in list(self._inbox))

    def cancel(self, request_id: str) -> None:
        """Stop a request and free its blocks (from any thread; a no-op once it has finished)."""
        with self._cond:
            self._inbox.append(("cancel", request_id))
            self._cond.notify()

    def stats(self) -> EngineStats:
        total, steps = self._utilisation
        cache = self.blocks.cache
        return EngineStats(
            kv_blocks_total=self.blocks.num_blocks,
            kv_blocks_free=self.blocks.free_blocks,
            requests_running=len(self.scheduler.running),
            requests_waiting=self._waiting(),
            block_size=self.blocks.block_size,
            kv_bits=self.pool.bits,
            kv_pool_bytes=self.pool.nbytes,
            kv_cache=self.pool.label,
            kv_bytes_per_token=self.pool.bytes_per_token,
            preemptions_total=self.scheduler.preemptions,
            requests_finished_total=self._finished,
            prompt_tokens_total=self._prompt_tokens,
            generation_tokens_total=self._generated,
            kv_block_utilisation=total / steps if steps else 0.0,  # nothing used yet
            kv_blocks_cached=self.blocks.cached_blocks,
            prefix_cache_queries_total=cache.queries if cache is not None else 0,
            prefix_cache_hits_total=cache.hits if cache is not None else 0,
            spec_draft_tokens_total=self._drafted,
            spec_accepted_tokens_total=self._accepted,
        )

    def start(self) -> None:
        """Run the loop in a thread of its own (idempotent; a no-op once a caller has claimed the loop)."""
        with self._cond:
            if self._thread is None and self._driver is None:
                self._thread = threading.Thread(target=self._loop, name="squeeze-engine", daemon=True)
                self._thread.start()

    def claim_loop(self) -> None:
        """Announce that the calling thread will run the loop (:meth:`run`): :meth:`start` then does nothing."""
        with self._cond:
            if self._thread is not None:
                raise RuntimeError("the engine already runs in its own thread")
            self._driver = threading.current_thread()

    def run(self, *, until: Callable[[], bool] | None = None) -> None:
        """Run the loop in the calling thread until :meth:`shutdown` (or until ``until()``, polled every 0.1 s
        while idle, turns true: everything is then cancelled).

        Why a caller would: torch's OpenMP threads serve the thread that first used them fastest. A model
        loaded and warmed in the main thread and then stepped from another one took 28 ms a decode step
        instead of 18 (SmolLM2 w4, 2 cores): ``squeeze serve`` runs the engine in its main thread and the
        HTTP server in a second one.
        """
        self.claim_loop()
        self._loop(until)

    def shutdown(self, grace_seconds: float) -> None:
        self._accepting = False
        deadline = time.monotonic() + max(0.0, grace_seconds)
        running = self._thread is not None or self._driver is not None
        with self._cond:
            while running and self._busy() and time.monotonic() < deadline:
                self._cond.wait(timeout=min(0.05, max(0.0, deadline - time.monotonic())))
            self._stop = True
            self._cond.notify_all()
        if running and threading.current_thread() not in (self._thread, self._driver):
            self._done.wait()
        if self._thread is not None:
            self._thread.join()

    # --- the engine's thread ----------------------------------------------------------------------------

    def _busy(self) -> bool:
        return bool(self._inbox) or self.scheduler.has_work()

    def _loop(self, until: Callable[[], bool] | None = None) -> None:
        try:
            self._serve(until)
        finally:
            self._done.set()

    def _serve(self, until: Callable[[], bool] | None) -> None:
        while True:
            with self._cond:
                while not self._busy() and not self._stop:
                    self._cond.wait(timeout=0.1 if until is not None else None)
                    if until is not None and until():
                        self._stop = True
                inbox = list(self._inbox)
                self._inbox.clear()
                stop = self._stop
            for kind, item in inbox:
                if kind == "add":
                    if self.speculation.drafter == "ngram" and item.grammar is None:
                        item.ngram = NgramIndex()
                        item.ngram.extend(item.tokens)
                    self._seqs[item.seq_id] = item
                    self._prompt_tokens += len(item.prompt_ids)
                    self.scheduler.add(item)
                else:
                    self._abort(item)
            if stop:
                for seq_id in list(self._seqs):
                    self._abort(seq_id)
                self.runner.close()
                self.masks.close()
                with self._cond:
                    self._cond.notify_all()
                return
            if self.scheduler.has_work():
                self._step()
            with self._cond:
                self._cond.notify_all()  # shutdown() waits for the work to drain

    def _step(self) -> None:
        plan = self.scheduler.schedule(self._room())
        if not plan:
            return
        if any(chunk.room for chunk in plan):
            try:
                plan = self._draft(plan)
            except Exception:  # noqa: BLE001 - a failed draft costs the speedup, never a request
                log.exception("drafting failed; this step verifies no drafts")
                plan = [ScheduledChunk(chunk.seq, chunk.tokens) for chunk in plan]
        live = sum(chunk.seq.computed + chunk.tokens for chunk in plan)
        allocated = sum(len(self.blocks.tables[c.seq.seq_id]) for c in plan) * self.blocks.block_size
        total, steps = self._utilisation
        self._utilisation = (total + live / allocated, steps + 1)
        full = [_wants_prompt_logits(chunk) or bool(chunk.draft) for chunk in plan]
        self.masks.start(plan)  # filled while the model runs
        try:
            with torch.inference_mode():
                logits, row_logits = self.runner.run_keeping(plan, full)  # (B, V), {row: (tokens, V)}
        except Exception as exc:  # noqa: BLE001 - one failed step fails its requests, not the server
            log.exception("engine step failed")
            for chunk in plan:
                self._finish(chunk.seq, "error", error=f"{type(exc).__name__}: {exc}")
            return
        for row, chunk in enumerate(plan):
            if chunk.draft:
                self._verify(chunk, row_logits[row], row)
                continue
            if row in row_logits:
                _record_prompt_logprobs(chunk, row_logits[row])
            self._advance(chunk, logits[row], row)

    # --- speculative decoding (squeeze.runtime.speculation) ---------------------------------------------------

    def _room(self) -> Callable[[Sequence], int] | None:
        """How many draft tokens each decoding sequence may verify this step (None: speculation is off, or the
        batch has too many decoding rows for drafts to pay)."""
        if not self.speculation.enabled:
            return None
        decoding = sum(seq.pending == 1 for seq in self.scheduler.running)
        k = draft_length(self.speculation.k, decoding)
        if k == 0:
            return None

        def room(seq: Sequence) -> int:
            if seq.grammar is not None:  # a constrained row's mask is known for its next position only
                return 0
            left = min(seq.params.max_tokens - len(seq.output_ids) - 1, self.max_model_len - seq.length)
            cap = max(0, min(k, left))
            return len(seq.ngram.propose(cap)) if seq.ngram is not None and cap else cap

        return room

    def _draft(self, plan: list[ScheduledChunk]) -> list[ScheduledChunk]:
        """``plan`` with each chunk that has draft room turned into a verification row: its newest token and
        up to ``room`` drafted tokens (the n-gram index's proposal, or the int8 path's greedy tokens)."""
        drafts: dict[int, list[int]] = {}
        if self.speculation.drafter == "ngram":
            for row, chunk in enumerate(plan):
                if chunk.room and chunk.seq.ngram is not None:
                    drafts[row] = chunk.seq.ngram.propose(chunk.room)
        else:
            drafts = self._draft_int8(plan)
        return [
            ScheduledChunk(chunk.seq, chunk.tokens + len(drafts[row]), draft=tuple(drafts[row]))
            if drafts.get(row)
            else ScheduledChunk(chunk.seq, chunk.tokens)
            for row, chunk in enumerate(plan)
        ]

    def _draft_int8(self, plan: list[ScheduledChunk]) -> dict[int, list[int]]:
        """Greedy tokens of the W4A8 path (squeeze.runtime.linear.drafting) for the rows with draft room, one
        batched step per draft position; their keys and values go to the rows' own blocks, where verification
        overwrites them with the exact path's."""
        drafts: dict[int, list[int]] = {row: [] for row, chunk in enumerate(plan) if chunk.room}
        for i in range(max((chunk.room for chunk in plan), default=0)):
            rows = [row for row in drafts if plan[row].room > i]
            step = [ScheduledChunk(plan[row].seq, 1, draft=tuple(drafts[row]), skip=i) for row in rows]
            with torch.inference_mode(), drafting():
                chosen = self.runner.run(step).argmax(dim=-1).tolist()
            for row, token in zip(rows, chosen, strict=True):
                drafts[row].append(int(token))
        return drafts

    def _verify(self, chunk: ScheduledChunk, logits: torch.Tensor, row: int) -> None:
        """Choose the exact token at each position of a verification row (``logits (1 + k, V)``) as plain
        decoding would, keeping drafts while they equal it; the KV of the rejected drafts is dropped (the
        sequence's computed count stops before them, and blocks it no longer needs go back to the pool)."""
        seq, draft = chunk.seq, chunk.draft
        base = seq.computed
        accepted = 0
        finished = False
        for i in range(len(draft) + 1):
            seq.computed = base + i + 1  # positions through base + i hold the exact keys and values of seq's tokens
            token, finished = self._emit(seq, logits[i], row)
            if finished or i == len(draft) or token != draft[i]:
                break
            accepted += 1
        self._drafted += len(draft)
        self._accepted += accepted
        if not finished:
            self.blocks.shrink(seq.seq_id, seq.computed + 1)

    # --- one token at a time --------------------------------------------------------------------------------

    def _advance(self, chunk: ScheduledChunk, logits: torch.Tensor, row: int = 0) -> None:
        seq = chunk.seq
        seq.computed += chunk.tokens
        if seq.block_names:
            self.blocks.commit(seq.seq_id, seq.block_names, seq.computed)
        if seq.pending:  # mid-prompt: no token to choose yet
            return
        if seq.params.max_tokens == 0:  # score only: the prompt is in, nothing to generate
            self._finish(seq, "length")
            return
        self._emit(seq, logits, row)

    def _emit(self, seq: Sequence, logits: torch.Tensor, row: int) -> tuple[int, bool]:
        """Choose ``seq``'s next token from ``logits (V,)`` (row ``row`` of the step), append it and send it (or
        finish the request); the token and whether the request finished."""
        token = choose_token(seq, logits if seq.grammar is None else self.masks.masked(row, logits))
        grammar_done = False
        if seq.grammar is not None:
            if not seq.grammar.accept_token(token):  # the mask allowed it: a grammar library defect
                self._finish(seq, "error", error=f"the grammar refused token {token}, which its mask allowed")
                return token, True
            grammar_done = seq.grammar.is_terminated()  # it accepted an end-of-sequence token
        top = seq.params.logprobs
        logprobs = () if top is None else tuple(token_logprobs(logits[None], [token], top))
        seq.output_ids.append(token)
        if seq.ngram is not None:
            seq.ngram.extend((token,))
        self._generated += 1
        now = time.perf_counter()
        if self.observer is not None:
            if seq.first_token_time is None:
                self.observer.observe_ttft(now - seq.arrival)
            elif seq.last_token_time is not None:
                self.observer.observe_itl(now - seq.last_token_time)
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.last_token_time = now
        eos = (token in self.eos_ids and not seq.params.ignore_eos) or grammar_done
        text_ids = seq.output_ids[:-1] if eos else seq.output_ids
        out_of_room = len(seq.output_ids) >= seq.params.max_tokens or seq.length >= self.max_model_len
        piece, stopped = seq.text.update(self.tokenizer, text_ids, final=eos or out_of_room)
        reason: FinishReason | None = "stop" if (eos or stopped) else ("length" if out_of_room else None)
        if reason is None:
            self._send(seq, piece, (token,), None, logprobs=logprobs)
        else:
            self._finish(seq, reason, piece=piece, token_ids=(token,), logprobs=logprobs)
        return token, reason is not None

    def _finish(
        self,
        seq: Sequence,
        reason: FinishReason,
        *,
        piece: str = "",
        token_ids: tuple[int, ...] = (),
        error: str | None = None,
        logprobs: tuple[TokenLogprob, ...] = (),
    ) -> None:
        self.scheduler.remove(seq)
        self._seqs.pop(seq.seq_id, None)
        self._finished += 1
        prompt_logprobs = None
        if seq.params.prompt_logprobs is not None:
            prompt_logprobs = tuple(seq.prompt_logprobs) or (TokenLogprob(seq.prompt_ids[0], None),)
        self._send(seq, piece, token_ids, reason, error=error, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        self._handles.pop(seq.seq_id, None)

    def _abort(self, seq_id: str) -> None:
        seq = self._seqs.get(seq_id)
        if seq is not None:
            self._finish(seq, "abort")

    def _send(
        self,
        seq: Sequence,
        piece: str,
        token_ids: tuple[int, ...],
        reason: FinishReason | None,
        *,
        error: str | None = None,
        logprobs: tuple[TokenLogprob, ...] = (),
        prompt_logprobs: tuple[TokenLogprob, ...] | None = None,
    ) -> None:
        handle = self._handles.get(seq.seq_id)
        if handle is None:
            return
        handle.deliver(
            RequestOutput(
                request_id=seq.seq_id,
                text=piece,
                token_ids=token_ids,
                finished=reason is not None,
                finish_reason=reason,
                prompt_tokens=len(seq.prompt_ids),
                completion_tokens=len(seq.output_ids),
                error=error,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
            )
        )


def _wants_prompt_logits(chunk: ScheduledChunk) -> bool:
    """Whether ``chunk`` covers prompt positions whose log-probabilities its request asked for and lacks."""
    seq = chunk.seq
    prompt = len(seq.prompt_ids)
    return seq.params.prompt_logprobs is not None and len(seq.prompt_logprobs) < prompt and seq.computed < prompt - 1


def _record_prompt_logprobs(chunk: ScheduledChunk, logits: torch.Tensor) -> None:
    """Add the prompt log-probabilities ``logits`` (every position of ``chunk``, ``(tokens, V)``) give: position
    p predicts prompt token p + 1. A preempted sequence's recomputed positions are not recorded twice."""
    seq = chunk.seq
    start, prompt = seq.computed, seq.prompt_ids
    recorded = seq.prompt_logprobs
    if not recorded:
        recorded.append(TokenLogprob(prompt[0], None))
    first = max(start, len(recorded) - 1)
    stop = min(start + chunk.tokens, len(prompt) - 1)
    if stop > first:
        top = seq.params.prompt_logprobs or 0
        recorded += token_logprobs(logits[first - start : stop - start], prompt[first + 1 : stop + 1], top)


__all__ = ["Engine", "RequestHandle", "model_context"]
