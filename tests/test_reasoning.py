"""Reasoning on a thinking template (Qwen3's real one), end to end: the engine splits the
`<think>` block off the answer, a budget cuts it, and each dialect's official SDK gets it back
in its own shape, streamed and not, or none of it when thinking is off. The model is the
scripted qwen3 (tests/fixtures/scripted_qwen3.py): its weights answer
`<think>REASONING</think>\\n\\nANSWER`, so every text and count here is exact."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from google import genai
from google.genai import types

from mlx_omnia import load
from mlx_omnia.engine.model import Model
from mlx_omnia.engine.text.reasoning import THINK, ReasoningSplitter
from mlx_omnia.engine.types import Chat, ChatMessage, GenerationOptions
from mlx_omnia.server.settings import Settings
from tests.fixtures import scripted, scripted_qwen3
from tests.fixtures.scripted_qwen3 import ANSWER, REASONING
from tests.server_harness import (
    LiveServer,
    anthropic_client,
    gemini_client,
    live_server,
    openai_client,
)

MODEL = "scripted-qwen3"
QUESTION = "What is the capital of France?"
USER: tuple[ChatMessage, ...] = ({"role": "user", "content": QUESTION},)


@pytest.fixture(scope="module")
def model(scripted_qwen3_dir: Path) -> Model:
    return load(scripted_qwen3_dir)


@pytest.fixture(scope="module")
def reasoning_tokens(model: Model) -> int:
    """The reasoning's own tokens (the markers around it are not counted as reasoning)."""
    return len(model.tokenizer.encode(REASONING, add_special_tokens=False))


# -- the fixture and the engine -------------------------------------------------------------------
def test_scripted_qwen3_files_match_their_sums(scripted_qwen3_dir: Path) -> None:
    sums, recorded = scripted.read_sums(scripted_qwen3.SUMS)
    if recorded == scripted.versions():  # another tokenizers may write another tokenizer.json
        assert scripted.file_sums(scripted_qwen3_dir) == sums, (
            "the scripted_qwen3 checkpoint changed: if on purpose, run "
            "python -m tests.fixtures.scripted_qwen3 --write-sums"
        )


def test_the_model_reasons_then_answers_and_not_when_thinking_is_off(model: Model) -> None:
    assert model.model_type == "qwen3" and model.tokenizer.reasoning_format == THINK
    done = model.generate(Chat(USER))
    assert (done.reasoning, done.text, done.finish_reason) == (REASONING, ANSWER, "stop")
    sampled = model.generate(Chat(USER), GenerationOptions(temperature=1.0, seed=7))
    assert (sampled.reasoning, sampled.text) == (REASONING, ANSWER)  # its logits leave no choice
    off = model.generate(Chat(USER, thinking=False))
    assert (off.reasoning, off.text) == ("", ANSWER)
    assert off.usage.prompt_tokens == done.usage.prompt_tokens + 4  # <think>\n\n</think>\n\n
    kwargs = model.generate(Chat(USER, template_kwargs={"enable_thinking": False}))
    assert (kwargs.reasoning, kwargs.text) == ("", ANSWER)


@pytest.mark.parametrize("budget", [0, 1, 3])
def test_a_reasoning_budget_cuts_the_reasoning_then_the_answer_follows(
    model: Model, budget: int
) -> None:
    done = model.generate(Chat(USER), GenerationOptions(reasoning_budget=budget))
    reasoning = model.tokenizer.encode(REASONING, add_special_tokens=False)[:budget]
    assert done.reasoning == model.tokenizer.decode(reasoning)
    assert (done.text, done.finish_reason) == (ANSWER, "stop")
    # <think>, the budget, </think> (forced), then the answer as the weights go on
    full = model.generate(Chat(USER))
    cut = len(model.tokenizer.encode(REASONING, add_special_tokens=False)) - budget
    assert done.usage.completion_tokens == full.usage.completion_tokens - cut


def test_a_prompt_ending_inside_the_block_starts_in_reasoning(
    scripted_qwen3_dir: Path, tmp_path: Path
) -> None:
    """DeepSeek-R1's template opens the block in the generation prompt: the answer is then
    reasoning from its first token, up to the end marker."""
    path = shutil.copytree(scripted_qwen3_dir, tmp_path / "opened")
    config = json.loads((path / "tokenizer_config.json").read_text())
    prompt = "{{- '<|im_start|>assistant\\n' }}"
    assert config["chat_template"].count(prompt) == 1
    config["chat_template"] = config["chat_template"].replace(
        prompt, "{{- '<|im_start|>assistant\\n<think>' }}"
    )
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    opened = load(path)
    assert opened.tokenizer.decode(opened.encode(Chat(USER))[-1:]) == "<think>"
    done = opened.generate(Chat(USER))
    assert (done.reasoning, done.text) == (REASONING, ANSWER)
    cut = opened.generate(Chat(USER), GenerationOptions(reasoning_budget=2))
    two = opened.tokenizer.encode(REASONING, add_special_tokens=False)[:2]
    assert (cut.reasoning, cut.text) == (opened.tokenizer.decode(two), ANSWER)


