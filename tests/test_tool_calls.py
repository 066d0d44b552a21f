"""Tool calls read back from answers in each template's format, however the text is streamed."""

from __future__ import annotations

import json
import random

import pytest

from mlx_omnia.engine.text.tools import (
    GENERIC,
    HARMONY,
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    Event,
    Thought,
    ToolCall,
    ToolCallDelta,
    ToolFormat,
    merge_calls,
    tool_format,
)

CASES: list[tuple[ToolFormat, str, str, tuple[ToolCall, ...]]] = [
    (
        HERMES,
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
        '"n": [1, {"a": "}"}]}}\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": {}}\n'
        "</tool_call>",
        "Let me check.\n",
        (
            ToolCall("get_weather", '{"city": "Paris", "n": [1, {"a": "}"}]}'),
            ToolCall("b", "{}"),
        ),
    ),
    (HERMES, "plain < answer <tool with {json}", "plain < answer <tool with {json}", ()),
    (HERMES, "<tool_call>\nnot json</tool_call> after", "<tool_call>\nnot json</tool_call> after", ()),
    (
        HERMES,
        '<tool_call>\n{"arguments": {"x": 1}, "name": "late"}\n</tool_call>',
        "",
        (ToolCall("late", '{"x": 1}'),),
    ),
    (
        HERMES,
        '<tool_call>\n{"name": "s", "arguments": "{\\"x\\": 1}"}\n</tool_call>',
        "",
        (ToolCall("s", '{"x": 1}'),),
    ),
    (HERMES, '<tool_call>\n{"name": "cut", "arguments": {"x": "ab', "", (ToolCall("cut", '{"x": "ab'),)),
    (HERMES, 'Hi<tool_call>\n{"name": "a", "arguments": {}}</tool_call><tool_call>{"na', "Hi",
     (ToolCall("a", "{}"),)),
    (LLAMA3_JSON, '{"name": "f", "parameters": {"q": 1}}', "", (ToolCall("f", '{"q": 1}'),)),
    (LLAMA3_JSON, ' {"foo": 1} is json', ' {"foo": 1} is json', ()),
    (LLAMA3_JSON, 'The answer {"name": "x"}', 'The answer {"name": "x"}', ()),
    (
        MISTRAL,
        '[TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {"y": 2}}]',
        "",
        (ToolCall("a", '{"x": 1}'), ToolCall("b", '{"y": 2}')),
    ),
    (MISTRAL, "[TOOL_CALLS] nope", "[TOOL_CALLS] nope", ()),
    (
        GENERIC,
        'ok <tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>',
        "ok ",
        (ToolCall("a", '{"x": 1}'),),
    ),
]


def _read(fmt: ToolFormat, text: str, rng: random.Random, most: int) -> tuple[str, list[Event]]:
    parser = fmt.parser()
    events: list[Event] = []
    i = 0
    while i < len(text):
        n = rng.randint(1, most)
        events += parser.feed(text[i : i + n])
        i += n
    events += parser.finish()
    return "".join(e for e in events if isinstance(e, str)), events


@pytest.mark.parametrize(("fmt", "answer", "text", "calls"), CASES)
def test_calls_read_the_same_however_the_answer_is_cut(
    fmt: ToolFormat, answer: str, text: str, calls: tuple[ToolCall, ...]
) -> None:
    rng = random.Random(7)
    for most in (1, 2, 3, 7, len(answer)):
        got_text, events = _read(fmt, answer, rng, most)
        deltas = [e for e in events if isinstance(e, ToolCallDelta)]
        assert got_text == text
        assert merge_calls(deltas) == calls
        for index in range(len(calls)):  # each call names itself on its first delta only
            named = [d.name for d in deltas if d.index == index]
            assert named[0] == calls[index].name and not any(named[1:])


def test_arguments_stream_while_the_model_writes_them() -> None:
    parser = HERMES.parser()
    assert parser.feed('<tool_call>\n{"name": "f", "arguments": {"city": "Pa') == [
        ToolCallDelta(0, "f", ""),
        ToolCallDelta(0, None, '{"city": "Pa'),
    ]
    assert parser.feed('ris"}}\n</tool_call>') == [ToolCallDelta(0, None, 'ris"}')]
    assert parser.finish() == []
    assert parser.calls == 1


def test_format_follows_the_template() -> None:
    assert tool_format(None) is GENERIC
    assert tool_format("{% for m in messages %}{{ m.content }}{% endfor %}") is GENERIC
    qwen = "{% if tools %}{% for t in tools %}{{ t | tojson }}{% endfor %}<tool_call>{% endif %}"
    assert tool_format(qwen) is HERMES
    assert tool_format("{% if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]") is MISTRAL
    assert tool_format("{% if tools %}<|python_tag|>{% endif %}") is LLAMA3_JSON


def test_generic_form_puts_tools_calls_and_results_in_plain_turns() -> None:
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
        {"role": "tool", "tool_call_id": "c2", "content": "6"},
    ]
    out, template_tools = GENERIC.render(messages, tools)
    assert template_tools == []
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert '"name": "add"' in out[0]["content"]
    assert out[2]["content"] == '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>'
    assert out[3]["content"] == "<tool_response>\n5\n</tool_response>\n<tool_response>\n6\n</tool_response>"


def test_native_form_hands_arguments_to_the_template_as_objects() -> None:
    messages = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "function": {"name": "add", "arguments": '{"a": 2}'}}
    ]}]
    out, _ = HERMES.render(messages, [])
    assert out[0]["tool_calls"][0] == {
        "id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 2}}
    }
    assert out[0]["content"] == ""


def test_grammar_names_declared_tools_only() -> None:
    tools = [
        {"type": "function", "function": {"name": "a", "parameters": {
            "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}},
        {"type": "function", "function": {"name": "b"}},
    ]
    grammar = HERMES.grammar(tools, allowed=["a"], parallel=False)
    assert grammar.startswith("start: one\n")
    schema = json.loads(grammar.split("%json ", 1)[1].split("\n", 1)[0])
    assert [s["properties"]["name"] for s in schema["anyOf"]] == [{"const": "a"}]
    assert "<[5]>" in MISTRAL.grammar(tools, special_id={"[TOOL_CALLS]": 5})


def test_harmony_analysis_is_reasoning_apart_from_the_answer() -> None:
    parser = HARMONY.parser()
    events = parser.feed(
        "<|channel|>analysis<|message|>The user greets.<|end|><|start|>assistant"
        "<|channel|>final<|message|>Hello!"
    ) + parser.finish()
    assert events == [Thought("The user greets."), "Hello!"]
    assert HARMONY.structured and not HERMES.structured  # read even without tools
