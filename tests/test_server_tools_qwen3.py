"""Tool round trips on Qwen3's real chat template, through every dialect's official SDK: a call
forced by the grammar (tool choice named / any / ANY), streamed and not, then its result sent
back and an answer. The model is the scripted qwen3 (tests/fixtures/scripted_qwen3.py): under
the grammar its weights choose among the allowed tokens like a random model's (the schemas use
enums and bounded integers, so a call ends), and after the result it reasons and answers its
fixed text. Each follow-up must render as Qwen3's template renders the same conversation:
the call in `<tool_call>`, the result in `<tool_response>`, token for token."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import jsonschema
import openai
import pytest
from google import genai
from google.genai import types
from llguidance import LLMatcher

from mlx_omnia import load
from mlx_omnia.engine.model import Model
from mlx_omnia.engine.text.tools import HERMES
from mlx_omnia.engine.types import Chat, ChatMessage
from mlx_omnia.server.settings import Settings
from tests.fixtures.scripted_qwen3 import ANSWER, REASONING
from tests.server_harness import (
    LiveServer,
    anthropic_client,
    gemini_client,
    live_server,
    openai_client,
)

MODEL = "scripted-qwen3"
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Lyon"]},
                   "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                   "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
TOOLS: list[Any] = [  # OpenAI chat's shape, the engine's
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers",
                                      "parameters": ADD}},
]
QUESTION = "What is the weather in Paris?"
RESULT = {"temperature": 21}
CALL_TOKENS = 40  # a call of get_weather takes ~29 tokens


@pytest.fixture(scope="module")
def model(scripted_qwen3_dir: Path) -> Model:
    return load(scripted_qwen3_dir)


@pytest.fixture(scope="module")
def server(scripted_qwen3_dir: Path) -> Iterator[LiveServer]:
    with live_server(Settings(), models=[scripted_qwen3_dir]) as s:
        yield s


def _valid(name: str, arguments: str | dict[str, Any]) -> dict[str, Any]:
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(args, SCHEMAS[name])
    return args


def _follow_up(model: Model, name: str, arguments: dict[str, Any]) -> int:
    """The prompt tokens of the conversation after the call's result, rendered by the engine
    from OpenAI chat's messages; checks the render shows Qwen3's call and result markup."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}
    messages: tuple[ChatMessage, ...] = (
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": json.dumps(RESULT)},
    )
    ids = model.encode(Chat(messages, tools=tuple(TOOLS)))
    text = model.tokenizer.decode(ids, skip_special_tokens=False)
    assert f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>' in text
    assert f"<|im_start|>user\n<tool_response>\n{json.dumps(RESULT)}\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    return len(ids)


def test_the_template_asks_for_hermes_calls_and_a_gap_between_calls_is_bounded(
    model: Model,
) -> None:
    assert model.tokenizer.tool_format is HERMES
    special = model.tokenizer.special_ids(HERMES.markers)
    grammar = HERMES.grammar(TOOLS, parallel=True, special_id=special)
    call = '{"name": "add", "arguments": {"a": 1, "b": 2}}'

    def accepts(gap: str) -> bool:
        matcher = LLMatcher(model.grammar_tokenizer(), grammar, log_level=0)
        begin, end = special["<tool_call>"], special["</tool_call>"]
        body = model.tokenizer.encode(call, add_special_tokens=False)
        ids = [begin, *body, end, *model.tokenizer.encode(gap, add_special_tokens=False), begin]
        return matcher.try_consume_tokens(ids) == len(ids)

    assert accepts("\n") and accepts("\n\n")
    assert not accepts("\n\n\n")  # a model may not idle on blank lines between calls


# -- OpenAI chat ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def oai(server: LiveServer) -> openai.OpenAI:
    return openai_client(server)


@pytest.mark.parametrize("choice", [
    {"type": "function", "function": {"name": "get_weather"}}, "required",
], ids=["named", "required"])
def test_openai_chat_round_trip(oai: openai.OpenAI, model: Model, choice: Any) -> None:
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    r = oai.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice=choice, max_tokens=CALL_TOKENS,
    )
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    calls = r.choices[0].message.tool_calls or []
    assert len(calls) == 1 and calls[0].type == "function"
    call = calls[0].function
    assert choice == "required" or call.name == "get_weather"
    arguments = _valid(call.name, call.arguments)

    stream = oai.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice=choice, max_tokens=CALL_TOKENS,
        stream=True,
    )
    names, args, finish = [], [], None
    for chunk in stream:
        for d in chunk.choices[0].delta.tool_calls or []:
            names += [d.function.name] if d.function and d.function.name else []
            args += [d.function.arguments] if d.function and d.function.arguments else []
        finish = chunk.choices[0].finish_reason or finish
    assert (names, "".join(args), finish) == ([call.name], call.arguments, "tool_calls")

    messages += [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": calls[0].id, "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": json.dumps(RESULT)},
    ]
    answer = oai.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    message = answer.choices[0].message
    assert (message.content, message.tool_calls) == (ANSWER, None)
    assert (message.model_extra or {}).get("reasoning_content") == REASONING
    assert answer.usage is not None
    assert answer.usage.prompt_tokens == _follow_up(model, call.name, arguments)


# -- OpenAI Responses -----------------------------------------------------------------------------
RESPONSES_TOOLS: list[Any] = [
    {"type": "function", "name": t["function"]["name"],
     "description": t["function"]["description"], "parameters": t["function"]["parameters"],
     "strict": True}
    for t in TOOLS
]


