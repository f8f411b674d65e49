"""Text generation on a loaded model (an artifact's or any transformers causal LM), with run statistics.

One call runs all prompts as ONE left-padded batch: :func:`squeeze.runtime.decode.prefill` runs the
prompts, :func:`squeeze.runtime.decode.decode` chooses the new tokens one step at a time. A streamer
(:class:`_RunStreamer`) sees every step: it timestamps the first new token (time to first token) and the
last one (the decode phase), and, when asked, hands the first prompt's text to a callback piece by piece
as it is produced. Greedy when ``temperature == 0``; otherwise sampling with temperature / top-p, seeded
by ``torch.manual_seed(seed)`` for reproducible runs (the same tokens as transformers' ``model.generate``).
"""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache

from squeeze.errors import ConfigError
from squeeze.quant.kv_bytes import kv_bytes_table
from squeeze.quant.kv_spec import KVSpec
from squeeze.runtime.attention import native_run
from squeeze.runtime.checks import check_context, check_prompts, resolve_device
from squeeze.runtime.decode import DecodeOptions, decode, prefill
from squeeze.runtime.generation_result import GenerationResult
from squeeze.runtime.linear import prepare_draft_forms
from squeeze.runtime.quantized_cache import SqueezeKVCache
from squeeze.runtime.sampling_params import SamplingParams
from squeeze.runtime.speculation import SpeculationOptions
from squeeze.runtime.speculative_decode import SpeculationCounts, decode_speculative
from squeeze.runtime.stored_dtype import compute_dtype
from squeeze.runtime.text_stream import TextState, continuation_text, left_context
from squeeze.runtime.weight_paths import weight_paths

StreamFn = Callable[[str], None]


