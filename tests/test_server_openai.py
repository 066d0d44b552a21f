"""The OpenAI dialect, driven by the official `openai` SDK against a live omnia-server running the
real SmolLM2-135M-Instruct (keep max_tokens small: about 10 tokens a second on CPU)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from mlx_omnia import Chat, ChatMessage, GenerationOptions, Model
from mlx_omnia.server.settings import Settings
from tests.server_harness import LiveServer, live_server

MODEL = "smollm2-135m-instruct"
QUESTION = "What is the capital of France?"
ANSWER = "The capital of France is Paris."


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with live_server(Settings()) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/api/openai/v1", api_key="unused", max_retries=0)


def user(text: str) -> list[Any]:
    return [{"role": "user", "content": text}]


def engine(model: Model, input: Chat | str, **options: Any) -> str:
    return model.generate(input, GenerationOptions(temperature=0, **options)).text


def chat_of(messages: list[Any]) -> Chat:
    out: list[ChatMessage] = [{"role": m["role"], "content": m["content"]} for m in messages]
    return Chat(tuple(out))


# -- chat completions ------------------------------------------------------------------------
def test_chat_greedy_matches_engine_with_exact_usage(client: openai.OpenAI, smollm2: Model) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=user(QUESTION), max_tokens=16, temperature=0
    )
    choice = r.choices[0]
    assert (
        choice.message.content == ANSWER == engine(smollm2, chat_of(user(QUESTION)), max_tokens=16)
    )
    assert choice.finish_reason == "stop"
    assert r.object == "chat.completion" and r.model == MODEL
    assert r.usage is not None
    assert r.usage.prompt_tokens == len(smollm2.encode(chat_of(user(QUESTION))))
    done = smollm2.generate(
        chat_of(user(QUESTION)), GenerationOptions(temperature=0, max_tokens=16)
    )
    assert r.usage.completion_tokens == done.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details is not None
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_chat_stream_with_usage(client: openai.OpenAI, smollm2: Model) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=user(QUESTION),
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ANSWER
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == ["stop"]
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.prompt_tokens == len(smollm2.encode(chat_of(user(QUESTION))))
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1


def test_n_choices_whole_and_streamed(client: openai.OpenAI, smollm2: Model) -> None:
    """n alternatives: with a seed, choice i samples with seed + i (so they differ and each is
    the answer that seed gives alone); usage counts the prompt once; a stream interleaves the
    choices by index and ends each with its own finish chunk."""
    sampled = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 12}
    whole = client.chat.completions.create(
        model=MODEL, messages=user(QUESTION), n=3, seed=5, **sampled
    )
    texts = [c.message.content for c in whole.choices]
    assert [c.index for c in whole.choices] == [0, 1, 2]
    alone = [
        client.chat.completions.create(model=MODEL, messages=user(QUESTION), seed=5 + i, **sampled)
        for i in range(3)
    ]
    assert texts == [a.choices[0].message.content for a in alone] and len(set(texts)) > 1
    assert whole.usage is not None
    assert whole.usage.prompt_tokens == len(smollm2.encode(chat_of(user(QUESTION))))
    assert whole.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone if a.usage)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=user(QUESTION), n=3, seed=5, stream=True,
        stream_options={"include_usage": True}, **sampled,
    ))
    streamed = ["", "", ""]
    finished: list[int] = []
    for c in chunks:
        for choice in c.choices:
            streamed[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                finished.append(choice.index)
    assert streamed == texts and sorted(finished) == [0, 1, 2]
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    legacy = client.completions.create(model=MODEL, prompt=PROMPT, n=2, seed=5, **sampled)
    assert [c.index for c in legacy.choices] == [0, 1]
    assert legacy.choices[1].text == client.completions.create(
        model=MODEL, prompt=PROMPT, seed=6, **sampled
    ).choices[0].text


def test_chat_stream_without_usage(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=user(QUESTION), max_tokens=3, temperature=0, stream=True
        )
    )
    assert all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_multi_turn_with_system_prompt(client: openai.OpenAI, smollm2: Model) -> None:
    messages = [
        {"role": "system", "content": "You are a terse geography tutor."},
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": ANSWER},
        {"role": "user", "content": "And of Italy?"},
    ]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert r.choices[0].message.content == engine(smollm2, chat_of(messages), max_tokens=16)
    assert r.usage is not None
    assert r.usage.prompt_tokens == len(smollm2.encode(chat_of(messages)))


def test_stop_sequence(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=user(QUESTION), max_tokens=16, temperature=0, stop=[" Paris"]
    )
    assert r.choices[0].message.content == "The capital of France is"
    assert r.choices[0].finish_reason == "stop"


def test_max_completion_tokens_wins_and_cuts_with_length(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=user(QUESTION), max_tokens=16, max_completion_tokens=3, temperature=0
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 3
    assert r.choices[0].message.content == "The capital of"


def test_penalties_and_logit_bias_match_engine(client: openai.OpenAI, smollm2: Model) -> None:
    banned = smollm2.encode(" Paris")
    r = client.chat.completions.create(
        model=MODEL,
        messages=user(QUESTION),
        max_tokens=12,
        temperature=0,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logit_bias={str(t): -100 for t in banned},
        user="someone",
    )
    want = engine(
        smollm2,
        chat_of(user(QUESTION)),
        max_tokens=12,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logit_bias=dict.fromkeys(banned, -100.0),
    )
    assert r.choices[0].message.content == want
    assert " Paris" not in want


def test_seed_reproducible_at_temperature_one(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        r = client.chat.completions.create(
            model=MODEL, messages=user("Tell me a story."), max_tokens=10, temperature=1, seed=seed
        )
        return r.choices[0].message.content or ""

    first = sample(1234)
    assert first == sample(1234)
    assert len(first) > 0


# -- legacy completions ----------------------------------------------------------------------
PROMPT = "The capital of France is"


def test_completion_raw_text(client: openai.OpenAI, smollm2: Model) -> None:
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    assert r.object == "text_completion"
    assert r.choices[0].text == engine(smollm2, PROMPT, max_tokens=6)
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None
    assert r.usage.prompt_tokens == len(smollm2.encode(PROMPT))
    assert r.usage.completion_tokens == 6


def test_completion_prompt_list_and_stop(client: openai.OpenAI, smollm2: Model) -> None:
    full = engine(smollm2, PROMPT, max_tokens=6)
    stop = "."
    assert stop in full
    r = client.completions.create(
        model=MODEL, prompt=[PROMPT], max_tokens=6, temperature=0, stop=stop
    )
    assert r.choices[0].text == full[: full.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_completion_stream(client: openai.OpenAI, smollm2: Model) -> None:
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == engine(smollm2, PROMPT, max_tokens=5)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 5
    assert chunks[-1].usage.prompt_tokens == len(smollm2.encode(PROMPT))


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"echo": True}, "echo"),
        ({"suffix": "!"}, "suffix"),
        ({"logprobs": 6}, "logprobs"),
        ({"best_of": 2}, "best_of"),
        ({"n": 129}, "n"),
        ({"frobnicate": 1}, "frobnicate"),
    ],
)
def test_completion_refusals(client: openai.OpenAI, extra: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body=extra)
    assert info.value.param == param
    assert param in info.value.message


def test_completion_token_prompt_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=2)
    assert info.value.param == "prompt"


# -- responses -------------------------------------------------------------------------------
def test_response_non_streaming(client: openai.OpenAI, smollm2: Model) -> None:
    r = client.responses.create(
        model=MODEL,
        input=QUESTION,
        instructions="Answer briefly.",
        max_output_tokens=16,
        temperature=0,
    )
    messages = [{"role": "system", "content": "Answer briefly."}, *user(QUESTION)]
    want = smollm2.generate(chat_of(messages), GenerationOptions(temperature=0, max_tokens=16))
    assert r.output_text == want.text
    assert r.status == ("completed" if want.finish_reason == "stop" else "incomplete")
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.usage is not None
    assert r.usage.input_tokens == len(smollm2.encode(chat_of(messages)))
    assert r.usage.output_tokens == want.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.input_tokens_details.cached_tokens == 0


def test_response_completed(client: openai.OpenAI) -> None:
    r = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=16, temperature=0)
    assert r.object == "response" and r.model == MODEL
    assert r.status == "completed" and r.incomplete_details is None
    assert r.output_text == ANSWER


def test_response_incomplete_on_length(client: openai.OpenAI) -> None:
    r = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=3, temperature=0)
    assert r.status == "incomplete"
    assert r.incomplete_details is not None and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage is not None and r.usage.output_tokens == 3
    assert r.output_text == "The capital of"


def test_response_stream_event_sequence(client: openai.OpenAI, smollm2: Model) -> None:
    history: list[Any] = [
        {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": ANSWER}],
        },
        {"role": "user", "content": "And of Italy?"},
    ]
    with client.responses.stream(
        model=MODEL, input=history, max_output_tokens=16, temperature=0
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    chat = chat_of(
        [*user(QUESTION), {"role": "assistant", "content": ANSWER}, *user("And of Italy?")]
    )
    want = engine(smollm2, chat, max_tokens=16)
    assert "".join(e.delta for e in deltas) == want
    assert final.output_text == want and final.status == "completed"
    assert final.usage is not None and final.usage.input_tokens == len(smollm2.encode(chat))


def test_response_stream_incomplete(client: openai.OpenAI) -> None:
    events = list(
        client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=2, stream=True)
    )
    assert events[0].type == "response.created"
    last = events[-1]
    assert last.type == "response.incomplete"
    assert last.response.status == "incomplete"
    assert last.response.incomplete_details is not None
    assert last.response.incomplete_details.reason == "max_output_tokens"
    assert last.response.usage is not None and last.response.usage.output_tokens == 2


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools[0].type"),
        ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ({"extra_body": {"seed": 3}}, "seed"),
        (
            {
                "input": [
                    {"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}
                ]
            },
            "input[0].content[0]",
        ),
        ({"input": [{"type": "computer_call_output", "call_id": "c", "output": {}}]},
         "input[0].type"),
        ({"include": ["message.output_text.logprobs", "everything"]}, "include[1]"),
        ({"top_logprobs": 21}, "top_logprobs"),
    ],
)
def test_response_refusals(client: openai.OpenAI, kwargs: dict[str, Any], param: str) -> None:
    args: dict[str, Any] = {"model": MODEL, "input": QUESTION, "max_output_tokens": 2, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(**args)
    assert info.value.param == param


# -- models and errors -----------------------------------------------------------------------
def test_models_lists_default_first(client: openai.OpenAI) -> None:
    ids = [m.id for m in client.models.list()]
    assert ids[0] == MODEL
    assert client.models.retrieve(MODEL).id == MODEL


def test_unknown_model_is_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=user("hi"), max_tokens=2)
    assert info.value.param == "model"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(
            model="nobody/nothing", messages=user("hi"), max_tokens=2, stream=True
        )
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="no-such-model", input="hi", stream=True)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": 3.5}, "temperature"),
        ({"n": 0}, "n"),
        ({"frobnicate": True}, "frobnicate"),
        ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": "yes"}, "logprobs"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
    ],
)
def test_chat_bad_requests_name_the_field(
    client: openai.OpenAI, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=user("hi"), extra_body=extra)
    assert info.value.param == param
    assert isinstance(info.value.body, dict) and info.value.body["type"] == "invalid_request_error"


def test_image_part_is_refused(client: openai.OpenAI) -> None:
    messages: list[Any] = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            ],
        }
    ]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert info.value.param == "messages[0].content[1]"
    assert "image_url" in info.value.message


def test_context_overflow(client: openai.OpenAI) -> None:
    huge = "hello " * 9000
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=user(huge), max_tokens=2)
    assert info.value.param == "messages" and info.value.code == "context_length_exceeded"
    assert "context" in info.value.message and "context_limit" not in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=huge, max_tokens=2, stream=True)
    assert info.value.param == "prompt"


def test_bad_json_in_openai_shape(server: LiveServer, client: openai.OpenAI) -> None:
    for path in ("chat/completions", "completions", "responses"):
        r = httpx.post(
            f"{server.url}/api/openai/v1/{path}",
            content=b'{"model": "smollm2-135m-instruct", "messages": [',
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert set(error) == {"message", "type", "param", "code"}
    # The server is still up and answering.
    r2 = client.chat.completions.create(
        model=MODEL, messages=user(QUESTION), max_tokens=2, temperature=0
    )
    assert r2.choices[0].message.content == "The capital"


# -- logprobs --------------------------------------------------------------------------------
def reference_logprobs(model: Model, prompt: list[int], answer: list[int]) -> list[Any]:
    """Each answer token's log-softmax row, from one forward pass over prompt + answer."""
    import mlx.core as mx

    logits = model.logits(prompt + answer[:-1])[len(prompt) - 1 :]
    rows = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return [rows[i] for i in range(len(answer))]


