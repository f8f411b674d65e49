"""The serving engine: requests in, tokens out, one continuously batched model step at a time.

The engine owns a thread that loops: take new requests and cancellations from its inbox, plan a step
(squeeze.serve.engine.scheduler), with drafts to verify when speculating (squeeze.serve.engine.speculation),
run it through the model over the paged KV pool (squeeze.serve.engine.runner), choose the next token of every
sequence whose pending tokens are all in (squeeze.serve.engine.sampling), let the scheduler do the step's
bookkeeping (its ``update``: tokens appended, stop checks), and send each request its outputs.
Requests live on the asyncio side as :class:`RequestHandle` objects: updates reach their queue through
``loop.call_soon_threadsafe``, and cancelling one (a client that went away) is a message in the inbox, handled
before the next step, which returns its blocks to the pool. The tokenizer is composed
(squeeze.serve.engine.tokenizer), for the HTTP layer's calls.
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
from squeeze.runtime.stored_dtype import compute_dtype
from squeeze.serve.engine.blocks import BlockManager
from squeeze.serve.engine.context_length import check_block_size, model_context
from squeeze.serve.engine.grammar import GrammarBackend, StepMasks
from squeeze.serve.engine.kv_pool import AttentionShape, PagedKVPool
from squeeze.serve.engine.prefix_cache import PrefixCache
from squeeze.serve.engine.request_handle import RequestHandle
from squeeze.serve.engine.runner import ModelRunner
from squeeze.serve.engine.sampling import sample_step, wants_prompt_logits
from squeeze.serve.engine.scheduler import Scheduler, StopRule
from squeeze.serve.engine.sequence import Sequence
from squeeze.serve.engine.speculation import Speculator
from squeeze.serve.engine.tokenizer import EngineTokenizer
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
    TokenNames,
    check_prompt,
)

log = logging.getLogger(__name__)


class Engine:
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
        self.pool = _pool(model, config, kv_spec, self.max_model_len)
        self.blocks = _blocks(self.pool, config)
        self.eos_ids = frozenset(eos_token_ids(model, tokenizer))
        self.vocab_size = int(model_config.vocab_size)
        #: the tokenizer's side: prompts and messages to ids, ids to text (the HTTP layer's calls below)
        self.tokenization = EngineTokenizer(tokenizer, self.vocab_size, self.max_model_len)
        stops = StopRule(self.eos_ids, self.max_model_len, tokenizer)
        self.scheduler = Scheduler(
            self.blocks, max_num_seqs=config.max_num_seqs, max_batch_tokens=config.max_batch_tokens, stops=stops
        )
        self.runner = ModelRunner(model, self.pool, self.blocks)
        self.grammar = GrammarBackend(tokenizer, self.vocab_size, self.eos_ids)
        self.masks = StepMasks(self.vocab_size, config.max_num_seqs)  # the constrained rows' masks, each step
        self.speculator = Speculator(config.speculation, self.runner, self.max_model_len)
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
        self._prompt_tokens = 0
        self._utilisation = (0.0, 0)  # sum of per-step shares, steps

    # --- the tokenizer side (squeeze.serve.engine.tokenizer), for the HTTP layer ------------------------------

    def tokenize(self, prompt: str | Seq[int], *, add_special_tokens: bool = True) -> list[int]:
        return self.tokenization.tokenize(prompt, add_special_tokens=add_special_tokens)

    def tokenize_chat(self, messages: Seq[dict[str, Any]], tools: Seq[dict[str, Any]] | None = None) -> list[int]:
        return self.tokenization.tokenize_chat(messages, tools)

    def detokenize(self, ids: Seq[int]) -> str:
        return self.tokenization.detokenize(ids)

    def token_strings(self, ids: Seq[int]) -> list[str]:
        return self.tokenization.token_strings(ids)

    def token_names(self, context: Seq[int], entries: Seq[TokenLogprob], *, specials: bool = False) -> list[TokenNames]:
        return self.tokenization.token_names(context, entries, specials=specials)

    def tokenizer_info(self) -> dict[str, Any]:
        return self.tokenization.tokenizer_info()

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
            requests_finished_total=self.scheduler.finished,
            prompt_tokens_total=self._prompt_tokens,
            generation_tokens_total=self.scheduler.generated,
            kv_block_utilisation=total / steps if steps else 0.0,  # nothing used yet
            kv_blocks_cached=self.blocks.cached_blocks,
            prefix_cache_queries_total=cache.queries if cache is not None else 0,
            prefix_cache_hits_total=cache.hits if cache is not None else 0,
            spec_draft_tokens_total=self.scheduler.drafted,
            spec_accepted_tokens_total=self.scheduler.accepted,
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
                    self.speculator.admit(item)
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
        plan = self.scheduler.schedule(self.speculator.room(self.scheduler.running))
        if not plan:
            return
        plan = self.speculator.draft(plan)
        live = sum(chunk.seq.computed + chunk.tokens for chunk in plan)
        allocated = sum(len(self.blocks.tables[c.seq.seq_id]) for c in plan) * self.blocks.block_size
        total, steps = self._utilisation
        self._utilisation = (total + live / allocated, steps + 1)
        full = [wants_prompt_logits(chunk) or bool(chunk.draft) for chunk in plan]
        self.masks.start(plan)  # filled while the model runs
        try:
            with torch.inference_mode():
                logits, row_logits = self.runner.run_keeping(plan, full)  # (B, V), {row: (tokens, V)}
        except Exception as exc:  # noqa: BLE001 - one failed step fails its requests, not the server
            log.exception("engine step failed")
            for chunk in plan:
                self._finish(chunk.seq, "error", error=f"{type(exc).__name__}: {exc}")
            return
        sampled = sample_step(plan, logits, row_logits, self.masks)
        for seq, output in self.scheduler.update(plan, sampled):
            self._deliver(seq, output)

    def _finish(self, seq: Sequence, reason: FinishReason, *, error: str | None = None) -> None:
        self._deliver(seq, self.scheduler.finish(seq, reason, error=error))

    def _abort(self, seq_id: str) -> None:
        seq = self._seqs.get(seq_id)
        if seq is not None:
            self._finish(seq, "abort")

    def _deliver(self, seq: Sequence, output: RequestOutput) -> None:
        """Send ``seq``'s request ``output`` (timing its token for the observer); a finished one is forgotten."""
        if output.token_ids:
            now = time.perf_counter()
            if self.observer is not None:
                if seq.first_token_time is None:
                    self.observer.observe_ttft(now - seq.arrival)
                elif seq.last_token_time is not None:
                    self.observer.observe_itl(now - seq.last_token_time)
            if seq.first_token_time is None:
                seq.first_token_time = now
            seq.last_token_time = now
        if output.finished:
            self._seqs.pop(seq.seq_id, None)
        handle = self._handles.pop(seq.seq_id, None) if output.finished else self._handles.get(seq.seq_id)
        if handle is not None:
            handle.deliver(output)


