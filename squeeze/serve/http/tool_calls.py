"""A chat reply read as tool calls: parsing the model's text into OpenAI's ``tool_calls``, and the response
body and event stream of a request with tools (squeeze.serve.http.choices' own, rewritten choice by choice).

Replies with ``tool_choice: "auto"`` are parsed in the two formats chat templates teach models:

- Hermes / Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one or more, after optional
  text (the message's ``content``); the last one may lack its closing tag (the model stopped there);
- a bare JSON object ``{"name": ..., "parameters" | "arguments": {...}}`` (or a list of them) as the whole
  reply, optionally after ``<|python_tag|>``: what Llama 3.1-3.3 templates ask for.

A call must name one of the request's tools; a reply that does not parse is plain content. ``required`` and
named choices are constrained by the grammar (squeeze.serve.http.tool_schema), so their replies parse by
construction: a JSON array of ``{"name", "parameters"}``, or the named function's arguments. A reply with
calls that ended naturally finishes with ``"tool_calls"``.

Streaming follows OpenAI: text that may be the start of a call is held back; each call then comes as one
delta with its ``index``, ``id``, ``type`` and function ``name`` (``arguments: ""``), followed by argument
fragments. A named function's arguments stream as the model writes them; other calls once the reply is
complete (only then can it be parsed).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from squeeze.serve.http import protocol
from squeeze.serve.http.choices import Choices, chat_body, chat_events
from squeeze.serve.http.tool_schema import ToolPlan
from squeeze.serve.types import EngineClient

HERMES_OPEN = "<tool_call>"
PYTHON_TAG = "<|python_tag|>"
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|\Z)", re.DOTALL)
#: Argument fragments of a streamed call that is sent whole (OpenAI's are a few tokens each).
FRAGMENT_CHARS = 16


@dataclass(frozen=True)
class ParsedCall:
    name: str
    #: The arguments as JSON text.
    arguments: str


@dataclass(frozen=True)
class ParsedReply:
    content: str | None
    calls: tuple[ParsedCall, ...] = ()


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(obj: Any, names: set[str]) -> ParsedCall | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        return ParsedCall(obj["name"], arguments)
    return ParsedCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def _calls(payload: str, names: set[str]) -> tuple[ParsedCall, ...] | None:
    """The calls of a JSON object or list of objects, or None when ``payload`` is not that."""
    try:
        obj = json.loads(payload)
    except json.JSONDecodeError:
        return None
    objs = obj if isinstance(obj, list) else [obj]
    calls = [_call(o, names) for o in objs]
    if not calls or any(c is None for c in calls):
        return None
    return tuple(c for c in calls if c is not None)


def parse_reply(text: str, plan: ToolPlan) -> ParsedReply:
    """``text`` as content and tool calls under ``plan`` (see the module docstring)."""
    names = {t.function.name for t in plan.tools}
    if plan.mode == "named" and plan.named is not None:
        return ParsedReply(None, (ParsedCall(plan.named, text),))
    if plan.mode == "required":
        calls = _calls(text, names)
        return ParsedReply(None, calls) if calls else ParsedReply(text)
    if plan.mode != "auto":
        return ParsedReply(text)
    start = text.find(HERMES_OPEN)
    if start >= 0:
        found = [_calls(m.group(1), names) for m in _HERMES.finditer(text, start)]
        if found and all(c is not None and len(c) == 1 for c in found):
            prefix = text[:start]
            return ParsedReply(prefix if prefix.strip() else None, tuple(c[0] for c in found if c))
        return ParsedReply(text)
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    if body[:1] in ("{", "["):
        calls = _calls(body, names)
        if calls:
            return ParsedReply(None, calls)
    return ParsedReply(text)


def _finish_reason(reason: str | None, reply: ParsedReply) -> str | None:
    return "tool_calls" if reply.calls and reason == "stop" else reason


def _call_entry(call: ParsedCall, call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def tool_chat_body(engine: EngineClient, choices: Choices, model: str, created: int, plan: ToolPlan) -> dict[str, Any]:
    """squeeze.serve.http.choices.chat_body with each choice's reply parsed into ``content`` and ``tool_calls``
    (the body as it is without tools, or with ``tool_choice: "none"``)."""
    body = chat_body(engine, choices, model, created)
    if plan.mode == "none":
        return body
    for entry in body["choices"]:
        message = entry["message"]
        reply = parse_reply(message["content"], plan)
        message["content"] = reply.content
        if reply.calls:
            message["tool_calls"] = [_call_entry(call, new_call_id()) for call in reply.calls]
            entry["finish_reason"] = _finish_reason(entry["finish_reason"], reply)
    return body


def _hold_from(text: str, plan: ToolPlan) -> int:
    """How much of an ``auto`` reply so far is certainly content: up to where a call may begin."""
    stripped = text.lstrip()
    if not stripped or stripped[0] in "{[" or stripped.startswith(PYTHON_TAG) or PYTHON_TAG.startswith(stripped):
        return 0
    start = text.find(HERMES_OPEN)
    if start >= 0:
        return start
    for keep in range(min(len(HERMES_OPEN) - 1, len(text)), 0, -1):  # a partial "<tool_call>" at the end
        if HERMES_OPEN.startswith(text[-keep:]):
            return len(text) - keep
    return len(text)


@dataclass
class _StreamState:
    """One choice's reply while it streams."""

    text: str = ""
    sent: int = 0
    call_id: str = field(default_factory=new_call_id)
    named_started: bool = False