def test_chat_logprobs_are_the_models(client: openai.OpenAI, smollm2: Model) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=user(QUESTION), max_tokens=8, temperature=0, logprobs=True,
        top_logprobs=3,
    )
    choice = r.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    text = choice.message.content
    assert text is not None
    # One entry a generated token (the end token, if any, has none); their bytes are the text.
    assert b"".join(bytes(e.bytes or []) for e in content) == text.encode()
    assert "".join(e.token for e in content) == text
    prompt = smollm2.encode(chat_of(user(QUESTION)))
    ids = smollm2.generate(chat_of(user(QUESTION)), GenerationOptions(temperature=0, max_tokens=8)).token_ids
    answer = [t for t in ids if t not in smollm2.tokenizer.eos_token_ids]
    assert len(content) == len(answer)
    for entry, token, row in zip(content, answer, reference_logprobs(smollm2, prompt, answer), strict=True):
        assert abs(entry.logprob - row[token].item()) < 1e-3
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy: the likeliest
        assert entry.top_logprobs[0].logprob == entry.logprob
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert abs(values[2] - sorted(row.tolist())[-3]) < 1e-3
    # Without logprobs, none.
    plain = client.chat.completions.create(
        model=MODEL, messages=user(QUESTION), max_tokens=2, temperature=0
    )
    assert plain.choices[0].logprobs is None