def test_responses_round_trip(oai: openai.OpenAI, model: Model) -> None:
    forced: Any = {"type": "function", "name": "get_weather"}
    first = oai.responses.create(
        model=MODEL, input=QUESTION, tools=RESPONSES_TOOLS, tool_choice=forced,
        max_output_tokens=CALL_TOKENS, parallel_tool_calls=False,
    )
    calls = [o for o in first.output if o.type == "function_call"]
    assert [o.type for o in first.output] == ["function_call"] and first.status == "completed"
    assert calls[0].name == "get_weather"
    arguments = _valid(calls[0].name, calls[0].arguments)

    events = list(oai.responses.create(
        model=MODEL, input=QUESTION, tools=RESPONSES_TOOLS, tool_choice=forced,
        max_output_tokens=CALL_TOKENS, parallel_tool_calls=False, stream=True, store=False,
    ))
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [(d.name, d.arguments) for d in done] == [("get_weather", calls[0].arguments)]
    assert "".join(deltas) == calls[0].arguments and events[-1].type == "response.completed"

    follow = oai.responses.create(
        model=MODEL, previous_response_id=first.id, tools=RESPONSES_TOOLS, input=[
            {"type": "function_call_output", "call_id": calls[0].call_id,
             "output": json.dumps(RESULT)}],
    )
    assert [o.type for o in follow.output] == ["reasoning", "message"]
    assert follow.output_text == ANSWER and follow.usage is not None
    assert follow.usage.input_tokens == _follow_up(model, "get_weather", arguments)


# -- Anthropic ------------------------------------------------------------------------------------
ANTHROPIC_TOOLS: list[Any] = [
    {"name": t["function"]["name"], "description": t["function"]["description"],
     "input_schema": t["function"]["parameters"]}
    for t in TOOLS
]


@pytest.fixture(scope="module")
def claude(server: LiveServer) -> anthropic.Anthropic:
    return anthropic_client(server)


@pytest.mark.parametrize("choice", [
    {"type": "tool", "name": "get_weather"}, {"type": "any", "disable_parallel_tool_use": True},
], ids=["named", "any"])
def test_anthropic_round_trip(claude: anthropic.Anthropic, model: Model, choice: Any) -> None:
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    msg = claude.messages.create(
        model=MODEL, max_tokens=CALL_TOKENS, messages=messages, tools=ANTHROPIC_TOOLS,
        tool_choice=choice,
    )
    assert msg.stop_reason == "tool_use" and [b.type for b in msg.content] == ["tool_use"]
    use = msg.content[0]
    assert use.type == "tool_use"
    assert choice["type"] == "any" or use.name == "get_weather"
    arguments = _valid(use.name, dict(use.input))  # type: ignore[arg-type]

    with claude.messages.stream(
        model=MODEL, max_tokens=CALL_TOKENS, messages=messages, tools=ANTHROPIC_TOOLS,
        tool_choice=choice,
    ) as stream:
        partial = [e.delta.partial_json for e in stream
                   if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
        final = stream.get_final_message()
    streamed = [(b.name, b.input) for b in final.content if b.type == "tool_use"]
    assert streamed == [(use.name, use.input)] and final.stop_reason == "tool_use"
    assert json.loads("".join(partial)) == use.input and len(partial) > 1

    messages += [
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": use.id, "content": json.dumps(RESULT)}]},
    ]
    answer = claude.messages.create(
        model=MODEL, max_tokens=64, messages=messages, tools=ANTHROPIC_TOOLS,
        thinking={"type": "enabled", "budget_tokens": 1024},
    )
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None))
            for b in answer.content] == [("thinking", REASONING), ("text", ANSWER)]
    # Anthropic's input_tokens leave out what the prefix cache read (earlier tests' turns)
    read = answer.usage.cache_read_input_tokens or 0
    assert answer.usage.input_tokens + read == _follow_up(model, use.name, arguments)


# -- Gemini ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gemini(server: LiveServer) -> genai.Client:
    return gemini_client(server)


GEMINI_TOOLS = [types.Tool(function_declarations=[
    types.FunctionDeclaration(name=t["function"]["name"], description=t["function"]["description"],
                              parameters_json_schema=t["function"]["parameters"])
    for t in TOOLS
])]


@pytest.mark.parametrize("allowed", [["get_weather"], None], ids=["named", "any"])
def test_gemini_round_trip(gemini: genai.Client, model: Model, allowed: list[str] | None) -> None:
    config = types.GenerateContentConfig(
        tools=GEMINI_TOOLS, max_output_tokens=CALL_TOKENS,
        automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True),
        tool_config=types.ToolConfig(function_calling_config=types.FunctionCallingConfig(
            mode=types.FunctionCallingConfigMode.ANY, allowed_function_names=allowed)),
    )
    r = gemini.models.generate_content(model=MODEL, contents=QUESTION, config=config)
    calls = r.function_calls or []
    assert len(calls) == 1 and calls[0].name is not None
    assert allowed is None or calls[0].name == "get_weather"
    arguments = _valid(calls[0].name, dict(calls[0].args or {}))
    assert r.candidates and r.candidates[0].finish_reason == types.FinishReason.STOP

    streamed = [c for chunk in gemini.models.generate_content_stream(
        model=MODEL, contents=QUESTION, config=config) for c in chunk.function_calls or []]
    assert [(c.name, c.args) for c in streamed] == [(c.name, c.args) for c in calls]

    contents = [
        types.Content(role="user", parts=[types.Part(text=QUESTION)]),
        types.Content(role="model", parts=[types.Part(function_call=calls[0])]),
        types.Content(role="user", parts=[types.Part(function_response=types.FunctionResponse(
            name=calls[0].name, response=RESULT))]),
    ]
    answer = gemini.models.generate_content(
        model=MODEL, contents=contents, config=types.GenerateContentConfig(tools=GEMINI_TOOLS))
    assert answer.text == ANSWER and answer.usage_metadata is not None
    assert answer.usage_metadata.prompt_token_count == _follow_up(model, calls[0].name, arguments)