class _ToolStream:
    """Rewrites one request's chat chunks (parsed back from squeeze.serve.http.choices.chat_events) for tools."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.states: dict[int, _StreamState] = {}

    def _chunk(self, template: dict[str, Any], delta: dict[str, Any], finish: str | None = None) -> bytes:
        body = {**template, "choices": [{**template["choices"][0], "delta": delta, "finish_reason": finish}]}
        return protocol.sse(body)

    def _calls(self, template: dict[str, Any], calls: Sequence[ParsedCall]) -> list[bytes]:
        events = []
        for i, call in enumerate(calls):
            function = {"name": call.name, "arguments": ""}
            head = {"index": i, "id": new_call_id(), "type": "function", "function": function}
            events.append(self._chunk(template, {"tool_calls": [head]}))
            for at in range(0, len(call.arguments), FRAGMENT_CHARS):
                piece = call.arguments[at : at + FRAGMENT_CHARS]
                events.append(self._chunk(template, {"tool_calls": [{"index": i, "function": {"arguments": piece}}]}))
        return events

    def rewrite(self, chunk: dict[str, Any]) -> list[bytes]:
        if chunk.get("object") != "chat.completion.chunk" or not chunk.get("choices"):
            return [protocol.sse(chunk)]
        choice = chunk["choices"][0]
        state = self.states.setdefault(choice["index"], _StreamState())
        delta, finish = choice.get("delta", {}), choice.get("finish_reason")
        if finish is None and "role" in delta:
            return [protocol.sse(chunk)]
        if finish is None:
            return self._content(chunk, state, delta.get("content") or "")
        return self._finish(chunk, state, finish)

    def _content(self, chunk: dict[str, Any], state: _StreamState, piece: str) -> list[bytes]:
        state.text += piece
        if self.plan.mode == "named":
            events = []
            if not state.named_started:
                state.named_started = True
                head = {"index": 0, "id": state.call_id, "type": "function"}
                head["function"] = {"name": self.plan.named, "arguments": ""}
                events.append(self._chunk(chunk, {"tool_calls": [head]}))
            if piece:
                events.append(self._chunk(chunk, {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}))
            state.sent = len(state.text)
            return events
        safe = _hold_from(state.text, self.plan) if self.plan.mode == "auto" else 0
        if safe <= state.sent:
            return []
        out = self._chunk(chunk, {"content": state.text[state.sent : safe]})
        state.sent = safe
        return [out]

    def _finish(self, chunk: dict[str, Any], state: _StreamState, finish: str) -> list[bytes]:
        reply = parse_reply(state.text, self.plan)
        events: list[bytes] = []
        if self.plan.mode == "named":
            if not state.named_started:  # an empty reply: the call is announced all the same
                events += self._content(chunk, state, "")
        else:
            content = reply.content or ""
            if not reply.calls:
                content = state.text
            if len(content) > state.sent:
                events.append(self._chunk(chunk, {"content": content[state.sent :]}))
            events += self._calls(chunk, reply.calls)
        events.append(self._chunk(chunk, {}, _finish_reason(finish, reply)))
        return events


async def tool_chat_events(
    engine: EngineClient, choices: Choices, model: str, created: int, include_usage: bool, plan: ToolPlan
) -> AsyncIterator[bytes]:
    """squeeze.serve.http.choices.chat_events with each choice's reply streamed as content and tool-call deltas
    (the events as they are without tools, or with ``tool_choice: "none"``)."""
    stream = _ToolStream(plan)
    async for event in chat_events(engine, choices, model, created, include_usage):
        if plan.mode == "none" or event == protocol.DONE_EVENT or not event.startswith(b"data: {"):
            yield event
            continue
        for out in stream.rewrite(json.loads(event[len(b"data: ") :])):
            yield out


__all__ = ["ParsedCall", "ParsedReply", "parse_reply", "tool_chat_body", "tool_chat_events"]
