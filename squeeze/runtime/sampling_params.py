"""How tokens are chosen and when generation stops: ONE options class for ``squeeze run`` and ``squeeze serve``.

Modelled on vLLM's ``SamplingParams``: the object is checked once, when it is built (ConfigError naming what was
expected and what was found), and everything downstream (the decode loop, the serving engine) trusts it.
``squeeze run`` builds it with :meth:`SamplingParams.for_generate` (at least one new token, the CLI's flag
names in the hints); the HTTP layer builds it from a request its schema already checked (``max_tokens`` 0
allowed: the prompt is only scored).

Torch-free at import, so the CLI and ``squeeze.api`` can build it before anything heavy loads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from squeeze.errors import ConfigError
from squeeze.limits import is_int

if TYPE_CHECKING:
    from transformers import LogitsProcessorList

#: ``squeeze run``'s default number of new tokens per prompt.
DEFAULT_MAX_NEW_TOKENS = 128

#: The kinds of structured output: a JSON schema (``json_object`` is the schema ``{"type": "object"}``), a
#: regular expression, or one of a list of strings (vLLM's ``guided_choice``).
STRUCTURED_KINDS = ("json_schema", "regex", "choice")


@dataclass(frozen=True)
class StructuredOutput:
    """A grammar the generated text must match (squeeze.serve.engine.grammar compiles it into a token mask per step).

    ``kind`` is one of STRUCTURED_KINDS; ``spec`` the schema as JSON text, the regular expression, or the
    choices as a JSON list of strings. Hashable, so compiled grammars are cached by it.
    """

    kind: str
    spec: str

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS or not isinstance(self.spec, str):
            raise ConfigError(f"structured output must be one of {STRUCTURED_KINDS} with a text spec, found {self!r}")


@dataclass(frozen=True)
class SamplingParams:
    """One generation's options (a ``squeeze run`` batch, or one ``squeeze serve`` request).

    Greedy when ``temperature == 0``; else softmax sampling after dividing by ``temperature`` and keeping the
    smallest set of tokens whose probability reaches ``top_p`` (transformers' warpers, :meth:`processors`).
    ``seed``: ``squeeze run`` seeds torch with it; the engine gives the request a generator of its own, so a
    seeded request gives the same text whatever else is in the batch. Generation stops at ``max_tokens`` new
    tokens, an end-of-sequence token (unless ``ignore_eos``), or the first of the ``stop`` strings (not part
    of the returned text). ``logprobs``: log-probabilities of each generated token and of the ``logprobs`` most
    likely tokens at its position; ``prompt_logprobs``: the same for every prompt token after the first.
    ``structured``: a grammar the output must match (``squeeze serve`` only): it finishes when the grammar does.
    """

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        _check(self)

    @classmethod
    def for_generate(
        cls,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
    ) -> SamplingParams:
        """``squeeze run``'s options: at least one new token (ConfigError naming ``--max-new-tokens``)."""
        if not is_int(max_new_tokens) or max_new_tokens <= 0:
            raise ConfigError(
                f"max_new_tokens must be an integer >= 1, found {max_new_tokens!r}", hint="e.g. --max-new-tokens 128"
            )
        return cls(max_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed)

    @property
    def max_new_tokens(self) -> int:
        """``max_tokens`` under ``squeeze run``'s name."""
        return self.max_tokens

    @property
    def do_sample(self) -> bool:
        return self.temperature > 0.0

    def processors(self) -> LogitsProcessorList:
        """transformers' warpers, in ``generate``'s order and on its conditions (a no-op one is left out)."""
        return warpers(self.temperature, self.top_p)


def warpers(temperature: float, top_p: float) -> LogitsProcessorList:
    """Temperature then top-p, as transformers' ``generate`` applies them (empty for greedy or no-ops)."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

    chain = LogitsProcessorList()
    if not temperature > 0.0:
        return chain
    if temperature != 1.0:
        chain.append(TemperatureLogitsWarper(float(temperature)))
    if top_p < 1.0:
        chain.append(TopPLogitsWarper(top_p=float(top_p), min_tokens_to_keep=1))
    return chain


def _check(params: SamplingParams) -> None:
    """ConfigError for the first option out of range (what :class:`SamplingParams` checks when built)."""
    if not is_int(params.max_tokens) or params.max_tokens < 0:
        raise ConfigError(f"max_tokens must be an integer >= 0, found {params.max_tokens!r}")
    temperature = params.temperature
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0.0:
        _bad_temperature(temperature)
    if math.isinf(temperature):
        _bad_temperature(temperature)
    top_p = params.top_p
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0:
        raise ConfigError(f"top_p must be in (0, 1], found {top_p!r}", hint="1.0 keeps the whole distribution")
    if params.seed is not None and not is_int(params.seed):
        raise ConfigError(f"seed must be an integer, found {params.seed!r}", hint="e.g. --seed 0")
    if not isinstance(params.stop, tuple) or not all(isinstance(s, str) for s in params.stop):
        raise ConfigError(f"stop must be a tuple of strings, found {params.stop!r}")
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and (not is_int(value) or value < 0):
            raise ConfigError(f"{name} must be None or an integer >= 0, found {value!r}")
    if params.structured is not None and not isinstance(params.structured, StructuredOutput):
        raise ConfigError(f"structured must be a StructuredOutput or None, found {params.structured!r}")


def _bad_temperature(value: object) -> None:
    raise ConfigError(
        f"temperature must be a finite number >= 0 (0 = greedy), found {value!r}",
        hint="use 0 for greedy decoding, or e.g. 0.7 to sample",
    )


__all__ = ["SamplingParams", "StructuredOutput", "STRUCTURED_KINDS", "DEFAULT_MAX_NEW_TOKENS", "warpers"]
