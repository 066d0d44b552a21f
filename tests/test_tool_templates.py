"""Real chat templates (hub copies from the trl wheel) in the tool path: each is read as the
right call format, renders tools and a history of calls and results exactly as transformers
does, its model's answers parse into the right calls however they stream, and a call forced on
a tiny random model in that format always parses."""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from llguidance import LLMatcher
from tokenizers import AddedToken, Tokenizer
from transformers.utils.chat_template_utils import render_jinja_template

from mlx_omnia import load
from mlx_omnia.engine.text.chat_template import ChatTemplate
from mlx_omnia.engine.text.tools import (
    DEEPSEEK,
    GLM45,
    HARMONY,
    HERMES,
    LLAMA3_JSON,
    Event,
    Thought,
    ToolCall,
    ToolCallDelta,
    ToolFormat,
    merge_calls,
    tool_format,
)
from mlx_omnia.engine.types import Chat, GenerationOptions
from tests.fixtures.templates import chat_template
from tests.fixtures.tiny import write_tiny_llama

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "description": "City name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city"],
}
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the weather for a city", "parameters": WEATHER}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two integers", "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"]}}},
]


def _call(id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": id, "type": "function", "function": {"name": name, "arguments": arguments}}


ONE_CALL = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        _call("call_1", "get_weather", '{"city": "Paris"}')]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "unit": "C"}'},
]
TWO_CALLS = [
    {"role": "user", "content": "Weather in Paris and Lyon, and 2+3?"},
    {"role": "assistant", "content": "", "tool_calls": [
        _call("call_1", "get_weather", '{"city": "Paris", "days": 2}'),
        _call("call_2", "add", '{"a": 2, "b": 3}')]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "5"},
    {"role": "assistant", "content": "Sunny in Paris; 2+3 is 5."},
    {"role": "user", "content": "And Lyon?"},
]


@dataclass(frozen=True)
class Model:
    """A real template, its model's special tokens, and an answer as that model writes it."""

    repo: str
    format: ToolFormat
    specials: Mapping[str, str | None]
    rendered_call: str  # how the template writes ONE_CALL's call into the prompt
    answer: str
    text: str
    calls: tuple[ToolCall, ...]
    parallel_history: bool = True  # the template takes TWO_CALLS (Llama 3's refuses two calls)


PARIS = ToolCall("get_weather", '{"city": "Paris", "unit": "celsius"}')
MODELS = [
    Model(
        "Qwen/Qwen3-8B", HERMES, {"bos_token": None, "eos_token": "<|im_end|>"},
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "<think>\nThe user wants two things.\n</think>\n\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
        "<think>\nThe user wants two things.\n</think>\n\n",
        (PARIS, ToolCall("add", '{"a": 2, "b": 3}')),
    ),
    Model(
        "meta-llama/Llama-3.1-8B-Instruct", LLAMA3_JSON,
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
        '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
        "", (PARIS,), parallel_history=False,
    ),
    Model(
        "meta-llama/Llama-3.2-1B-Instruct", LLAMA3_JSON,
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
        '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
        '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
        "", (PARIS,), parallel_history=False,
    ),
    Model(
        "openai/gpt-oss-20b", HARMONY, {"bos_token": "<|startoftext|>", "eos_token": "<|return|>"},
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>'
        '{"city": "Paris"}<|call|>',
        "<|channel|>analysis<|message|>The user asks for Paris weather. Use get_weather.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Paris", "unit": "celsius"}<|call|>',
        "", (PARIS,),
    ),
    Model(
        "deepseek-ai/DeepSeek-R1", DEEPSEEK,
        {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"},
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
        '```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        "The user wants two things.\n</think>\n\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function"
        '<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris", "unit": "celsius"}\n```'
        "<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n"
        '{"a": 2, "b": 3}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        "The user wants two things.\n</think>\n\n",
        (PARIS, ToolCall("add", '{"a": 2, "b": 3}')),
    ),
    Model(
        "zai-org/GLM-4.5", GLM45, {"bos_token": None, "eos_token": "<|endoftext|>"},
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
        "<think>The user wants two things.</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>"
        "\n<arg_value>Paris</arg_value>\n<arg_key>unit</arg_key>\n<arg_value>celsius</arg_value>\n"
        "</tool_call>\n<tool_call>add\n<arg_key>a</arg_key>\n<arg_value>2</arg_value>\n"
        "<arg_key>b</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
        "<think>The user wants two things.</think>\n",
        (PARIS, ToolCall("add", '{"a": 2, "b": 3}')),
    ),
]
BY_REPO = {m.repo: m for m in MODELS}


