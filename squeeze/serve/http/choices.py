"""The choices of one OpenAI request: several prompts and ``n`` samples each, submitted as engine requests.

/v1/completions takes a batch of prompts and both endpoints take ``n``: each (prompt, sample) pair is one
engine request, choice ``index = prompt * n + sample`` (vLLM's order), sampled with seed ``seed + sample``
when the request gives a seed. :class:`Choices` holds them as one :class:`~squeeze.serve.types.RequestStream`
(its updates interleaved, ``cancel()`` cancelling every one), so the HTTP layer streams, collects and cancels
them as it does a single request. The samples of a prompt compute its KV each (no prefix sharing yet).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from squeeze.runtime.text_stream import CONTEXT_TOKENS
from squeeze.serve.http import protocol
from squeeze.serve.logprobs import LegacyLogprobs, chat_logprobs, merge_legacy
from squeeze.serve.types import EngineClient, RequestError, RequestOutput, RequestStream, SamplingParams, TokenLogprob


@dataclass
class Choice:
    """One choice: its engine request, its prompt, and what it has produced so far."""

    index: int
    stream: RequestStream
    prompt_ids: list[int]
    params: SamplingParams
    #: The text the choice's text starts with (the prompt, for ``echo``).
    echo: str = ""
    pieces: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    last: RequestOutput | None = None

    def add(self, output: RequestOutput) -> None:
        self.pieces.append(output.text)
        self.token_ids += output.token_ids
        self.logprobs += output.logprobs
        self.last = output


def check_n(engine: EngineClient, n: int) -> None:
    """RequestError (param ``n``) when the engine cannot batch ``n`` sequences (``--max-num-seqs``)."""
    limit = getattr(engine, "max_num_seqs", None)
    if isinstance(limit, int) and n > limit:
        raise RequestError(
            f"n={n} is more than the {limit} sequences the server batches (--max-num-seqs {limit})",
            hint=f"ask for n <= {limit}",
            param="n",
        )


class Choices:
    """Every choice of one request as a single stream (see the module docstring)."""

    def __init__(self, request_id: str, choices: list[Choice], n: int = 1) -> None:
        self.request_id = request_id
        self.choices = choices
        self.n = n
        self._by_id = {c.stream.request_id: c for c in choices}

    @classmethod
    def submit(
        cls,
        engine: EngineClient,
        request_id: str,
        prompts: Sequence[list[int]],
        params: SamplingParams,
        n: int,
        echoes: Sequence[str] | None = None,
    ) -> Choices:
        """Submit ``n`` requests per prompt; on a refusal (429, 400 ...) cancel those already submitted."""
        choices: list[Choice] = []
        try:
            for p, prompt in enumerate(prompts):
                for sample in range(n):
                    index = p * n + sample
                    seeded = params if params.seed is None else dataclasses.replace(params, seed=params.seed + sample)
                    sub_id = request_id if len(prompts) * n == 1 else f"{request_id}-{index}"
                    stream = engine.submit(prompt, seeded, sub_id)
                    echo = echoes[p] if echoes is not None else ""
                    choices.append(Choice(index, stream, prompt, seeded, echo))
        except BaseException:
            for choice in choices:
                choice.stream.cancel()
            raise
        return cls(request_id, choices, n)

    def choice_of(self, output: RequestOutput) -> Choice:
        return self._by_id[output.request_id]

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        if len(self.choices) == 1:
            async for output in self.choices[0].stream:
                yield output
            return
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

        async def pump(stream: RequestStream) -> None:
            async for output in stream:
                queue.put_nowait(output)

        tasks = [asyncio.ensure_future(pump(c.stream)) for c in self.choices]
        left = len(self.choices)
        try:
            while left:
                output = await queue.get()
                left -= output.finished
                yield output
        finally:
            for task in tasks:
                task.cancel()

    def cancel(self) -> None:
        for choice in self.choices:
            choice.stream.cancel()

    async def collect(self) -> None:
        """Every choice's updates up to its last (GenerationError when one ends without a final update)."""
        async for output in self:
            self.choice_of(output).add(output)
        for choice in self.choices:
            if choice.last is None or not choice.last.finished:
                raise protocol.GenerationError("the engine ended the request without a final update")

    def raise_for_failure(self) -> None:
        for choice in self.choices:
            if choice.last is not None:
                protocol.raise_for_failure(choice.last)

    def usage(self) -> dict[str, int]:
        """Prompt tokens counted once per prompt, completion tokens over every choice."""
        prompt = sum(len(c.prompt_ids) for c in self.choices if c.index % self.n == 0)
        completion = sum(c.last.completion_tokens for c in self.choices if c.last is not None)
        return protocol.usage(prompt, completion)


# -- /v1/completions -----------------------------------------------------------------------------------------


def completion_logprobs(engine: EngineClient, choice: Choice) -> dict[str, Any] | None:
    """A collected choice's legacy ``logprobs`` object (echoed prompt first), or None when not asked for."""
    if choice.params.logprobs is None:
        return None
    parts = []
    prompt = choice.last.prompt_logprobs if choice.last is not None else None
    writer = LegacyLogprobs(engine.token_names)
    if prompt is not None:
        # named as the echo reads them: a prompt sent as ids is echoed as detokenize writes it, <s> and all
        specials = choice.echo == engine.detokenize(choice.prompt_ids)
        parts.append(writer.render(prompt, specials=specials))
    writer.offset = len(choice.echo)  # the completion's text follows the echoed prompt's
    parts.append(writer.render(choice.logprobs, context=_tail(choice.prompt_ids, [])))
    return merge_legacy(parts)


