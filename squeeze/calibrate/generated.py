"""Token windows the model samples itself: calibration that reaches beyond the calibration text's domain.

Error compensation fits each layer's codes to the second moment of its inputs, ``H = sum x x^T``. Fitted on
one text (e.g. speeches), it pushes rounding error into the input directions that text leaves quiet, and
other text does not: on SmolLM2-135M w3, compensation against sotu.txt's Hessians cut sotu.txt's own
perplexity from 41.1 to 30.4 (fp32 24.2) but WikiText-2's only from 59.0 to 55.1. Text the model samples from
its own distribution (temperature 1, no top-k / top-p: every token as likely as the model finds it) covers
what it was trained on, without any data beyond the checkpoint (LLM-QAT's data-free calibration, Liu et al.
2023); adding 8 x 512 such tokens to the Hessians gave 50.2 on WikiText-2, 32 x 512 gave 47.9 (act-order,
damp 0.1; 54.4 without them; docs/benchmarks.md, "Error compensation").

The sampling loop is explicit (a KV cache, one token per step, a seeded ``torch.Generator``), not
``model.generate``: a checkpoint's generation config (top-p, repetition penalty, ...) must not change the
samples, and a seed must give the same tokens on every run. Forward hooks see every step's inputs, so an
:func:`squeeze.calibrate.hessian.input_hessians` context around it accumulates the Hessians of the sampled
tokens with no second pass.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers import DynamicCache

from squeeze.errors import ConfigError
from squeeze.models.modes import cache_kwarg, eval_mode

#: Sequences sampled together: bigger batches amortise reading the weights once per step.
DEFAULT_BATCH = 32

Progress = Callable[[int, int], None]


def start_token(tokenizer: object) -> int:
    """The token every sample starts from: the tokenizer's BOS, else its EOS (a document boundary either way);
    ConfigError when it has neither."""
    for attribute in ("bos_token_id", "eos_token_id"):
        token = getattr(tokenizer, attribute, None)
        if isinstance(token, int):
            return token
    raise ConfigError(
        "weights.generated_samples needs a start token to sample from, and the tokenizer has no BOS or EOS token",
        hint="set weights.generated_samples: 0 (compensate against the calibration text alone)",
    )


def sample_windows_from_model(
    model: nn.Module,
    num_samples: int,
    seq_len: int,
    *,
    start: int,
    seed: int,
    temperature: float = 1.0,
    batch_size: int = DEFAULT_BATCH,
    progress: Progress | None = None,
) -> torch.Tensor:
    """int64 ``(num_samples, seq_len)``: sequences sampled from ``model`` (a causal LM), each continuing the
    token ``start`` (which is not part of the result).

    Every step feeds each sequence's newest token with the KV cache (so the model's linears see ``start`` and
    the first ``seq_len - 1`` sampled tokens of each sequence, ``num_samples * seq_len`` inputs in all) and
    draws the next from ``softmax(logits / temperature)`` with a generator seeded by ``seed``: the same
    arguments give the same tokens. ``progress(done, total)`` counts steps over all batches.
    """
    if num_samples < 1 or seq_len < 1 or batch_size < 1:
        raise ValueError(
            f"num_samples, seq_len and batch_size must be >= 1, found {num_samples}, {seq_len}, {batch_size}"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, found {temperature}")
    generator = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    batches = [(b, min(batch_size, num_samples - b)) for b in range(0, num_samples, batch_size)]
    total, done = len(batches) * seq_len, 0
    out = torch.empty(num_samples, seq_len, dtype=torch.int64)
    keyword = cache_kwarg(model)
    with torch.no_grad(), eval_mode(model):
        for first, size in batches:
            token = torch.full((size, 1), start, dtype=torch.int64, device=device)  # (B, 1)
            cache = DynamicCache(config=getattr(model, "config", None))  # filled in place by each step
            for t in range(seq_len):
                output = model(input_ids=token, use_cache=True, **{keyword: cache})
                logits = output.logits[:, -1, :].to(torch.float32).cpu()  # (B, V)
                probs = torch.softmax(logits / temperature, dim=-1)
                token_cpu = torch.multinomial(probs, 1, generator=generator)  # (B, 1)
                out[first : first + size, t] = token_cpu[:, 0]
                token = token_cpu.to(device)
                done += 1
                if progress:
                    progress(done, total)
            del cache
    return out


__all__ = ["DEFAULT_BATCH", "sample_windows_from_model", "start_token"]