def _ids(models: list[Model]) -> list[str]:
    return [m.repo.split("/")[1] for m in models]


def _ours(model: Model, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> str:
    template = ChatTemplate(chat_template(model.repo), special_tokens=model.specials)
    prepared, template_tools = model.format.render(messages, tools)
    return template.render(prepared, tools=template_tools)


def _transformers(model: Model, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> str:
    prepared, template_tools = model.format.render(messages, tools)
    specials = {k: v for k, v in model.specials.items() if v is not None}
    rendered, _ = render_jinja_template(
        [prepared], tools=template_tools or None, chat_template=chat_template(model.repo),
        add_generation_prompt=True, **specials,
    )
    return rendered[0]


@pytest.mark.parametrize("model", MODELS, ids=_ids(MODELS))
def test_the_template_is_read_as_its_call_format(model: Model) -> None:
    assert tool_format(chat_template(model.repo)) is model.format


@pytest.mark.parametrize("model", MODELS, ids=_ids(MODELS))
def test_a_history_of_calls_renders_as_transformers_renders_it(model: Model) -> None:
    histories = [ONE_CALL[:2], ONE_CALL] + ([TWO_CALLS] if model.parallel_history else [])
    for history in histories:
        for tools in (TOOLS, []):
            assert _ours(model, history, tools) == _transformers(model, history, tools)
    prompt = _ours(model, ONE_CALL, TOOLS)
    assert model.rendered_call in prompt  # the arguments as the template wants them
    assert "Get the weather for a city" in prompt  # the tools are described somewhere


def test_gpt_oss_gets_each_of_several_calls_with_its_own_result() -> None:
    prompt = _ours(BY_REPO["openai/gpt-oss-20b"], TWO_CALLS, TOOLS)
    assert (
        "to=functions.get_weather<|channel|>commentary json<|message|>"
        '{"city": "Paris", "days": 2}<|call|><|start|>functions.get_weather to=assistant'
        '<|channel|>commentary<|message|>"sunny"<|end|><|start|>assistant to=functions.add'
        '<|channel|>commentary json<|message|>{"a": 2, "b": 3}<|call|><|start|>functions.add '
        'to=assistant<|channel|>commentary<|message|>"5"<|end|>'
    ) in prompt


def _read(fmt: ToolFormat, text: str, rng: random.Random, most: int) -> list[Event]:
    parser = fmt.parser(TOOLS)
    events: list[Event] = []
    i = 0
    while i < len(text):
        n = rng.randint(1, most)
        events += parser.feed(text[i : i + n])
        i += n
    return events + parser.finish()


@pytest.mark.parametrize("model", MODELS, ids=_ids(MODELS))
def test_the_models_answer_parses_into_its_calls_however_it_streams(model: Model) -> None:
    rng = random.Random(11)
    for most in (1, 2, 3, 5, 8, 13, len(model.answer)):
        for _ in range(3):
            events = _read(model.format, model.answer, rng, most)
            text = "".join(e for e in events if isinstance(e, str))
            deltas = [e for e in events if isinstance(e, ToolCallDelta)]
            assert text == model.text
            assert merge_calls(deltas) == model.calls
            for index in range(len(model.calls)):  # named on the call's first delta only
                named = [d.name for d in deltas if d.index == index]
                assert named[0] == model.calls[index].name and not any(named[1:])
    for marker in model.format.markers:  # no markup leaks, however it was cut
        assert all(marker not in e for e in events if isinstance(e, str))


@pytest.mark.parametrize(
    ("fmt", "answer", "text", "calls"),
    [
        # an answer with no call stays text; analysis is reasoning, kept aside
        (HARMONY, "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final"
         "<|message|>It is sunny.", "It is sunny.", ()),
        (HARMONY, "Plain text, no header.", "Plain text, no header.", ()),
        # gpt-oss's other placement of the recipient, and a call cut by the end token
        (HARMONY, ' to=functions.add<|channel|>commentary json<|message|>{"a": 1, "b": 2}',
         "", (ToolCall("add", '{"a": 1, "b": 2}'),)),
        # V3.1's calls: the name before the separator, no fence
        (DEEPSEEK, 'Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>{"a": 1, "b": 2}'
         "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "Sure.", (ToolCall("add", '{"a": 1, "b": 2}'),)),
        (DEEPSEEK, "<｜tool▁calls▁begin｜>not a call", "not a call", ()),
        # a parameter declared a string stays one; others are JSON when they parse
        (GLM45, "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>1984</arg_value>\n"
         "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>note</arg_key>\n"
         "<arg_value>not json</arg_value>\n</tool_call>", "",
         (ToolCall("get_weather", '{"city": "1984", "days": 3, "note": "not json"}'),)),
        (GLM45, "<tool_call>add\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n<arg_key>b",
         "", (ToolCall("add", '{"a": 1}'),)),
        (GLM45, "a <tool_call>\n</tool_call> b", "a <tool_call>\n</tool_call> b", ()),
    ],
)
def test_edge_answers_in_the_new_formats(
    fmt: ToolFormat, answer: str, text: str, calls: tuple[ToolCall, ...]
) -> None:
    rng = random.Random(5)
    for most in (1, 2, 4, len(answer)):
        events = _read(fmt, answer, rng, most)
        assert "".join(e for e in events if isinstance(e, str)) == text
        assert merge_calls([e for e in events if isinstance(e, ToolCallDelta)]) == calls


def test_harmony_keeps_the_analysis_as_reasoning() -> None:
    parser = HARMONY.parser()
    events = parser.feed("<|channel|>analysis<|message|>Think") + parser.feed("ing.<|end|>")
    assert all(isinstance(e, Thought) for e in events) and parser.reasoning == "Thinking."
    assert "".join(e.text for e in events if isinstance(e, Thought)) == "Thinking."


# -- forced calls on a tiny random model with the real template --------------------------------

# Bounded, so that a random model's calls end within max_tokens.
FORCED_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 8},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "flag", "description": "Set a flag", "parameters": {
        "type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"],
        "additionalProperties": False}}},
]