SPLITS = [  # (prompt's tail, answer, reasoning, content)
    ("assistant\n", "<think>\nabc\n\ndef\n</think>\n\nThe answer.", "abc\n\ndef", "The answer."),
    ("assistant\n", "<think>abc</think>The answer.", "abc", "The answer."),
    ("assistant\n", "<think>\n\n</think>\n\nNo thought.", "", "No thought."),
    ("assistant\n", "No block <think>here</think>.", "", "No block <think>here</think>."),
    ("assistant\n", "<thin", "", "<thin"),
    ("assistant\n", "<think>cut short", "cut short", ""),
    ("assistant\n", "<think>a</think>b</think>\n\nc", "a", "b</think>\n\nc"),
    ("<think>\n", "reasoning\n</think>\n\nanswer\n\n", "reasoning", "answer\n\n"),
    ("<think>", "no end", "no end", ""),
]


@pytest.mark.parametrize(("tail", "answer", "reasoning", "content"), SPLITS)
def test_the_splitter_gives_the_same_channels_however_the_answer_is_chunked(
    tail: str, answer: str, reasoning: str, content: str
) -> None:
    rng = random.Random(answer)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(answer)), rng.randint(0, min(8, len(answer) - 1))))
        chunks = [answer[a:b] for a, b in zip([0, *cuts], [*cuts, len(answer)], strict=True)]
        splitter: ReasoningSplitter = THINK.splitter(f"<|im_start|>{tail}")
        runs = [run for chunk in chunks for run in splitter.feed(chunk)] + splitter.finish()
        got = {c: "".join(t for ch, t in runs if ch == c) for c in ("reasoning", "content")}
        assert got == {"reasoning": reasoning, "content": content}, chunks
        # Reasoning never follows content: one block, at the answer's start.
        channels = [c for c, t in runs if t]
        assert channels == sorted(channels, key=lambda c: c == "content"), chunks


# -- the server -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(scripted_qwen3_dir: Path) -> Iterator[LiveServer]:
    with live_server(Settings(), models=[scripted_qwen3_dir]) as s:
        yield s


@pytest.fixture(scope="module")
def oai(server: LiveServer) -> openai.OpenAI:
    return openai_client(server)


@pytest.fixture(scope="module")
def claude(server: LiveServer) -> anthropic.Anthropic:
    return anthropic_client(server)


@pytest.fixture(scope="module")
def gemini(server: LiveServer) -> genai.Client:
    return gemini_client(server)


def _extra(obj: Any, key: str) -> Any:
    """A field the SDK's types do not declare (reasoning_content), as the server sent it."""
    return (getattr(obj, "model_extra", None) or {}).get(key)


# -- OpenAI chat ----------------------------------------------------------------------------------
def test_openai_chat_returns_reasoning_content(oai: openai.OpenAI, reasoning_tokens: int) -> None:
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}])
    message = r.choices[0].message
    assert (message.content, _extra(message, "reasoning_content")) == (ANSWER, REASONING)
    assert r.choices[0].finish_reason == "stop" and r.usage is not None
    details = r.usage.completion_tokens_details
    assert details is not None and details.reasoning_tokens == reasoning_tokens

    stream = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], stream=True,
        stream_options={"include_usage": True},
    )
    thought, text, usage = [], [], None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            thought.append(_extra(choice.delta, "reasoning_content") or "")
            text.append(choice.delta.content or "")
    assert ("".join(thought), "".join(text)) == (REASONING, ANSWER)
    assert len([t for t in thought if t]) > 1  # streamed as generated
    assert usage is not None and usage.completion_tokens_details is not None
    assert usage.completion_tokens_details.reasoning_tokens == reasoning_tokens
    assert usage.completion_tokens == r.usage.completion_tokens


@pytest.mark.parametrize("off", [
    {"reasoning_effort": "none"},
    {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}},
], ids=["effort-none", "template-kwargs"])
def test_openai_chat_without_thinking_answers_without_reasoning(
    oai: openai.OpenAI, off: dict[str, Any]
) -> None:
    messages: Any = [{"role": "user", "content": QUESTION}]
    r = oai.chat.completions.create(model=MODEL, messages=messages, **off)
    assert r.choices[0].message.content == ANSWER
    assert _extra(r.choices[0].message, "reasoning_content") is None
    assert r.usage is not None and r.usage.completion_tokens_details is not None
    assert r.usage.completion_tokens_details.reasoning_tokens == 0
    deltas = [c.choices[0].delta for c in oai.chat.completions.create(
        model=MODEL, messages=messages, stream=True, **off) if c.choices]
    assert "".join(d.content or "" for d in deltas) == ANSWER
    assert not any(_extra(d, "reasoning_content") for d in deltas)


