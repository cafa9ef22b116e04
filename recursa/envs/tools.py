"""Tools an environment offers the policy, the parsing of the policy's tool calls, and running them.

An env exposes tools with a `tools` attribute (or a `tools()` method, called after each
`reset`): a list of `Tool`s, each a name, a one-line description, a JSON-schema object of
its parameters and a Python callable taking those parameters as keyword arguments and
returning text (anything else is turned into text with `json.dumps` or `str`).

The policy calls a tool by writing a `<tool_call>` block. Two formats are read, both in
one reply as often as the policy likes:

    <tool_call>{"name": "search", "arguments": {"query": "Tarnwick"}}</tool_call>          Hermes / Qwen
    <tool_call>[{"name": "search", "arguments": {"query": "Tarnwick"}}, ...]</tool_call>  SmolLM2 (a JSON list)

`arguments` may also be a JSON string holding the object (the OpenAI wire form). Nothing
here raises on what the policy wrote: a block that is not JSON, names no tool or an unknown
one, has arguments that do not fit the schema, is longer than `max_call_chars`, or a tool
that raises or runs past its time, each becomes a `ToolResult` whose text says what went
wrong in one line, which the policy reads as the tool's reply (`run_calls`).

A tool that runs past its time is abandoned: its thread is left to finish on its own (Python
cannot stop a thread), the episode is told the call timed out and goes on.
"""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list, "object": dict, "null": type(None)}