def test_response_accepts_what_codex_says_of_itself(client: openai.OpenAI) -> None:
    """Codex CLI's first request failed on client_metadata (issue 29): metadata, harmless."""
    r = client.responses.create(
        model=MODEL, input=QUESTION, max_output_tokens=2,
        extra_body={"client_metadata": {"originator": "codex_cli_rs"}},
    )
    assert r.status == "incomplete"


def test_response_logprobs_are_the_chats(client: openai.OpenAI) -> None:
    """Responses logprobs (include message.output_text.logprobs, top_logprobs) are the same
    tokens and numbers as chat's for the same request, whole and streamed."""
    chat = client.chat.completions.create(
        model=MODEL, messages=user(QUESTION), max_tokens=8, temperature=0, logprobs=True,
        top_logprobs=3,
    )
    assert chat.choices[0].logprobs is not None
    want = [
        (e.token, e.bytes, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs])
        for e in chat.choices[0].logprobs.content or []
    ]
    args: dict[str, Any] = {
        "model": MODEL, "input": QUESTION, "max_output_tokens": 8, "temperature": 0,
        "include": ["message.output_text.logprobs"], "top_logprobs": 3,
    }
    whole = client.responses.create(**args)
    part = whole.output[0].content[0]  # type: ignore[union-attr]
    assert part.type == "output_text" and part.text == chat.choices[0].message.content
    got = [
        (e.token, e.bytes, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs])
        for e in part.logprobs or []
    ]
    assert got == want and whole.top_logprobs == 3
    with client.responses.stream(**args) as stream:
        events = list(stream)
    deltas = [
        (e.token, e.logprob) for ev in events if ev.type == "response.output_text.delta"
        for e in ev.logprobs
    ]
    done = next(ev for ev in events if ev.type == "response.output_text.done")
    assert deltas == [(t, lp) for t, _, lp, _ in want]
    assert [(e.token, e.logprob) for e in done.logprobs] == deltas
    # Without them, none.
    plain = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=2)
    assert plain.output[0].content[0].logprobs == []  # type: ignore[union-attr]


