"""What the serving engine and its HTTP front share: options, per-request parameters, outputs, errors.

The engine (squeeze.serve.engine.engine) runs the model; the HTTP layer (squeeze.serve.http.app) speaks the OpenAI
protocol. Neither imports the other's internals: they meet here, and the HTTP layer talks to any object with
the :class:`EngineClient` interface (tests drive it with a fake one).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from squeeze.errors import ConfigError, SqueezeError
from squeeze.runtime.options import KVOptions
from squeeze.runtime.sampling_params import SamplingParams, StructuredOutput  # one options class: run and serve
from squeeze.runtime.speculation import SpeculationOptions

#: Why a request stopped: an end-of-sequence token or a stop string ("stop"), max_tokens ("length"), the
#: client went away or the server shut down ("abort"), or the engine failed on it ("error").
FinishReason = Literal["stop", "length", "abort", "error"]


class RequestError(SqueezeError):
    """A request the server refuses: HTTP ``status`` (400 by default) with an OpenAI-style error body."""

    status: int = 400
    #: OpenAI's error ``type`` field.
    error_type: str = "invalid_request_error"

    def __init__(self, message: str, hint: str | None = None, *, param: str | None = None) -> None:
        super().__init__(message, hint)
        self.param = param


def check_prompt(prompt: Sequence[int], max_tokens: int, max_model_len: int) -> None:
    """RequestError (400, naming the field) for an empty prompt, or one whose tokens plus ``max_tokens`` exceed
    the context: what every engine checks before taking a request. ``max_tokens`` 0 (score the prompt only)
    is allowed."""
    if not prompt:
        raise RequestError("the prompt is empty (zero tokens)", param="prompt")
    if len(prompt) + max_tokens > max_model_len:
        raise RequestError(
            f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) is more than the context of "
            f"{max_model_len} tokens",
            hint="shorten the prompt or lower max_tokens",
            param="max_tokens",
        )


class QueueFullError(RequestError):
    """Too many requests waiting: HTTP 429 with a ``Retry-After`` header of ``retry_after`` seconds."""

    status = 429
    error_type = "rate_limit_error"

    def __init__(self, message: str, *, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineStoppedError(RequestError):
    """The engine is shutting down (or stopped) and takes no new request: HTTP 503."""

    status = 503
    error_type = "service_unavailable"


@dataclass(frozen=True)
class EngineConfig:
    """How the engine sizes its KV cache and batches.

    kv: the KV cache (:class:`~squeeze.runtime.options.KVOptions`, checked when built: ``kv_bits`` 16, 4 / 8 or
    None for what the artifact was calibrated for; ``kv_dynamic`` for 4 / 8 bits without calibration).
    kv_memory_bytes: the KV pool (all layers, sink tokens included). block_size: tokens per KV block.
    max_num_seqs: sequences in one batch at most. max_batch_tokens: tokens one step feeds the model at most
    (decode tokens first, then prompt chunks). max_model_len: the context a request may use (None: the
    model's). max_queue: requests waiting at most before new ones get 429. prefix_cache: reuse the KV blocks
    of prompt prefixes computed before (squeeze.serve.engine.prefix_cache; the same tokens either way). speculation:
    speculative decoding (squeeze.runtime.speculation; the same tokens either way), off by default.
    """

    kv: KVOptions = field(default_factory=KVOptions)
    kv_memory_bytes: int = 1 << 30
    block_size: int = 16
    max_num_seqs: int = 32
    max_batch_tokens: int = 512
    max_model_len: int | None = None
    max_queue: int = 256
    prefix_cache: bool = True
    speculation: SpeculationOptions = field(default_factory=SpeculationOptions)

    def __post_init__(self) -> None:
        _check_engine_config(self)


#: EngineConfig's positive integers, each with a value for the hint of its refusal (the default, mostly).
_POSITIVE_OPTIONS = {
    "kv_memory_bytes": "1GiB",
    "block_size": "16 (the default)",
    "max_num_seqs": "32 (the default)",
    "max_batch_tokens": "512 (the default)",
    "max_queue": "256 (the default)",
}


def _check_engine_config(config: EngineConfig) -> None:
    """ConfigError for engine options that are wrong whatever the model: what :class:`EngineConfig` checks when
    built (before anything loads), naming the ``squeeze serve`` flag."""
    if not isinstance(config.kv, KVOptions):
        raise ConfigError(
            f"kv must be a KVOptions, found {type(config.kv).__name__}", hint="pass kv=KVOptions(kv_bits, kv_dynamic)"
        )
    for name, example in _POSITIVE_OPTIONS.items():
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            flag = "--" + name.replace("_bytes", "").replace("_", "-")
            raise ConfigError(f"{flag} must be a positive integer, found {value!r}", hint=f"e.g. {flag} {example}")
    if not isinstance(config.speculation, SpeculationOptions):
        raise ConfigError(
            f"speculation must be a SpeculationOptions, found {type(config.speculation).__name__}",
            hint="build it with SpeculationOptions.parse('ngram:12')",
        )
    if not isinstance(config.prefix_cache, bool):
        raise ConfigError(
            f"prefix_cache must be True or False, found {config.prefix_cache!r}", hint="pass prefix_cache=False"
        )
    if config.max_model_len is not None and (
        isinstance(config.max_model_len, bool) or not isinstance(config.max_model_len, int) or config.max_model_len < 1
    ):
        raise ConfigError(
            f"--max-model-len must be a positive integer, found {config.max_model_len!r}",
            hint="leave it out to use the model's context",
        )


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability under the model (fp32 log-softmax of its logits: before temperature and
    top-p), and the ``top`` most likely tokens at its position as (id, log-probability), most likely first.
    ``logprob`` is None for a prompt's first token, which nothing predicts."""

    token_id: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class TokenNames:
    """How the log-probabilities of one position name their tokens (:mod:`squeeze.serve.engine.token_names`).

    ``text``: what the chosen token adds to the response's text, which ``text_offset`` counts ("" for a
    special token the text drops and for a byte of a character not yet complete; the character on its last
    byte). ``names``: a distinct string for the chosen token and for each alternative, keyed by id.
    ``raw_bytes``: the token's own bytes where its vocabulary entry spells them (a byte token's one byte, which
    neither its name ``<0xE2>`` nor the character its last byte completes spells); a name's UTF-8 bytes
    otherwise.
    """

    text: str
    names: dict[int, str]
    raw_bytes: dict[int, list[int]] = field(default_factory=dict)
    #: How many U+FFFD ``text`` starts with for earlier bytes that its token shows will never complete: the
    #: token's own text (and ``text_offset``) begins after them.
    lead: int = 0
    #: How many characters of the text before it the token's arrival rewrites (``text`` starts with their new
    #: spelling): a byte-fallback decoder writes a whole run of byte tokens as U+FFFD once one is invalid.
    rewrites: int = 0

    def token_bytes(self, token: int) -> list[int]:
        """The bytes of ``token`` as OpenAI's chat ``bytes`` field gives them."""
        own = self.raw_bytes.get(token)
        return own if own is not None else list(self.names[token].encode("utf-8", "surrogatepass"))


@dataclass(frozen=True)
class RequestOutput:
    """One update of a request, sent as tokens are produced.

    text / token_ids: what is new since the previous update (text held back while it may still turn into a
    stop string). finished: the last update of the request, with its ``finish_reason``.
    prompt_tokens / completion_tokens: counts so far (usage). logprobs: one per id of ``token_ids`` when the
    request asked for them. prompt_logprobs: the prompt's, on the final update of a request that asked.
    """

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finished: bool
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for /metrics and /health: KV blocks, requests by state, and totals since start."""

    kv_blocks_total: int
    kv_blocks_free: int
    requests_running: int
    requests_waiting: int
    block_size: int
    #: 16 (full precision), 8 or 4.
    kv_bits: int
    kv_pool_bytes: int = 0
    #: The cache's name: "int8", "int4", "fp8" (an fp8 cache has kv_bits 8 too) or, unquantized, its dtype
    #: ("float32").
    kv_cache: str = ""
    #: Bytes one token's keys and values take over all layers.
    kv_bytes_per_token: int = 0
    preemptions_total: int = 0
    requests_finished_total: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    #: Of the token slots in allocated blocks, the share holding live tokens, averaged over the steps run
    #: (0 before any step: an untouched pool is not a fully used one).
    kv_block_utilisation: float = 0.0
    #: Of the free blocks, those still holding a cached prompt prefix (reused or evicted when needed).
    kv_blocks_cached: int = 0
    #: Tokens of the requests admitted (looked up in the prefix cache), and those found there (vLLM's counts).
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    #: Speculative decoding: draft tokens verified, and those kept (equal to the exact path's tokens).
    spec_draft_tokens_total: int = 0
    spec_accepted_tokens_total: int = 0


class LatencyObserver(Protocol):
    """Receives latencies as the engine measures them (called from the engine's thread)."""

    def observe_ttft(self, seconds: float) -> None:
        """Arrival of a request to its first new token."""
        ...

    def observe_itl(self, seconds: float) -> None:
        """Time between two consecutive new tokens of one request."""
        ...


class RequestStream(Protocol):
    """One submitted request: iterate it (``async for``) for its updates; ``cancel()`` stops it early."""

    request_id: str

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    def cancel(self) -> None:
        """Stop the request and free its KV blocks (idempotent; a no-op once it finished)."""
        ...


class EngineClient(Protocol):
    """What the HTTP layer needs from an engine. Its methods are called on the event loop's thread, except
    ``tokenize`` and ``tokenize_chat``, called on one worker thread (one call at a time), which must not touch
    the engine's scheduling state."""

    #: The name /v1/models lists and responses carry.
    model_name: str
    #: Longest prompt + max_tokens a request may ask for.
    max_model_len: int
    #: Set by the HTTP layer to receive latencies; None: not measured.
    observer: LatencyObserver | None

    def tokenize(self, prompt: str | Sequence[int], *, add_special_tokens: bool = True) -> list[int]:
        """Prompt ids: text tokenized as ``squeeze run`` does (the tokenizer's special tokens added unless
        ``add_special_tokens`` is false), or ids checked against the vocabulary (RequestError when one is out
        of range)."""
        ...

    def tokenize_chat(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None
    ) -> list[int]:
        """The chat template applied to ``messages`` and ``tools`` (with the generation prompt) as ids;
        RequestError when the tokenizer has no chat template, or tools are given and it does not render them."""
        ...

    def detokenize(self, ids: Sequence[int]) -> str:
        """The text of ``ids`` (special tokens kept); RequestError for an id outside the vocabulary."""
        ...

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """Each id decoded alone (/tokenize's ``token_strs``)."""
        ...

    def token_names(
        self, context: Sequence[int], entries: Sequence[TokenLogprob], *, specials: bool = False
    ) -> list[TokenNames]:
        """How log-probabilities name each entry's tokens, read after ``context`` (the ids before the first
        entry) and the entries before it; ``specials``: the text spells special tokens (an echoed prompt sent
        as ids), else they add nothing to it (generated text)."""
        ...

    def tokenizer_info(self) -> dict[str, Any]:
        """The tokenizer's description for GET /tokenizer_info (vLLM's fields: ``tokenizer_class``,
        ``eos_token``, ``bos_token``, ``pad_token``, ``chat_template`` ...)."""
        ...

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str) -> RequestStream:
        """Queue a request. Raises RequestError (prompt + max_tokens beyond max_model_len, empty prompt),
        QueueFullError (too many waiting) or EngineStoppedError (shutting down) before queueing anything."""
        ...

    def stats(self) -> EngineStats: ...

    def start(self) -> None:
        """Start the engine's thread (idempotent)."""
        ...

    def shutdown(self, grace_seconds: float) -> None:
        """Stop taking requests (submit raises EngineStoppedError), let running ones finish for up to
        ``grace_seconds``, cancel the rest (finish_reason "abort"), stop the thread. Blocks until done."""
        ...


__all__ = [
    "FinishReason",
    "RequestError",
    "check_prompt",
    "QueueFullError",
    "EngineStoppedError",
    "EngineConfig",
    "SamplingParams",
    "StructuredOutput",
    "TokenLogprob",
    "TokenNames",
    "RequestOutput",
    "EngineStats",
    "LatencyObserver",
    "RequestStream",
    "EngineClient",
]