def _tiny_with(path: Path, model: Model) -> Path:
    """The tiny checkpoint with `model`'s template and call markers as special tokens."""
    # Rows past the tokenizer's 320 take the markers; real templates make long prompts.
    write_tiny_llama(path, vocab_size=400, max_position_embeddings=4096)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in model.format.markers])
    tok.save(str(path / "tokenizer.json"))
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = chat_template(model.repo)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS, ids=_ids(MODELS))
def test_a_forced_call_on_a_random_model_always_parses(model: Model, tmp_path: Path) -> None:
    tiny = load(_tiny_with(tmp_path, model))
    assert tiny.tokenizer.tool_format is model.format
    special = tiny.tokenizer.special_ids(model.format.markers)
    assert len(special) == len(model.format.markers)
    for parallel in (True, False):
        grammar = model.format.grammar(FORCED_TOOLS, parallel=parallel, special_id=special)
        lark = LLMatcher.grammar_from_lark(grammar)
        assert LLMatcher.validate_grammar(lark, tiny.grammar_tokenizer()) == ""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in FORCED_TOOLS}
    for seed in range(6):
        chat = Chat(
            tuple(ONE_CALL[:2]), tools=tuple(FORCED_TOOLS), tool_choice="required",
            parallel_tool_calls=seed % 2 == 0,
        )
        parallel = chat.parallel_tool_calls
        out = tiny.generate(chat, GenerationOptions(temperature=1.0, seed=seed, max_tokens=300))
        # A random model may chain parallel calls past max_tokens: the last one is then cut.
        cut = parallel and out.finish_reason == "length"
        assert out.finish_reason == "tool_calls" or cut, out.text
        assert out.tool_calls and out.text == "", out.text
        assert parallel or len(out.tool_calls) == 1
        for call in out.tool_calls[: -1 if cut else None]:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
