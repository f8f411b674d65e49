"""The tool-calling half of a chat request: ``tools``, ``tool_choice``, ``parallel_tool_calls`` and the tool
turns of a conversation (assistant ``tool_calls``, ``tool`` messages), checked once (pydantic) and turned into
a :class:`ToolPlan`: what the chat template is given, and the grammar that ``required`` and named choices
constrain the reply with (squeeze.serve.engine.grammar). Replies are parsed by squeeze.serve.http.tool_calls.

The constrained replies follow vLLM: ``tool_choice: "required"`` makes the model write a JSON array of
``{"name": ..., "parameters": {...}}`` (one to many, or exactly one without ``parallel_tool_calls``), and a
named function makes it write that function's arguments object only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from squeeze.serve.types import RequestError, StructuredOutput

ToolChoiceMode = Literal["none", "auto", "required", "named"]


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    #: A JSON schema of the arguments object (None: no arguments, as OpenAI).
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(BaseModel):
    """One entry of ``tools``: ``{"type": "function", "function": {"name", "description", "parameters"}}``."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["function"]
    function: FunctionDefinition

    def template_entry(self) -> dict[str, Any]:
        """The tool as chat templates take it (transformers' JSON-schema form of a tool)."""
        function: dict[str, Any] = {"name": self.function.name}
        if self.function.description is not None:
            function["description"] = self.function.description
        function["parameters"] = self.function.parameters or {"type": "object", "properties": {}}
        return {"type": "function", "function": function}


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    name: str
    #: The arguments as JSON text (OpenAI's form).
    arguments: str


class ToolCall(BaseModel):
    """One entry of an assistant message's ``tool_calls`` (a call the model made earlier in the conversation)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall

    def template_entry(self) -> dict[str, Any]:
        """The call as chat templates take it: ``arguments`` as an object (templates write it with ``tojson``),
        or the text as it came when it is not JSON."""
        try:
            arguments: Any = json.loads(self.function.arguments)
        except json.JSONDecodeError:
            arguments = self.function.arguments
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": arguments}}


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools mean for its generation: ``mode`` (``none`` when no tools or ``tool_choice:
    "none"``), the tools the template is given (none for mode ``none``), the function a named choice forces,
    and the grammar of a ``required`` or named reply."""

    mode: ToolChoiceMode
    tools: tuple[ToolDefinition, ...] = ()
    named: str | None = None
    parallel: bool = True

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        return [t.template_entry() for t in self.tools] if self.mode != "none" and self.tools else None

    def structured(self) -> StructuredOutput | None:
        """The grammar a ``required`` or named reply must match (None for ``auto`` and ``none``)."""
        if self.mode == "named":
            tool = next(t for t in self.tools if t.function.name == self.named)
            return StructuredOutput("json_schema", json.dumps(_arguments_schema(tool)))
        if self.mode != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": t.function.name}, "parameters": _arguments_schema(t)},
                "required": ["name", "parameters"],
            }
            for t in self.tools
        ]
        array: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
        if not self.parallel:
            array["maxItems"] = 1
        return StructuredOutput("json_schema", json.dumps(array))


def _arguments_schema(tool: ToolDefinition) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def tool_plan(
    tools: list[ToolDefinition] | None, tool_choice: str | dict[str, Any] | None, parallel: bool | None
) -> ToolPlan:
    """The :class:`ToolPlan` of a request's ``tools`` / ``tool_choice`` / ``parallel_tool_calls``; RequestError
    (naming the field) for a choice that names no given tool, a choice without tools, or two tools of one name."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise RequestError("tool_choice needs tools: the request gives none", param="tool_choice")
        return ToolPlan("none")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise RequestError(f"tools must have distinct function names, found {names}", param="tools")
    parallel = True if parallel is None else parallel
    if tool_choice is None or tool_choice in ("none", "auto", "required"):
        return ToolPlan(tool_choice or "auto", tuple(tools), parallel=parallel)  # type: ignore[arg-type]
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if tool_choice.get("type") == "function" and isinstance(name, str):
            if name not in names:
                raise RequestError(
                    f"tool_choice names the function {name!r}, which is not among the tools {names}",
                    param="tool_choice",
                )
            return ToolPlan("named", tuple(tools), named=name, parallel=parallel)
    raise RequestError(
        f"tool_choice must be 'none', 'auto', 'required' or {{'type': 'function', 'function': {{'name': ...}}}}, "
        f"found {tool_choice!r}",
        param="tool_choice",
    )


__all__ = ["FunctionDefinition", "ToolDefinition", "FunctionCall", "ToolCall", "ToolPlan", "tool_plan"]