class _RunStreamer:
    """Times decoding and streams the first row's text: ``put(next_tokens (B,))`` per step, then ``end()``.

    The text comes in pieces as :class:`~squeeze.runtime.text_stream.TextState` makes them (like
    transformers' TextStreamer, read after the end of row 0's prompt, ``context``), but it accepts batches
    and stops at row 0's first end-of-sequence token, so the pieces concatenate to exactly the row's final text.
    """

    def __init__(self, tokenizer: Any, stream: StreamFn | None, eos_ids: set[int], context: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.stream = stream
        self.eos_ids = eos_ids
        self.steps = 0
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self._ids: list[int] = []
        self._text = TextState(context=left_context(context))
        self._done = False

    def put(self, value: torch.Tensor) -> None:
        now = time.perf_counter()
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now
        self.steps += 1
        if self.stream is None or self._done:
            return
        token = int(value.reshape(value.shape[0], -1)[0, -1])
        if token in self.eos_ids:
            self._done = True
            return
        self._ids.append(token)
        self._emit(self.stream, final=False)

    def end(self) -> None:
        if self.stream is not None:
            self._emit(self.stream, final=True)

    def _emit(self, stream: StreamFn, final: bool) -> None:
        piece, _ = self._text.update(self.tokenizer, self._ids, final=final)
        if piece:
            stream(piece)


def _model_device(model: nn.Module) -> torch.device:
    for parameter in model.parameters():
        return parameter.device
    for buffer in model.buffers():
        return buffer.device
    return torch.device("cpu")


def eos_token_ids(model: nn.Module, tokenizer: Any) -> set[int]:
    """The ids that end a sequence: the model's generation_config eos_token_id(s) and the tokenizer's."""
    ids: set[int] = set()
    config = getattr(model, "generation_config", None)
    for value in (getattr(config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return ids


def _format_prompts(tokenizer: Any, prompts: list[str], chat: bool) -> list[str]:
    if not chat:
        return prompts
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            "chat mode (--chat) needs a chat template, but this model's tokenizer has none",
            hint="drop --chat to continue the raw prompt (base models have no template)",
        )
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for p in prompts
    ]


def _peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024  # bytes on macOS, KiB on Linux


@dataclass(frozen=True)
class _Batch:
    """Prompts as (B, T) int64 ids and mask on the model's device, left-padded with ``pad_id``; unpadded lengths."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    pad_id: int
    prompt_tokens: list[int]


def generate(
    loaded_or_model: Any,
    tokenizer: Any | None,
    prompts: Sequence[str] | str,
    sampling: SamplingParams | None = None,
    *,
    chat: bool = False,
    stream: StreamFn | None = None,
    load_seconds: float = 0.0,
    kv_spec: KVSpec | None = None,
    speculation: SpeculationOptions | None = None,
    **sampling_options: Any,
) -> GenerationResult:
    """Continue each prompt, all prompts as one left-padded batch (prefill, then one decode step per token).

    ``loaded_or_model``: a LoadedModel (its tokenizer is used when ``tokenizer`` is None) or a transformers
    causal LM, on the device it should run on. ``sampling``: how tokens are chosen and how many (checked when
    it was built, trusted here); or, instead, its keywords ``max_new_tokens``, ``temperature``, ``top_p`` and
    ``seed`` (:meth:`SamplingParams.for_generate`). Greedy when ``temperature == 0``, else sampling with
    ``temperature`` and nucleus ``top_p`` (top-k off), after ``torch.manual_seed(seed)`` when a seed is
    given. ``chat`` wraps each prompt as one user turn with the tokenizer's chat template (ConfigError when
    it has none). ``stream(piece)`` receives the first prompt's text as it is produced. ``kv_spec``: run
    with squeeze's quantized KV cache (else transformers' DynamicCache). ``speculation``: speculative decoding
    (squeeze.runtime.speculation; the same tokens, off by default). Raises ConfigError for bad options,
    an empty prompt or a prompt longer than the model's context.
    """
    if sampling is None:
        sampling = SamplingParams.for_generate(**sampling_options)
    elif sampling_options:
        raise ConfigError(f"pass sampling or its keywords, not both (found {', '.join(sorted(sampling_options))})")
    prompts = check_prompts(prompts)
    model, tokenizer = _model_and_tokenizer(loaded_or_model, tokenizer)
    batch = _tokenize(tokenizer, _format_prompts(tokenizer, prompts, chat), chat, _model_device(model))
    context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(context, int) and not isinstance(context, bool):
        check_context(batch.prompt_tokens, sampling.max_tokens, context)
    eos_ids = eos_token_ids(model, tokenizer)
    options = DecodeOptions(sampling, pad_id=batch.pad_id, eos_ids=frozenset(eos_ids))
    if sampling.seed is not None:  # for greedy too: harmless, and keeps any stochastic module reproducible
        torch.manual_seed(sampling.seed)
    cache = SqueezeKVCache(kv_spec) if kv_spec is not None else DynamicCache(config=getattr(model, "config", None))
    speculation = speculation if speculation is not None else SpeculationOptions()
    if speculation.drafter == "int8":
        prepare_draft_forms(model)
    run = _Run(model, tokenizer, batch, options, cache, kv_spec, float(load_seconds), speculation)
    streamer = _RunStreamer(tokenizer, stream, eos_ids, _prompt_ids(batch, 0))
    return _result(run, *_decode_timed(run, streamer))


@dataclass(frozen=True)
class _Run:
    """One generate call, prepared: the model and tokenizer, the tokenized batch, how to decode, the KV cache
    (and the spec it was built from, None for transformers' DynamicCache), the load time to report."""

    model: nn.Module
    tokenizer: Any
    batch: _Batch
    options: DecodeOptions
    cache: Any
    kv_spec: KVSpec | None
    load_seconds: float
    speculation: SpeculationOptions = field(default_factory=SpeculationOptions)
    counts: SpeculationCounts = field(default_factory=SpeculationCounts)


@dataclass(frozen=True)
class _Clock:
    """perf_counter readings of one run: start, first and last new token, end; and the decoding steps."""

    start: float
    first: float
    last: float
    end: float
    steps: int


def _model_and_tokenizer(loaded_or_model: Any, tokenizer: Any | None) -> tuple[nn.Module, Any]:
    """The causal LM and the tokenizer to use; ConfigError when either is missing."""
    # a LoadedModel wraps the model; an nn.Module is the model (a causal LM's own ``.model`` is its body)
    model = loaded_or_model if isinstance(loaded_or_model, nn.Module) else getattr(loaded_or_model, "model", None)
    if not isinstance(model, nn.Module) or not hasattr(model, "generate"):
        raise ConfigError(f"generate needs a causal LM or a LoadedModel, found {type(loaded_or_model).__name__}")
    if tokenizer is None:
        tokenizer = getattr(loaded_or_model, "tokenizer", None)
    if tokenizer is None:
        raise ConfigError("generate needs a tokenizer", hint="pass the model's tokenizer, or a LoadedModel")
    return model, tokenizer


def _tokenize(tokenizer: Any, texts: list[str], chat: bool, device: torch.device) -> _Batch:
    """``texts`` as one left-padded batch on ``device``; the caller's tokenizer is left as it was."""
    saved = (tokenizer.padding_side, tokenizer.pad_token)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ConfigError(
                "the tokenizer has neither a pad nor an eos token; cannot pad a batch", hint="run one prompt at a time"
            )
        tokenizer.pad_token = tokenizer.eos_token  # padding is masked out; any id will do, eos is always there
    try:
        tokenizer.padding_side = "left"  # decoder-only: new tokens must follow the prompt directly
        # a chat template already writes BOS; adding special tokens again would double it
        encoded = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=not chat)
        pad_id = tokenizer.pad_token_id
    finally:
        tokenizer.padding_side, tokenizer.pad_token = saved
    attention_mask = encoded["attention_mask"].to(device)
    prompt_tokens = [int(n) for n in attention_mask.sum(dim=1).tolist()]
    if min(prompt_tokens) == 0:
        raise ConfigError("a prompt tokenized to zero tokens", hint="pass a prompt with some text")
    return _Batch(encoded["input_ids"].to(device), attention_mask, int(pad_id), prompt_tokens)


