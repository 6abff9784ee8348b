"""Checking what a chat request says about tools: `tools`, `tool_choice`, and the tool calls of earlier assistant
turns in `messages`. Every problem is an InvalidRequest naming the field (and the place in it).

tool_calls.py parses what the model answers and builds the constraint "required" and a named function need.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from kiln.serve.client_json import shown
from kiln.serve.errors import InvalidRequest

TOOL_CHOICES = ("none", "auto", "required")
# A function without `parameters` takes no arguments (OpenAI's meaning).
NO_PARAMETERS = {"type": "object", "properties": {}}
_TOOL_KEYS = frozenset({"type", "function"})
_FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})


@dataclass(frozen=True)
class Tool:
    """One function the model may call."""

    name: str
    parameters: dict  # the JSON schema of its arguments
    spec: dict  # the tool as the client sent it, for the chat template


@dataclass(frozen=True)
class ToolChoice:
    """`mode`: none (the output is plain text), auto (the output may be tool calls: parsed), required (one call
    of any tool: constrained) or function (one call of `tools[0]`: constrained). `tools`: those it may call."""

    mode: str
    tools: tuple[Tool, ...] = ()

    @property
    def constrained(self) -> bool:
        return self.mode in ("required", "function")


def check_tools(value) -> list[Tool]:
    """`tools` -> the functions, in order; null or [] is no tools."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidRequest(f"tools={shown(value)} is invalid: must be a list of "
                             '{"type": "function", "function": {"name": ..., "parameters": {...}}} objects', "tools")
    tools: list[Tool] = []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise InvalidRequest(f"{where}={shown(tool)} is invalid: must be an object with \"type\": \"function\" "
                                 "(the only kind of tool kiln serve runs)", "tools")
        _no_other_keys(tool, _TOOL_KEYS, where)
        function = tool.get("function")
        if not isinstance(function, dict):
            raise InvalidRequest(f"{where}.function={shown(function)} is invalid: must be an object with a 'name'",
                                 "tools")
        _no_other_keys(function, _FUNCTION_KEYS, f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not name.strip():
            raise InvalidRequest(f"{where}.function.name={shown(name)} is invalid: must be a non-empty string", "tools")
        if any(t.name == name for t in tools):
            raise InvalidRequest(f"{where}.function.name: the name {shown(name)} is used by two tools", "tools")
        for key, kind, rule in (("description", str, "a string"), ("strict", bool, "true or false")):
            if function.get(key) is not None and not isinstance(function[key], kind):
                raise InvalidRequest(f"{where}.function.{key}={shown(function[key])} is invalid: must be {rule}",
                                     "tools")
        parameters = function.get("parameters")
        if parameters is None:
            parameters = NO_PARAMETERS
        elif not isinstance(parameters, dict):
            raise InvalidRequest(f"{where}.function.parameters={shown(parameters)} is invalid: must be a JSON schema "
                                 "object such as {\"type\": \"object\", \"properties\": {...}}", "tools")
        tools.append(Tool(name, parameters, tool))
    return tools


def check_tool_choice(value, tools: list[Tool]) -> ToolChoice:
    """`tool_choice` -> what the model may do; the default is "auto" with tools and "none" without."""
    if value is None:
        return ToolChoice("auto", tuple(tools)) if tools else ToolChoice("none")
    if isinstance(value, str):
        if value not in TOOL_CHOICES:
            raise InvalidRequest(f"tool_choice={shown(value)} is invalid: must be one of {', '.join(TOOL_CHOICES)} "
                                 'or {"type": "function", "function": {"name": ...}}', "tool_choice")
        if value == "required" and not tools:
            raise InvalidRequest('tool_choice "required" needs tools: the request has none', "tool_choice")
        return ToolChoice(value, tuple(tools) if value != "none" else ())
    function = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise InvalidRequest(f"tool_choice={shown(value)} is invalid: must be one of {', '.join(TOOL_CHOICES)} or "
                             '{"type": "function", "function": {"name": ...}}', "tool_choice")
    chosen = [t for t in tools if t.name == name]
    if not chosen:
        known = ", ".join(t.name for t in tools) or "none"
        raise InvalidRequest(f"tool_choice names the function {shown(name)}, which is not in tools (tools: {known})",
                             "tool_choice")
    return ToolChoice("function", tuple(chosen))


def template_tool_calls(message: dict, i: int) -> list[dict] | None:
    """An assistant turn's `tool_calls` as chat templates take them: each call's `function.arguments` (JSON text
    in OpenAI's format) parsed into an object, as the Llama and Qwen templates expect (vLLM does the same)."""
    calls = message.get("tool_calls")
    if calls is None:
        return None
    where = f"messages[{i}].tool_calls"
    if message.get("role") != "assistant" or not isinstance(calls, list):
        raise InvalidRequest(f"{where} is invalid: only an assistant message may have tool_calls, a list of "
                             '{"id", "type": "function", "function": {"name", "arguments"}} objects', "messages")
    converted = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidRequest(f"{where}[{j}] must be an object whose 'function' has a 'name' string", "messages")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError as e:
                raise InvalidRequest(f"{where}[{j}].function.arguments is not valid JSON ({e})", "messages") from None
        if not isinstance(arguments, dict):
            raise InvalidRequest(f"{where}[{j}].function.arguments={shown(arguments)} is invalid: must be a JSON "
                                 "object (or its text)", "messages")
        converted.append({**call, "function": {**function, "arguments": arguments}})
    return converted


def with_text_arguments(messages: list[dict]) -> list[dict] | None:
    """The messages with each earlier call's arguments as JSON text instead of an object (for templates that add
    them to a string, as DeepSeek's do: `'...' + tool['function']['arguments']`); None when no message has calls."""
    if not any(m.get("tool_calls") for m in messages):
        return None
    return [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.dumps(
        c["function"]["arguments"], ensure_ascii=False)}} for c in m["tool_calls"]]} if m.get("tool_calls") else m
            for m in messages]


def _no_other_keys(value: dict, allowed: frozenset[str], where: str) -> None:
    for key in value:
        if key not in allowed:
            raise InvalidRequest(f"{where} has the unknown key {shown(key)}; it takes {', '.join(sorted(allowed))}",
                                 "tools")
