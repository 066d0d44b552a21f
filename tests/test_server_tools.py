"""Tool calls through every dialect, driven by the official SDKs against a live omnia-server
running the real SmolLM2-135M-Instruct. Its template knows no tools, so the generic form is in
play (tools in a system turn, calls as <tool_call> JSON); the calls are forced by a grammar
(tool_choice required / named / any / ANY), so each test is deterministic. Each dialect does a
round trip (call -> result -> answer), streamed and not, and the stream's call equals the
whole answer's."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from google import genai
from google.genai import types

from mlx_omnia.server.settings import Settings
from tests.server_harness import LiveServer, live_server

MODEL = "smollm2-135m-instruct"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,  # else a small model goes on adding keys the schema allows
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
QUESTION = "What is the weather in Paris?"
CALL_TOKENS = 48  # a generic-form call of get_weather takes ~30


def _weather(args: dict[str, Any]) -> None:
    assert set(args) == {"city", "unit"} and isinstance(args["city"], str)
    assert args["unit"] in ("celsius", "fahrenheit")


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with live_server(Settings()) as s:
        yield s


# -- OpenAI chat ----------------------------------------------------------------------------------
OPENAI_TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
]


@pytest.fixture(scope="module")
def oai(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/api/openai/v1", api_key="unused", max_retries=0)


def test_openai_chat_round_trip(oai: openai.OpenAI) -> None:
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    forced: Any = {"type": "function", "function": {"name": "get_weather"}}
    r = oai.chat.completions.create(
        model=MODEL, messages=messages, tools=OPENAI_TOOLS, tool_choice=forced,
        max_tokens=CALL_TOKENS, temperature=0,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls or []
    assert len(calls) == 1 and calls[0].type == "function" and calls[0].id.startswith("call_")
    call = calls[0].function
    assert call.name == "get_weather"
    _weather(json.loads(call.arguments))

    # The same request streamed: the call comes as index/id/name, then argument deltas.
    stream = oai.chat.completions.create(
        model=MODEL, messages=messages, tools=OPENAI_TOOLS, tool_choice=forced,
        max_tokens=CALL_TOKENS, temperature=0, stream=True,
    )
    names, args, ids, finish = [], [], set[str](), None
    for chunk in stream:
        for d in chunk.choices[0].delta.tool_calls or []:
            assert d.index == 0
            if d.id:
                ids.add(d.id)
            if d.function and d.function.name:
                names.append(d.function.name)
            if d.function and d.function.arguments:
                args.append(d.function.arguments)
        finish = chunk.choices[0].finish_reason or finish
    assert names == ["get_weather"] and len(ids) == 1 and finish == "tool_calls"
    assert "".join(args) == call.arguments and len(args) > 1  # streamed as written

    # The result goes back; the model answers in text (no tool choice forced).
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": calls[0].id, "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": '{"temperature": 21}'},
    ]
    answer = oai.chat.completions.create(
        model=MODEL, messages=messages, tools=OPENAI_TOOLS, max_tokens=12, temperature=0
    )
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert answer.usage is not None and answer.usage.prompt_tokens > r.usage.prompt_tokens  # type: ignore[union-attr]
    assert "<tool_call>" not in (answer.choices[0].message.content or "")


def test_openai_required_parallel_off_gives_one_call(oai: openai.OpenAI) -> None:
    r = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Add 2 and 3."}], tools=OPENAI_TOOLS,
        tool_choice="required", parallel_tool_calls=False, max_tokens=CALL_TOKENS, temperature=0,
    )
    calls = r.choices[0].message.tool_calls or []
    assert len(calls) == 1 and calls[0].function.name in ("get_weather", "add")
    assert isinstance(json.loads(calls[0].function.arguments), dict)


def test_openai_tool_errors(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], tools=OPENAI_TOOLS,
            tool_choice={"type": "function", "function": {"name": "nope"}}, max_tokens=2,
        )
    assert e.value.body and "tool_choice.function.name" in str(e.value.body)
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(
            model=MODEL, max_tokens=2,
            messages=[{"role": "tool", "content": "x"}],  # type: ignore[list-item]
        )
    assert "tool_call_id" in str(e.value.body)


# -- OpenAI Responses -----------------------------------------------------------------------------
RESPONSES_TOOLS: list[Any] = [
    {"type": "function", "name": "get_weather", "description": "Weather in a city",
     "parameters": WEATHER, "strict": False},
    {"type": "namespace", "name": "math", "description": "Arithmetic",  # Codex's grouping
     "tools": [{"type": "function", "name": "add", "parameters": ADD}]},
]


def test_responses_round_trip_with_stored_response(oai: openai.OpenAI) -> None:
    first = oai.responses.create(
        model=MODEL, input=QUESTION, tools=RESPONSES_TOOLS,
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=CALL_TOKENS,
        temperature=0,
    )
    assert first.status == "completed"
    calls = [o for o in first.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].status == "completed"
    _weather(json.loads(calls[0].arguments))
    assert oai.responses.retrieve(first.id).output[0].type == "function_call"

    # Streamed: an output item added, argument deltas, the done events, the same call.
    events = list(oai.responses.create(
        model=MODEL, input=QUESTION, tools=RESPONSES_TOOLS,
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=CALL_TOKENS,
        temperature=0, stream=True, store=False,
    ))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert "".join(deltas) == done.arguments == calls[0].arguments
    assert kinds[-1] == "response.completed"

    # The result follows the stored response by its id.
    follow = oai.responses.create(
        model=MODEL, previous_response_id=first.id, tools=RESPONSES_TOOLS, max_output_tokens=12,
        temperature=0,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                "output": '{"temperature": 21}'}],
    )
    assert follow.previous_response_id == first.id and follow.status in ("completed", "incomplete")
    assert follow.usage is not None and first.usage is not None
    assert follow.usage.input_tokens > first.usage.input_tokens

    # The same conversation sent whole (stateless, as Codex does) reads the same prompt.
    whole = oai.responses.create(
        model=MODEL, tools=RESPONSES_TOOLS, max_output_tokens=12, temperature=0, store=False,
        input=[
            {"role": "user", "content": QUESTION},
            {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
             "arguments": calls[0].arguments},
            {"type": "function_call_output", "call_id": calls[0].call_id,
             "output": '{"temperature": 21}'},
        ],
    )
    assert whole.usage is not None and whole.usage.input_tokens == follow.usage.input_tokens
    assert whole.output_text == follow.output_text
    oai.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(first.id)


def test_responses_refuses_hosted_tools(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=MODEL, input="hi", tools=[{"type": "web_search"}])
    assert "tools[0].type" in str(e.value.body)


# -- Anthropic ------------------------------------------------------------------------------------
ANTHROPIC_TOOLS: list[Any] = [
    {"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER,
     "cache_control": {"type": "ephemeral"}},
    {"name": "add", "input_schema": ADD},
]


@pytest.fixture(scope="module")
def claude(server: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=f"{server.url}/api/anthropic", api_key="unused", max_retries=0
    )


def test_anthropic_round_trip(claude: anthropic.Anthropic) -> None:
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    forced: Any = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
    msg = claude.messages.create(
        model=MODEL, max_tokens=CALL_TOKENS, messages=messages, tools=ANTHROPIC_TOOLS,
        tool_choice=forced, extra_body={"temperature": 0},
    )
    assert msg.stop_reason == "tool_use"
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")
    _weather(dict(uses[0].input))  # type: ignore[arg-type]

    with claude.messages.stream(
        model=MODEL, max_tokens=CALL_TOKENS, messages=messages, tools=ANTHROPIC_TOOLS,
        tool_choice=forced, extra_body={"temperature": 0},
    ) as stream:
        partial = [e.delta.partial_json for e in stream
                   if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
        final = stream.get_final_message()
    streamed = [b for b in final.content if b.type == "tool_use"]
    assert len(streamed) == 1 and streamed[0].input == uses[0].input and len(partial) > 1
    assert final.stop_reason == "tool_use"

    messages += [
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."}, *[
            {"type": "tool_use", "id": uses[0].id, "name": uses[0].name, "input": uses[0].input}
        ]]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": uses[0].id, "content": "21 degrees",
             "cache_control": {"type": "ephemeral"}},
        ]},
    ]
    answer = claude.messages.create(
        model=MODEL, max_tokens=12, messages=messages, tools=ANTHROPIC_TOOLS,
        extra_body={"temperature": 0},
    )
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert answer.usage.input_tokens > msg.usage.input_tokens


def test_anthropic_accepts_what_claude_code_sends(claude: anthropic.Anthropic) -> None:
    msg = claude.messages.create(
        model=MODEL, max_tokens=2, tools=ANTHROPIC_TOOLS,
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": "hi"}],
        extra_body={
            "temperature": 0, "thinking": {"type": "adaptive", "display": "omitted"},
            "metadata": {"user_id": '{"session_id": "x"}'},
        },
    )
    assert msg.stop_reason in ("end_turn", "max_tokens")


# -- Gemini ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gemini(server: LiveServer) -> genai.Client:
    return genai.Client(
        api_key="unused",
        http_options=types.HttpOptions(base_url=f"{server.url}/api/gemini", api_version="v1beta"),
    )


GEMINI_TOOLS = [types.Tool(function_declarations=[
    types.FunctionDeclaration(
        name="get_weather", description="Weather in a city", parameters_json_schema=WEATHER
    ),
    types.FunctionDeclaration(  # Gemini's own schema: upper-case types
        name="add",
        parameters=types.Schema(
            type=types.Type.OBJECT,
            properties={"a": types.Schema(type=types.Type.INTEGER),
                        "b": types.Schema(type=types.Type.INTEGER, nullable=True)},
            required=["a", "b"],
        ),
    ),
])]


def test_gemini_round_trip(gemini: genai.Client) -> None:
    config = types.GenerateContentConfig(
        tools=GEMINI_TOOLS, temperature=0, max_output_tokens=CALL_TOKENS,
        automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True),
        tool_config=types.ToolConfig(function_calling_config=types.FunctionCallingConfig(
            mode=types.FunctionCallingConfigMode.ANY, allowed_function_names=["get_weather"])),
    )
    r = gemini.models.generate_content(model=MODEL, contents=QUESTION, config=config)
    calls = r.function_calls or []
    assert len(calls) >= 1 and calls[0].name == "get_weather"
    _weather(dict(calls[0].args or {}))
    assert r.candidates and r.candidates[0].finish_reason in (
        types.FinishReason.STOP, types.FinishReason.MAX_TOKENS  # ANY may call again and again
    )

    streamed = [
        c for chunk in gemini.models.generate_content_stream(
            model=MODEL, contents=QUESTION, config=config)
        for c in chunk.function_calls or []
    ]
    assert [(c.name, c.args) for c in streamed] == [(c.name, c.args) for c in calls]

    contents = [
        types.Content(role="user", parts=[types.Part(text=QUESTION)]),
        types.Content(role="model", parts=[types.Part(function_call=calls[0])]),
        types.Content(role="user", parts=[types.Part(function_response=types.FunctionResponse(
            name="get_weather", response={"temperature": 21}))]),
    ]
    answer = gemini.models.generate_content(
        model=MODEL, contents=contents,
        config=types.GenerateContentConfig(tools=GEMINI_TOOLS, temperature=0, max_output_tokens=12),
    )
    assert answer.text is not None and "<tool_call>" not in answer.text
    assert answer.usage_metadata and r.usage_metadata
    assert (answer.usage_metadata.prompt_token_count or 0) > (r.usage_metadata.prompt_token_count or 0)


def test_gemini_refuses_other_tools(server: LiveServer) -> None:
    r = httpx.post(
        f"{server.url}/api/gemini/v1beta/models/{MODEL}:generateContent",
        json={"contents": [{"parts": [{"text": "hi"}]}], "tools": [{"codeExecution": {}}]},
    )
    assert r.status_code == 400 and "tools[0].codeExecution" in r.json()["error"]["message"]