def _pool(model: nn.Module, config: EngineConfig, kv_spec: KVSpec | None, max_model_len: int) -> PagedKVPool:
    """The engine's paged KV pool, sized by ``config`` and holding at least one full-context sequence."""
    layers, kv_heads, head_dim = kv_geometry(model.config)
    # the full-precision pool holds what the layers compute (float32 for squeeze.load), decided at load: the
    # first parameter is the embedding, which an artifact may keep in float16
    return PagedKVPool.sized(
        kv_spec,
        AttentionShape(layers, kv_heads, head_dim),
        memory_bytes=config.kv_memory_bytes,
        block_size=config.block_size,
        sequences=config.max_num_seqs,
        dtype=compute_dtype(model),
        min_tokens=max_model_len,
        device=input_device(model),
    )


def _blocks(pool: PagedKVPool, config: EngineConfig) -> BlockManager:
    """The block tables over ``pool``, with the prefix cache when ``config`` asks for it."""
    cache = None
    if config.prefix_cache:  # what a block holds besides its tokens' keys and values: see prefix_cache
        cache = PrefixCache(config.block_size, pool.label, pool.bits, pool.sink_tokens, str(pool.dtype))
    sink_slots = config.max_num_seqs if pool.sink_tokens else 0
    return BlockManager(
        pool.num_blocks, config.block_size, sink_slots, sink_tokens=pool.sink_tokens, prefix_cache=cache
    )


__all__ = ["Engine", "RequestHandle", "model_context"]