def test_chat_logprobs_stream_like_the_whole_answer(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(
        model=MODEL, messages=user(QUESTION), max_tokens=8, temperature=0, logprobs=True,
        top_logprobs=1,
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=user(QUESTION), max_tokens=8, temperature=0, logprobs=True,
            top_logprobs=1, stream=True,
        )
    )
    streamed = [
        e for c in chunks if c.choices and c.choices[0].logprobs is not None
        for e in (c.choices[0].logprobs.content or [])
    ]
    assert whole.choices[0].logprobs is not None
    assert [(e.token, e.logprob) for e in streamed] == [
        (e.token, e.logprob) for e in whole.choices[0].logprobs.content or []
    ]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        whole.choices[0].message.content
    )


def test_completion_logprobs(client: openai.OpenAI, smollm2: Model) -> None:
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2
    )
    choice = r.choices[0]
    assert choice.logprobs is not None
    lp = choice.logprobs
    assert lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None and lp.text_offset is not None
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    prompt = smollm2.encode(PROMPT)
    answer = list(smollm2.generate(PROMPT, GenerationOptions(temperature=0, max_tokens=5)).token_ids)
    for value, top, token, row in zip(
        lp.token_logprobs, lp.top_logprobs, answer, reference_logprobs(smollm2, prompt, answer),
        strict=True,
    ):
        assert abs(value - row[token].item()) < 1e-3
        assert len(top) == 2 and max(top.values()) == value
    streamed = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2, stream=True
        )
    )
    tokens = [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens or []]
    offsets = [o for c in streamed if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset or []]
    assert tokens == lp.tokens and offsets == lp.text_offset
