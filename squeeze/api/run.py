"""The run verbs: load an artifact, generate from it, and the transformers / lm-eval integration (``register``,
``loading``, ``set_activations``).

Loading is decided in the runtime (squeeze.runtime.loader: the device, the memory check); these verbs build
the options objects once from their keywords and pass them on.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from squeeze.api.artifact import local_artifact
from squeeze.errors import ConfigError
from squeeze.runtime.activations import Activations
from squeeze.runtime.options import KVOptions, LoadOptions, split_keywords
from squeeze.runtime.sampling_params import SamplingParams
from squeeze.runtime.speculation import SpeculationOptions

if TYPE_CHECKING:
    from squeeze.runtime.generation_result import GenerationResult
    from squeeze.runtime.loader import LoadedModel


def load(path: str | os.PathLike[str], options: LoadOptions | None = None, **keywords: Any) -> LoadedModel:
    """Verify an artifact against its manifest and load it, weights kept compressed, on the CPU or ``device``.

    ``options``: a :class:`LoadOptions` (checked when it was built), or its keywords: ``verify``,
    ``dense_cache``, ``low_memory``, ``check_memory``, ``public_key``, ``activations``, ``device`` (ConfigError
    for a bad one, before anything is read; TypeError for an unknown keyword). ``device`` ``cuda[:N]``: the model
    is built on the host for the dense (or, with ``low_memory``, chunked) path a GPU runs, then moved there
    (squeeze.runtime.loader decides it).
    Linears of a LUT format run the native CPU kernels on their packed codes (built on first use, once per
    machine). ``dense_cache=True`` caches every weight dequantized instead (the fastest prefill, 8x the
    memory at 4 bits); formats no kernel covers, or a machine without a C++ compiler, take that dense path
    too, unless ``low_memory=True``, which dequantizes them in row slices on every call instead.
    ``path`` may also be an ``https://`` URL or a Hub repo id (naming no local path): it is pulled into the
    artifact cache first (:func:`local_artifact`).
    Before reading any weight, the memory the load will hold is estimated from the manifest and config
    (artifact bytes + dense cache + a fixed overhead) and a ResourceError is raised when it exceeds the
    available memory (MemAvailable); ``check_memory=False`` skips that refusal.
    ``public_key`` (PEM, EC): the artifact must carry a ``model.sig`` by that key over exactly the verified
    bytes (:func:`sign`); checked right after verification, before anything is built, from the digests
    verification computed (IntegrityError: unsigned, another key, another artifact). ConfigError with
    ``verify=False`` or for a key that cannot check signatures.
    ``activations``: "float32" (default) multiplies the exact LUT values in float32; "int8" runs 3/4-bit LUT
    weights through the W4A8 kernel (activations quantized per row to int8, exact int32 sums: 2-4x faster at
    16-32 rows, every row's result independent of its batch at any row count; perplexity +3.3 % on SmolLM2-135M
    w4, WikiText-2); ConfigError else.
    """
    from squeeze.runtime.loader import load_artifact

    options = LoadOptions.build(options, split_keywords(keywords, LoadOptions)[0])
    return load_artifact(local_artifact(path, public_key=options.public_key), options)


def loading(options: LoadOptions | None = None, **keywords: Any) -> AbstractContextManager[LoadOptions]:
    """Load options for ``AutoModelForCausalLM.from_pretrained(artifact)`` calls inside a ``with`` block
    (:func:`squeeze.runtime.hf.loading`): ``public_key`` (the signature is checked right after the manifest,
    IntegrityError unless it verifies), ``activations``, ``dense_cache`` / ``low_memory``; a
    :class:`LoadOptions` or its keywords, checked once (ConfigError). ``verify=False`` is refused."""
    from squeeze.runtime.hf import loading as hf_loading

    return hf_loading(options, **keywords)


def set_activations(model: Any, activations: Activations) -> int:
    """Switch a loaded model's LUT kernels to ``activations`` ("int8" or "float32"; ConfigError else): for
    models from ``AutoModelForCausalLM.from_pretrained`` (:func:`load` takes the option directly). Returns
    how many quantized modules were switched."""
    from squeeze.runtime.weight_paths import set_activations as _set

    return _set(model, activations)  # checks it


def generate(
    model: str | os.PathLike[str] | LoadedModel,
    prompts: str | Sequence[str],
    sampling: SamplingParams | None = None,
    *,
    load: LoadOptions | None = None,
    kv: KVOptions | None = None,
    chat: bool = False,
    stream: Callable[[str], None] | None = None,
    speculate: str | SpeculationOptions | None = None,
    **options: Any,
) -> GenerationResult:
    """Load an artifact (verified unless ``verify=False``) and continue the prompts, all in one batch.

    The options come as three objects, each checked once when it is built (the CLI builds them from its
    flags), or as their keywords, from which this call builds them once:
    ``sampling`` (:class:`SamplingParams`; keywords ``max_new_tokens``, ``temperature``, ``top_p``, ``seed``):
    greedy when ``temperature == 0``; else sampling with ``top_p``, seeded by ``seed``.
    ``load`` (:class:`LoadOptions`; keywords ``verify``, ``dense_cache``, ``low_memory``, ``public_key``,
    ``activations``, ``device``): as in :func:`load`; ``device`` is ``cpu`` or ``cuda[:N]``.
    ``kv`` (:class:`KVOptions`; keywords ``kv_bits``, ``kv_dynamic``): the KV cache, as in :func:`evaluate`
    (default: what the artifact was calibrated for).
    ``model``: an artifact directory, or a LoadedModel from :func:`load` (reused as is: the load options then
    only place it on the device; ``public_key`` is a ConfigError: pass it to :func:`load`).
    ``chat`` applies the tokenizer's chat template. ``stream(piece)`` receives the first prompt's text as it
    is produced. ``speculate``: speculative decoding, ``"ngram:K"``, ``"int8:K"`` or ``"off"`` (default), or a
    :class:`SpeculationOptions` (the same tokens; faster where drafts are accepted). Options, prompts and the
    device are checked (ConfigError), then whether the load fits in memory (ResourceError, see :func:`load`),
    before anything loads. Returns texts plus load time, time to first token, tokens/s, peak memory and KV-cache bytes.
    """
    from squeeze.runtime.generate import generate as _generate
    from squeeze.runtime.loader import load_or_place

    # each keyword goes to the builder that checks it: once, here
    sampling_keywords, load_keywords, kv_keywords = split_keywords(
        options, SamplingParams.for_generate, LoadOptions, KVOptions
    )
    if sampling is None:
        sampling = SamplingParams.for_generate(**sampling_keywords)
    elif sampling_keywords:
        raise ConfigError(f"pass sampling or its keywords, not both (found {', '.join(sorted(sampling_keywords))})")
    load, kv = LoadOptions.build(load, load_keywords), KVOptions.build(kv, kv_keywords)
    speculation = SpeculationOptions.parse(speculate)
    prompt_list = check_prompts(prompts)
    source = local_artifact(model, public_key=load.public_key) if isinstance(model, (str, os.PathLike)) else model
    loaded, load_seconds = load_or_place(source, load)
    return _generate(
        loaded,
        loaded.tokenizer,
        prompt_list,
        sampling,
        chat=chat,
        stream=stream,
        load_seconds=load_seconds,
        kv_spec=kv.spec_for(loaded.model, loaded.kv_spec),
        speculation=speculation,
    )


def check_generate_options(
    prompts: str | Sequence[str],
    *,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    device: str = "cpu",
    kv_bits: int | None = None,
    kv_dynamic: bool = False,
) -> list[str]:
    """The checks :func:`generate` makes before anything loads; returns the prompts as a list (building the
    options objects is what checks them: prefer building them once and passing them to :func:`generate`).

    ConfigError, in this order, for: no prompt or an empty one, ``max_new_tokens`` < 1, a negative or
    non-finite ``temperature``, ``top_p`` outside (0, 1]; an unknown or unavailable ``device``; ``kv_bits``
    other than 4, 8, 16 or None, or ``kv_dynamic`` without 4 / 8 bits. Cheap: reads no file.
    """
    prompt_list = check_prompts(prompts)
    SamplingParams.for_generate(max_new_tokens, temperature, top_p)
    LoadOptions(device=device)
    KVOptions(kv_bits, kv_dynamic)
    return prompt_list


def check_prompts(prompts: str | Sequence[str]) -> list[str]:
    """The prompts as a list; ConfigError for no prompt or an empty one (cheap: checked before loading)."""
    from squeeze.runtime.checks import check_prompts as check

    return check(prompts)


def register(*, lm_eval: bool = True) -> None:
    """Register squeeze with the libraries that load its artifacts by name. ``import squeeze`` registers
    nothing: call this once before ``AutoModelForCausalLM.from_pretrained(ARTIFACT)`` (the CLI and the vLLM
    plugin call it themselves).

    transformers: the "squeeze" quantization method, registered as soon as transformers' quantizer registry is
    imported (at once when it already is; otherwise right after ``from_pretrained`` first imports it, so this
    call does not import transformers: seconds). lm-evaluation-harness (``--model squeeze``), when it is
    installed and ``lm_eval``: registered now (it imports lm-eval).
    """
    import importlib.util

    from squeeze.runtime import hf_hook

    hf_hook.install()
    if lm_eval and importlib.util.find_spec("lm_eval") is not None:
        from squeeze.eval.harness import register as register_harness

        register_harness()


__all__ = ["load", "loading", "set_activations", "generate", "check_generate_options", "check_prompts", "register"]