# -- OpenAI Responses -----------------------------------------------------------------------------
def test_responses_returns_a_reasoning_item(oai: openai.OpenAI, reasoning_tokens: int) -> None:
    r = oai.responses.create(model=MODEL, input=QUESTION, store=False)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    item = r.output[0]
    assert item.type == "reasoning" and item.content is not None
    assert [(c.type, c.text) for c in item.content] == [("reasoning_text", REASONING)]
    assert r.output_text == ANSWER and r.usage is not None
    assert r.usage.output_tokens_details.reasoning_tokens == reasoning_tokens

    events = list(oai.responses.create(model=MODEL, input=QUESTION, store=False, stream=True))
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    done = [e.text for e in events if e.type == "response.reasoning_text.done"]
    text = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == REASONING and done == [REASONING] and len(deltas) > 1
    assert "".join(text) == ANSWER
    final = events[-1]
    assert final.type == "response.completed" and final.response.usage is not None
    assert [o.type for o in final.response.output] == ["reasoning", "message"]
    assert final.response.usage.output_tokens_details.reasoning_tokens == reasoning_tokens


def test_responses_effort_none_gives_no_reasoning(oai: openai.OpenAI) -> None:
    r = oai.responses.create(model=MODEL, input=QUESTION, reasoning={"effort": "none"}, store=False)
    assert [o.type for o in r.output] == ["message"] and r.output_text == ANSWER
    events = list(oai.responses.create(
        model=MODEL, input=QUESTION, reasoning={"effort": "none"}, store=False, stream=True))
    assert not [e for e in events if e.type.startswith("response.reasoning")]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == ANSWER


# -- Anthropic ------------------------------------------------------------------------------------
THINKING: Any = {"type": "enabled", "budget_tokens": 1024}


@pytest.mark.parametrize("display", [None, "omitted"])
def test_anthropic_returns_a_thinking_block(
    claude: anthropic.Anthropic, display: str | None
) -> None:
    thinking = THINKING | ({"display": display} if display else {})
    shown = "" if display == "omitted" else REASONING
    msg = claude.messages.create(
        model=MODEL, max_tokens=64, messages=[{"role": "user", "content": QUESTION}],
        thinking=thinking,
    )
    assert [b.type for b in msg.content] == ["thinking", "text"]
    block, text = msg.content
    assert block.type == "thinking" and block.thinking == shown and block.signature
    assert text.type == "text" and text.text == ANSWER and msg.stop_reason == "end_turn"

    with claude.messages.stream(
        model=MODEL, max_tokens=64, messages=[{"role": "user", "content": QUESTION}],
        thinking=thinking,
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    thought = [d.thinking for d in deltas if d.type == "thinking_delta"]
    signatures = [d.signature for d in deltas if d.type == "signature_delta"]
    assert "".join(thought) == shown and signatures == [block.signature]
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in final.content] == [
        ("thinking", shown or None), ("text", ANSWER)]
    assert final.usage.output_tokens == msg.usage.output_tokens


@pytest.mark.parametrize("thinking", [None, {"type": "disabled"}], ids=["absent", "disabled"])
def test_anthropic_without_thinking_answers_without_a_thinking_block(
    claude: anthropic.Anthropic, thinking: Any
) -> None:
    extra: Any = {"thinking": thinking} if thinking else {}
    msg = claude.messages.create(
        model=MODEL, max_tokens=64, messages=[{"role": "user", "content": QUESTION}], **extra,
    )
    assert [(b.type, getattr(b, "text", None)) for b in msg.content] == [("text", ANSWER)]
    with claude.messages.stream(
        model=MODEL, max_tokens=64, messages=[{"role": "user", "content": QUESTION}], **extra,
    ) as stream:
        kinds = [e.content_block.type for e in stream if e.type == "content_block_start"]
        final = stream.get_final_message()
    assert kinds == ["text"] and final.content[0].type == "text"
    assert final.content[0].text == ANSWER


# -- Gemini ---------------------------------------------------------------------------------------
def _gemini_config(**thinking: Any) -> types.GenerateContentConfig:
    return types.GenerateContentConfig(thinking_config=types.ThinkingConfig(**thinking))


def _parts(r: types.GenerateContentResponse) -> list[tuple[bool, str]]:
    assert r.candidates and r.candidates[0].content
    return [(bool(p.thought), p.text or "") for p in r.candidates[0].content.parts or []]