def _prompt_ids(batch: _Batch, row: int) -> list[int]:
    """Row ``row``'s prompt ids without the padding."""
    return [int(i) for i in batch.input_ids[row][batch.attention_mask[row].bool()].tolist()]


def _decode_timed(run: _Run, streamer: _RunStreamer) -> tuple[torch.Tensor, _Clock]:
    """Prefill and decode under inference mode, timed; the new tokens as (B, steps) int64 on the CPU."""
    device = run.batch.input_ids.device
    on_cuda = device.type == "cuda"
    if on_cuda:
        torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    with torch.inference_mode(), native_run(run.model, run.cache, run.batch.attention_mask) as extra:
        state = prefill(run.model, run.batch.input_ids, run.batch.attention_mask, run.cache, extra)
        if run.speculation.enabled:
            new = decode_speculative(run.model, state, run.options, run.speculation, streamer.put, run.counts)
        else:
            new = decode(run.model, state, run.options, on_tokens=streamer.put)
    streamer.end()
    if on_cuda:
        torch.cuda.synchronize(device)
    end = time.perf_counter()
    first, last = (t if t is not None else end for t in (streamer.first_token_time, streamer.last_token_time))
    return new.cpu(), _Clock(start=start, first=first, last=last, end=end, steps=streamer.steps)


def _result(run: _Run, new: torch.Tensor, clock: _Clock) -> GenerationResult:
    """The texts (each row through its first end-of-sequence token) and the run's statistics."""
    texts: list[str] = []
    new_tokens: list[int] = []
    for at, row in enumerate(new.tolist()):
        cut = next((i + 1 for i, t in enumerate(row) if t in run.options.eos_ids), len(row))
        new_tokens.append(cut)
        # read after the prompt, as it streamed: the first word keeps its leading space
        texts.append(continuation_text(run.tokenizer, left_context(_prompt_ids(run.batch, at)), row[:cut]))
    device = run.batch.input_ids.device
    paths = weight_paths(run.model)
    decode_seconds = max(0.0, clock.last - clock.first)
    rows = len(texts)
    tps = (clock.steps - 1) * rows / decode_seconds if clock.steps > 1 and decode_seconds > 0 else None
    return GenerationResult(
        texts=texts,
        prompt_tokens=run.batch.prompt_tokens,
        new_tokens=new_tokens,
        load_seconds=run.load_seconds,
        ttft_seconds=clock.first - clock.start,
        decode_seconds=decode_seconds,
        total_seconds=clock.end - clock.start,
        tokens_per_second=tps,
        peak_rss_bytes=_peak_rss_bytes(),
        peak_cuda_bytes=int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None,
        device=str(device),
        do_sample=run.options.do_sample,
        kv_cache=run.kv_spec.label if run.kv_spec is not None else str(compute_dtype(run.model)).removeprefix("torch."),
        kv_cache_bytes=_cache_bytes(run.cache),
        kv_bytes_per_token=_kv_table(run.model, run.kv_spec),
        weight_paths=paths,
        speculation=str(run.speculation),
        spec_draft_tokens=run.counts.drafted,
        spec_accepted_tokens=run.counts.accepted,
    )


def _cache_bytes(cache: Any) -> int:
    if isinstance(cache, SqueezeKVCache):
        return cache.nbytes()
    return sum(
        t.numel() * t.element_size()
        for layer in cache.layers
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
        if isinstance(t, torch.Tensor)
    )


def _kv_table(model: nn.Module, kv_spec: KVSpec | None) -> dict[str, int] | None:
    """Bytes per token at each width, counting the calibrated layout (asymmetric value layers) when there is one."""
    try:
        calibrated = kv_spec.to_config() if kv_spec is not None and kv_spec.calibrated else None
        return kv_bytes_table(model.config.to_dict(), calibrated)  # type: ignore[operator, union-attr]
    except (TypeError, ValueError, AttributeError):  # a config without the usual decoder fields
        return None


__all__ = [
    "GenerationResult",
    "SamplingParams",
    "generate",
    "eos_token_ids",
    "check_prompts",
    "resolve_device",
    "check_context",
]
