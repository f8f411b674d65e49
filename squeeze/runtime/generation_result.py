"""What one generation run produced, and how fast: :class:`GenerationResult`, the value
:func:`squeeze.runtime.generate.generate` returns and ``squeeze.api.generate`` hands to its caller."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from squeeze.runtime.weight_paths import activation_precision, describe_weight_paths


@dataclass
class GenerationResult:
    """What one generation run produced, and how fast.

    texts: the generated continuation of each prompt (the prompt itself excluded, special tokens dropped),
    read after the prompt: ``prompt + text`` reads as the two decoded together (its first word keeps its space).
    prompt_tokens / new_tokens: tokens per prompt (prompt without padding; generated up to and including
    the first end-of-sequence token). load_seconds: passed in by the caller (0.0 when unknown).
    ttft_seconds: from the start of generation to the first new token (tokenized prompt -> prefill ->
    first token). decode_seconds: from the first new token to the last. tokens_per_second: decode-phase
    throughput, (steps - 1) * batch / decode_seconds, counting every row's step (the work the model did);
    None when only one step ran. peak_rss_bytes: the process's peak resident set size so far (getrusage;
    it cannot be reset, so it includes loading). peak_cuda_bytes: torch.cuda.max_memory_allocated during
    this run, or None off CUDA. weights_path / weight_paths: the path the quantized linears ran
    (``native-avx512 (210 linears)``) and its counts per path (:mod:`squeeze.runtime.weight_paths`).
    """

    texts: list[str]
    prompt_tokens: list[int]
    new_tokens: list[int]
    load_seconds: float
    ttft_seconds: float
    decode_seconds: float
    total_seconds: float
    tokens_per_second: float | None
    peak_rss_bytes: int
    peak_cuda_bytes: int | None
    device: str
    do_sample: bool
    #: The KV cache generation ran with: "int8" / "int4" (squeeze's quantized cache) or the model's dtype.
    kv_cache: str = "float32"
    #: Bytes that cache held at the end (all layers, scales and the full-precision sink included).
    kv_cache_bytes: int = 0
    #: KV bytes per token over all layers: {"fp16": ..., "int8": ..., "int4": ...}, scales included.
    kv_bytes_per_token: dict[str, int] | None = None
    #: SqueezeLinear modules per path: {"native-avx512": 210}; empty for a model without any.
    weight_paths: dict[str, int] = field(default_factory=dict)
    #: Speculative decoding: the option ("off", "ngram:4"...), draft positions verified and kept.
    speculation: str = "off"
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    @property
    def text(self) -> str:
        """The first prompt's continuation."""
        return self.texts[0]

    @property
    def weights_path(self) -> str:
        """Which path the quantized linears ran, in words: "native-avx512 (210 linears)", "dense (42 linears)"..."""
        return describe_weight_paths(self.weight_paths)

    @property
    def activations(self) -> str:
        """The activation precision the quantized linears ran in: "float32", "int8", or a mix in words."""
        return activation_precision(self.weight_paths)

    @property
    def peak_memory_bytes(self) -> int:
        """Peak CUDA memory when the model ran on CUDA, else the peak RSS."""
        return self.peak_cuda_bytes if self.peak_cuda_bytes is not None else self.peak_rss_bytes

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary: ``text``, ``texts``, timings, token counts (``new_tokens`` is the total)."""
        data = asdict(self)
        data["new_tokens_per_prompt"] = data.pop("new_tokens")
        data["prompt_tokens_per_prompt"] = data.pop("prompt_tokens")
        return {
            "text": self.text,
            **data,
            "new_tokens": sum(self.new_tokens),
            "prompt_tokens": sum(self.prompt_tokens),
            "peak_memory_bytes": self.peak_memory_bytes,
            "weights_path": self.weights_path,
            "activations_ran": self.activations,
        }


__all__ = ["GenerationResult"]