def completion_body(engine: EngineClient, choices: Choices, model: str, created: int) -> dict[str, Any]:
    """The ``text_completion`` object of collected choices."""
    return {
        "id": choices.request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": c.index,
                "text": c.echo + "".join(c.pieces),
                "logprobs": completion_logprobs(engine, c),
                "finish_reason": c.last.finish_reason if c.last is not None else None,
            }
            for c in choices.choices
        ],
        "usage": choices.usage(),
    }


async def completion_events(
    engine: EngineClient, choices: Choices, model: str, created: int, include_usage: bool
) -> AsyncIterator[bytes]:
    """A completion's events: a chunk per update with text or log-probabilities (its choice's ``index``), the
    finish reason on each choice's last one, then the usage chunk (``include_usage``) and [DONE]; an engine
    failure ends the stream with an error event."""
    writers = {c.index: LegacyLogprobs(engine.token_names) for c in choices.choices}
    finished = 0
    async for output in choices:
        choice = choices.choice_of(output)
        context = _tail(choice.prompt_ids, choice.token_ids)
        choice.add(output)
        if output.finished:
            failure = _failure(output)
            if failure is not None:
                yield protocol.sse(failure)
                break
        if not (output.text or output.logprobs or output.finished):
            continue
        logprobs = None
        if choice.params.logprobs is not None:
            logprobs = writers[choice.index].render(output.logprobs, context=context)
        chunk = protocol.completion_chunk(
            choices.request_id, model, created, output.text, output.finish_reason, include_usage=include_usage
        )
        chunk["choices"][0].update(index=choice.index, logprobs=logprobs)
        yield protocol.sse(chunk)
        finished += output.finished
        if finished == len(choices.choices):
            if include_usage:
                yield protocol.sse(_usage_chunk("text_completion", choices, model, created))
            break
    else:
        yield _no_final_update()
    yield protocol.DONE_EVENT


# -- /v1/chat/completions ------------------------------------------------------------------------------------


def _chat_logprobs(
    engine: EngineClient, choice: Choice, entries: Sequence[TokenLogprob], context: Sequence[int]
) -> dict[str, Any] | None:
    if choice.params.logprobs is None:
        return None
    return chat_logprobs(entries, engine.token_names, choice.params.logprobs, context)


def chat_body(engine: EngineClient, choices: Choices, model: str, created: int) -> dict[str, Any]:
    """The ``chat.completion`` object of collected choices."""
    return {
        "id": choices.request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": "".join(c.pieces)},
                "logprobs": _chat_logprobs(engine, c, c.logprobs, _tail(c.prompt_ids, [])),
                "finish_reason": c.last.finish_reason if c.last is not None else None,
            }
            for c in choices.choices
        ],
        "usage": choices.usage(),
    }


async def chat_events(
    engine: EngineClient, choices: Choices, model: str, created: int, include_usage: bool
) -> AsyncIterator[bytes]:
    """A chat completion's events: each choice's assistant role first, a chunk per piece of text (with its
    tokens' log-probabilities when asked), an empty delta with each choice's finish reason, then the usage
    chunk (``include_usage``) and [DONE]."""

    def chunk(index: int, delta: dict[str, str], finish: str | None, logprobs: dict[str, Any] | None) -> bytes:
        body = protocol.chat_chunk(choices.request_id, model, created, delta, finish, include_usage=include_usage)
        body["choices"][0].update(index=index, logprobs=logprobs)
        return protocol.sse(body)

    for c in choices.choices:
        yield chunk(c.index, {"role": "assistant", "content": ""}, None, None)
    finished = 0
    async for output in choices:
        choice = choices.choice_of(output)
        context = _tail(choice.prompt_ids, choice.token_ids)
        choice.add(output)
        failure = _failure(output) if output.finished else None
        if failure is not None:
            yield protocol.sse(failure)
            break
        if output.text or output.logprobs:
            logprobs = _chat_logprobs(engine, choice, output.logprobs, context)
            yield chunk(choice.index, {"content": output.text}, None, logprobs)
        if output.finished:
            finished += 1
            yield chunk(choice.index, {}, output.finish_reason, None)
            if finished == len(choices.choices):
                if include_usage:
                    yield protocol.sse(_usage_chunk("chat.completion.chunk", choices, model, created))
                break
    else:
        yield _no_final_update()
    yield protocol.DONE_EVENT


# -- shared --------------------------------------------------------------------------------------------------


def _tail(prompt: list[int], output: list[int]) -> list[int]:
    """The last ids of ``prompt + output``: the context the next tokens' names are read after."""
    return (prompt[-CONTEXT_TOKENS:] + output[-CONTEXT_TOKENS:])[-CONTEXT_TOKENS:]


def _usage_chunk(obj: str, choices: Choices, model: str, created: int) -> dict[str, Any]:
    return {
        "id": choices.request_id,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [],
        "usage": choices.usage(),
    }


def _failure(output: RequestOutput) -> dict[str, Any] | None:
    """The error object a finished request ends in (engine failure, abort), or None."""
    try:
        protocol.raise_for_failure(output)
    except RequestError as exc:
        return protocol.request_error_body(exc)
    return None


def _no_final_update() -> bytes:
    error = protocol.GenerationError("the engine ended the request without a final update")
    return protocol.sse(protocol.request_error_body(error))


__all__ = [
    "Choice",
    "Choices",
    "check_n",
    "completion_logprobs",
    "completion_body",
    "completion_events",
    "chat_body",
    "chat_events",
]