@dataclass
class Tool:
    """One tool: `fn(**arguments)` runs it; `parameters` is a JSON-schema object."""

    name: str
    description: str
    parameters: dict[str, Any]
    fn: Callable[..., Any]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]*", self.name):
            raise ValueError(f"tool name must be an identifier-like string, got {self.name!r}")
        if not isinstance(self.parameters, dict) or self.parameters.get("type", "object") != "object":
            raise ValueError(f"tool {self.name!r}: parameters must be a JSON-schema object ({{'type': 'object', 'properties': ...}})")
        if not callable(self.fn):
            raise ValueError(f"tool {self.name!r}: fn must be callable")

    def schema(self) -> dict[str, Any]:
        """The tool in the OpenAI / chat-template form: {"type": "function", "function": {...}}."""
        return {"type": "function", "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


@dataclass
class ToolCall:
    """One call read from a reply: `error` is set (and name / arguments may be empty) when
    the block could not be read as a call."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    def describe(self) -> str:
        """`name({"arg": ...})`, or `<malformed tool call>`: what the episode's transcript shows."""
        if self.error and not self.name:
            return "<malformed tool call>"
        return f"{self.name}({json.dumps(self.arguments, ensure_ascii=False, sort_keys=True)})"


@dataclass
class ToolResult:
    call: ToolCall
    content: str  # what the policy reads back
    ok: bool  # the tool ran and returned
    seconds: float = 0.0
    fault: str | None = None  # "call": the policy's call was wrong (unreadable, unknown tool, bad arguments); "limit"; "tool": it raised or timed out


def has_tool_call(text: str) -> bool:
    return "<tool_call>" in (text or "")


def parse_tool_calls(text: str, max_call_chars: int = 4000) -> list[ToolCall]:
    """Every call in `text`'s `<tool_call>` blocks (an unclosed last block counts), in order;
    [] when there is none. A block that cannot be read is one `ToolCall` with `error` set."""
    calls: list[ToolCall] = []
    for body in _BLOCK.findall(text or ""):
        body = body.strip()
        if len(body) > max_call_chars:
            calls.append(ToolCall("", error=f"tool call of {len(body)} characters is longer than the limit of {max_call_chars}"))
            continue
        try:
            data = json.loads(body)
        except json.JSONDecodeError as exc:
            calls.append(ToolCall("", error=f"tool call is not valid JSON ({exc.msg} at character {exc.pos})"))
            continue
        for item in data if isinstance(data, list) else [data]:
            calls.append(_call_of(item))
    return calls


def _call_of(item: Any) -> ToolCall:
    if not isinstance(item, dict):
        return ToolCall("", error=f'a tool call must be a JSON object {{"name": ..., "arguments": {{...}}}}, got {type(item).__name__}')
    if "function" in item and isinstance(item["function"], dict):  # {"type": "function", "function": {...}}
        item = item["function"]
    name = item.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall("", error='a tool call needs a "name" string')
    args = item.get("arguments", item.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return ToolCall(name, error=f"the arguments of {name!r} are a string that is not JSON")
    if not isinstance(args, dict):
        return ToolCall(name, error=f"the arguments of {name!r} must be a JSON object, got {type(args).__name__}")
    return ToolCall(name, args)


def check_arguments(tool: Tool, args: dict[str, Any]) -> str | None:
    """What is wrong with `args` for `tool`'s schema (missing required, unknown when
    additionalProperties is false, wrong top-level type, not in enum), or None."""
    props = tool.parameters.get("properties", {}) or {}
    missing = [k for k in tool.parameters.get("required", []) if k not in args]
    if missing:
        return f"{tool.name} needs argument(s) {', '.join(missing)}"
    if tool.parameters.get("additionalProperties") is False:
        unknown = sorted(set(args) - set(props))
        if unknown:
            return f"{tool.name} takes no argument(s) {', '.join(unknown)}"
    for key, value in args.items():
        spec = props.get(key) or {}
        kind = spec.get("type")
        types = _JSON_TYPES.get(kind) if isinstance(kind, str) else None
        if types is not None and (not isinstance(value, types) or (kind in ("integer", "number") and isinstance(value, bool))):
            return f"argument {key!r} of {tool.name} must be {kind}, got {type(value).__name__}"
        if "enum" in spec and value not in spec["enum"]:
            return f"argument {key!r} of {tool.name} must be one of {spec['enum']}"
    return None


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


def _one_line(text: str, limit: int = 200) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def call_tool(tool: Tool, args: dict[str, Any], timeout: float) -> tuple[str, bool, float]:
    """Run `tool.fn(**args)` in a thread for at most `timeout` seconds: (text, ok, seconds).
    An exception or a timeout is a one-line text with ok = False."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = tool.fn(**args)
        except BaseException as exc:  # noqa: BLE001 - a tool's failure is an observation
            box["error"] = exc

    start = time.perf_counter()
    thread = threading.Thread(target=target, name=f"tool-{tool.name}", daemon=True)
    thread.start()
    thread.join(max(timeout, 0.0))
    seconds = time.perf_counter() - start
    if thread.is_alive():
        return f"error: {tool.name} timed out after {timeout:.1f} s", False, seconds
    if "error" in box:
        exc = box["error"]
        return f"error: {tool.name} raised {type(exc).__name__}: {_one_line(exc)}", False, seconds
    return _as_text(box.get("value")), True, seconds


@dataclass
class ToolBudget:
    """An episode's tool limits and what it has spent: at most `max_calls` calls and
    `seconds` seconds of tool time in all."""

    max_calls: int
    seconds: float
    calls: int = 0
    spent: float = 0.0
    refused: int = 0  # tool-call turns answered only with a limit message

    @property
    def exhausted(self) -> bool:
        return self.calls >= self.max_calls or self.spent >= self.seconds


def run_calls(calls: list[ToolCall], tools: list[Tool], budget: ToolBudget, max_result_chars: int = 2000) -> list[ToolResult]:
    """Run `calls` in order against `tools` within `budget` (updated in place): one result per
    call; every failure is a one-line result text, never an exception. A result longer than
    `max_result_chars` is cut, saying so."""
    by_name = {t.name: t for t in tools}
    out = []
    for call in calls:
        if call.error:
            out.append(ToolResult(call, f"error: {call.error}", False, fault="call"))
            continue
        tool = by_name.get(call.name)
        if tool is None:
            out.append(ToolResult(call, f"error: unknown tool {call.name!r}; tools: {', '.join(by_name) or 'none'}", False, fault="call"))
            continue
        if budget.calls >= budget.max_calls:
            out.append(ToolResult(call, f"error: the limit of {budget.max_calls} tool calls per episode is reached; give your answer", False, fault="limit"))
            continue
        if budget.spent >= budget.seconds:
            out.append(ToolResult(call, f"error: the episode's {budget.seconds:g} s of tool time are spent; give your answer", False, fault="limit"))
            continue
        problem = check_arguments(tool, call.arguments)
        if problem:
            out.append(ToolResult(call, f"error: {problem}", False, fault="call"))
            continue
        budget.calls += 1
        text, ok, seconds = call_tool(tool, call.arguments, budget.seconds - budget.spent)
        budget.spent += seconds
        if len(text) > max_result_chars:
            text = text[:max_result_chars] + f"... [cut at {max_result_chars} of {len(text)} characters]"
        out.append(ToolResult(call, text, ok, seconds, fault=None if ok else "tool"))
    return out


def tools_of(env: Any) -> list[Tool]:
    """The env's tools: its `tools` attribute, or what its `tools()` method returns; [] when none."""
    value = getattr(env, "tools", None)
    if callable(value):
        value = value()
    if not value:
        return []
    tools = list(value)
    bad = [t for t in tools if not isinstance(t, Tool)]
    if bad:
        raise ValueError(f"env {getattr(env, 'name', '?')!r}: tools must be recursa.envs.tools.Tool objects, got {type(bad[0]).__name__}")
    return tools


def tools_system_text(tools: list[Tool]) -> str:
    """The system-prompt block that describes `tools` to a template that does not render
    tools itself (the embedded SmolLM2's): the schemas in <tools>, and how to call them in the
    form the model was tuned on (a JSON list in one <tool_call> block)."""
    schemas = json.dumps([t.schema()["function"] for t in tools], ensure_ascii=False)
    return (
        "You can call these tools:\n"
        f"<tools>{schemas}</tools>\n"
        "To call tools, reply with only\n"
        '<tool_call>[{"name": "tool_name", "arguments": {"arg": "value"}}]</tool_call>\n'
        "and their results come back in <tool_response> blocks. When you know the answer, reply without a tool call."
    )