def test_gemini_returns_thought_parts_only_when_asked(
    gemini: genai.Client, reasoning_tokens: int
) -> None:
    r = gemini.models.generate_content(
        model=MODEL, contents=QUESTION, config=_gemini_config(include_thoughts=True))
    assert _parts(r) == [(True, REASONING), (False, ANSWER)] and r.text == ANSWER
    assert r.usage_metadata is not None
    assert r.usage_metadata.thoughts_token_count == reasoning_tokens
    streamed = [p for chunk in gemini.models.generate_content_stream(
        model=MODEL, contents=QUESTION, config=_gemini_config(include_thoughts=True),
    ) for p in _parts(chunk)]
    assert "".join(t for thought, t in streamed if thought) == REASONING
    assert "".join(t for thought, t in streamed if not thought) == ANSWER

    hidden = gemini.models.generate_content(model=MODEL, contents=QUESTION)
    assert _parts(hidden) == [(False, ANSWER)]  # it still thought: counted, not shown
    assert hidden.usage_metadata is not None
    assert hidden.usage_metadata.thoughts_token_count == reasoning_tokens


def test_gemini_thinking_budget_zero_turns_it_off_and_one_cuts_it(gemini: genai.Client) -> None:
    off = gemini.models.generate_content(
        model=MODEL, contents=QUESTION,
        config=_gemini_config(thinking_budget=0, include_thoughts=True))
    assert _parts(off) == [(False, ANSWER)]
    assert off.usage_metadata is not None and not off.usage_metadata.thoughts_token_count
    one = gemini.models.generate_content(
        model=MODEL, contents=QUESTION,
        config=_gemini_config(thinking_budget=1, include_thoughts=True))
    first = REASONING[:3]  # "Rec": the reasoning's first token
    assert _parts(one) == [(True, first), (False, ANSWER)]
    assert one.usage_metadata is not None and one.usage_metadata.thoughts_token_count == 1
    streamed = [p for chunk in gemini.models.generate_content_stream(
        model=MODEL, contents=QUESTION,
        config=_gemini_config(thinking_budget=1, include_thoughts=True),
    ) for p in _parts(chunk)]
    assert [t for thought, t in streamed if thought] == [first]
    assert "".join(t for thought, t in streamed if not thought) == ANSWER


# -- an earlier turn's reasoning, sent back ------------------------------------------------------
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_capital", "arguments": '{"country": "France"}'}}
RESULT = "Paris"


def _history(reasoning: str | None) -> list[ChatMessage]:
    """A turn that reasoned and called a tool, and the tool's result: Qwen3's template shows
    the reasoning of turns after the last user message (this one), and drops older ones."""
    turn: ChatMessage = {"role": "assistant", "content": "", "tool_calls": [CALL]}
    if reasoning is not None:
        turn["reasoning_content"] = reasoning
    return [*USER, turn, {"role": "tool", "tool_call_id": "call_1", "content": RESULT}]


def test_the_template_renders_reasoning_sent_back(model: Model) -> None:
    shown = model.tokenizer.decode(model.encode(Chat(tuple(_history(REASONING)))),
                                   skip_special_tokens=False)
    assert f"<|im_start|>assistant\n<think>\n{REASONING}\n</think>\n\n<tool_call>" in shown
    hidden = model.tokenizer.decode(model.encode(Chat(tuple(_history(None)))),
                                    skip_special_tokens=False)
    assert "<|im_start|>assistant\n<tool_call>" in hidden and REASONING not in hidden


def test_reasoning_sent_back_reaches_the_template_in_every_dialect(
    model: Model, oai: openai.OpenAI, claude: anthropic.Anthropic
) -> None:
    expected = len(model.encode(Chat(tuple(_history(REASONING)))))
    without = len(model.encode(Chat(tuple(_history(None)))))
    assert expected > without

    def chat_tokens(history: list[ChatMessage]) -> int:
        r = oai.chat.completions.create(model=MODEL, messages=history, max_tokens=1)  # type: ignore[arg-type]
        assert r.usage is not None
        return r.usage.prompt_tokens

    assert chat_tokens(_history(REASONING)) == expected
    assert chat_tokens(_history(None)) == without

    responses = oai.responses.create(
        model=MODEL, max_output_tokens=1, store=False, input=[
            {"role": "user", "content": QUESTION},
            {"type": "reasoning", "id": "rs_1", "summary": [],
             "content": [{"type": "reasoning_text", "text": REASONING}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_capital",
             "arguments": '{"country": "France"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": RESULT},
        ],
    )
    assert responses.usage is not None and responses.usage.input_tokens == expected

    msg = claude.messages.create(
        model=MODEL, max_tokens=1, thinking=THINKING, messages=[
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": REASONING, "signature": "sig"},
                {"type": "tool_use", "id": "toolu_1", "name": "get_capital",
                 "input": {"country": "France"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": RESULT}]},
        ],
    )
    # input_tokens leave out what the prefix cache read
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) == expected
