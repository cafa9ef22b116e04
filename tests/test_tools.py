"""The tool-call parser and runner (recursa/envs/tools.py) against hand-written replies."""

from __future__ import annotations

import time

import pytest

from recursa.envs.tools import Tool, ToolBudget, ToolCall, check_arguments, parse_tool_calls, run_calls, tools_of


def _search(query: str, k: int = 2) -> list[str]:
    return [f"{query} {i}" for i in range(k)]


SEARCH = Tool("search", "Search the notes.", {"type": "object", "properties": {"query": {"type": "string"}, "k": {"type": "integer"}},
                                               "required": ["query"], "additionalProperties": False}, _search)


def test_hermes_qwen_form_one_block_per_call():
    text = ('I will look.\n<tool_call>\n{"name": "search", "arguments": {"query": "Tarnwick"}}\n</tool_call>\n'
            '<tool_call>{"name": "search", "arguments": {"query": "Ossary", "k": 1}}</tool_call>')
    assert parse_tool_calls(text) == [ToolCall("search", {"query": "Tarnwick"}), ToolCall("search", {"query": "Ossary", "k": 1})]


def test_smollm2_form_a_list_in_one_block():
    text = '<tool_call>[{"name": "search", "arguments": {"query": "a"}}, {"name": "search", "arguments": {"query": "b"}}]</tool_call>'
    assert [c.arguments["query"] for c in parse_tool_calls(text)] == ["a", "b"]


def test_openai_wire_forms_string_arguments_and_function_wrapper():
    text = '<tool_call>{"type": "function", "function": {"name": "search", "arguments": "{\\"query\\": \\"x\\"}"}}</tool_call>'
    assert parse_tool_calls(text) == [ToolCall("search", {"query": "x"})]


def test_no_block_is_no_call_and_an_unclosed_last_block_counts():
    assert parse_tool_calls("go north") == []
    assert parse_tool_calls('<tool_call>{"name": "search", "arguments": {"query": "q"}}') == [ToolCall("search", {"query": "q"})]


@pytest.mark.parametrize("body, says", [
    ("{not json", "not valid JSON"),
    ('"search"', "must be a JSON object"),
    ('{"arguments": {}}', 'needs a "name"'),
    ('{"name": "search", "arguments": [1]}', "must be a JSON object, got list"),
    ('{"name": "search", "arguments": "{oops"}', "string that is not JSON"),
    ("", "not valid JSON"),
])
def test_malformed_blocks_are_calls_with_an_error(body, says):
    (call,) = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert call.error and says in call.error and "\n" not in call.error


def test_a_huge_block_is_refused_unread():
    (call,) = parse_tool_calls("<tool_call>" + "{" * 10_000 + "</tool_call>", max_call_chars=100)
    assert call.error == "tool call of 10000 characters is longer than the limit of 100"


def test_arguments_against_the_schema():
    assert check_arguments(SEARCH, {"query": "q"}) is None
    assert check_arguments(SEARCH, {}) == "search needs argument(s) query"
    assert check_arguments(SEARCH, {"query": "q", "page": 2}) == "search takes no argument(s) page"
    assert check_arguments(SEARCH, {"query": 3}) == "argument 'query' of search must be string, got int"
    assert check_arguments(SEARCH, {"query": "q", "k": True}) == "argument 'k' of search must be integer, got bool"


def test_run_calls_results_faults_and_limits():
    def boom(**_):
        raise KeyError("gone")

    def slow(**_):
        time.sleep(2)
        return "late"

    tools = [SEARCH, Tool("boom", "", {"type": "object"}, boom), Tool("slow", "", {"type": "object"}, slow)]
    budget = ToolBudget(max_calls=3, seconds=0.3)
    calls = parse_tool_calls('<tool_call>[{"name": "search", "arguments": {"query": "q", "k": 1}}, {"name": "nope", "arguments": {}}, '
                             '{"name": "boom", "arguments": {}}, {"name": "slow", "arguments": {}}, {"name": "search", "arguments": {"query": "z"}}]</tool_call>')
    results = run_calls(calls, tools, budget)
    assert [r.content for r in results[:3]] == ['["q 0"]', "error: unknown tool 'nope'; tools: search, boom, slow", "error: boom raised KeyError: 'gone'"]
    assert results[3].content.startswith("error: slow timed out after 0.") and results[3].fault == "tool"
    assert results[4].content == "error: the limit of 3 tool calls per episode is reached; give your answer" and results[4].fault == "limit"
    assert [r.fault for r in results[:3]] == [None, "call", "tool"] and budget.calls == 3 and budget.exhausted


def test_long_results_are_cut_saying_so():
    tool = Tool("echo", "", {"type": "object"}, lambda: "y" * 50)
    (r,) = run_calls([ToolCall("echo")], [tool], ToolBudget(5, 5.0), max_result_chars=10)
    assert r.content == "y" * 10 + "... [cut at 10 of 50 characters]"


def test_bad_tool_definitions_are_one_line():
    with pytest.raises(ValueError, match="identifier-like"):
        Tool("two words", "", {"type": "object"}, _search)
    with pytest.raises(ValueError, match="JSON-schema object"):
        Tool("t", "", {"type": "array"}, _search)

    class Env:
        name = "e"
        tools = ["search"]

    with pytest.raises(ValueError, match="must be recursa.envs.tools.Tool objects"):
        tools_of(Env())
