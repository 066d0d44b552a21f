"""The Anthropic dialect (/api/anthropic/v1) through the official `anthropic` SDK, on a real server."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import anthropic
import httpx
import pytest

from mlx_omnia import (
    Chat,
    ChatMessage,
    Generation,
    GenerationOptions,
    InvalidOptionsError,
    Model,
    Piece,
    load,
)
from mlx_omnia.server.manager import ModelManager
from mlx_omnia.server.settings import Settings
from tests.fixtures.tiny import write_tiny_llama
from tests.server_harness import LiveServer, live_server

MODEL = "smollm2-135m-instruct"
# This SDK version passes sampling fields (temperature, top_p, top_k) only through extra_body.
GREEDY = {"temperature": 0}
FRANCE = "What is the capital of France?"


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with live_server(Settings()) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url + "/api/anthropic", api_key="x", max_retries=0)


def user(text: str) -> ChatMessage:
    return {"role": "user", "content": text}


def greedy(
    smollm2: Any, messages: list[ChatMessage], max_tokens: int, stop: list[str] | None = None
):
    options = GenerationOptions(temperature=0, max_tokens=max_tokens, stop=stop or [])
    return smollm2.generate(Chat(tuple(messages)), options)


def test_message_greedy_equals_engine_and_usage_exact(
    client: anthropic.Anthropic, smollm2: Any
) -> None:
    msg = client.messages.create(
        model=MODEL,
        max_tokens=16,
        extra_body=GREEDY,
        messages=[{"role": "user", "content": FRANCE}],
        metadata={"user_id": "someone"},
    )
    want = greedy(smollm2, [user(FRANCE)], 16)
    assert msg.id.startswith("msg_")
    assert msg.type == "message" and msg.role == "assistant" and msg.model == MODEL
    assert len(msg.content) == 1 and msg.content[0].type == "text"
    assert msg.content[0].text == want.text
    assert "Paris" in msg.content[0].text
    assert msg.stop_reason == ("end_turn" if want.finish_reason == "stop" else "max_tokens")
    assert msg.stop_sequence is None
    assert msg.usage.input_tokens == len(smollm2.encode(Chat((user(FRANCE),))))
    assert msg.usage.output_tokens == want.usage.completion_tokens
    assert msg.usage.cache_creation_input_tokens == 0
    assert msg.usage.cache_read_input_tokens == 0


def test_stream_matches_non_stream(client: anthropic.Anthropic, smollm2: Any) -> None:
    with client.messages.stream(
        model=MODEL,
        max_tokens=16,
        extra_body=GREEDY,
        messages=[{"role": "user", "content": FRANCE}],
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    want = greedy(smollm2, [user(FRANCE)], 16)
    assert text == want.text
    assert final.content[0].type == "text" and final.content[0].text == want.text
    assert final.stop_reason == ("end_turn" if want.finish_reason == "stop" else "max_tokens")
    assert final.stop_sequence is None
    assert final.usage.input_tokens == len(smollm2.encode(Chat((user(FRANCE),))))
    assert final.usage.output_tokens == want.usage.completion_tokens


def test_stream_event_sequence(server: LiveServer) -> None:
    body = {
        "model": MODEL,
        "max_tokens": 3,
        "temperature": 0,
        "stream": True,
        "messages": [{"role": "user", "content": FRANCE}],
    }
    with httpx.stream(
        "POST", server.url + "/api/anthropic/v1/messages", json=body, timeout=60
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events: list[tuple[str, dict[str, Any]]] = []
    for block in raw.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        data = json.loads(lines["data"])
        assert data["type"] == lines["event"]
        events.append((lines["event"], data))
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) <= {"content_block_delta"} and len(names) > 6
    start = events[0][1]["message"]
    assert (
        start["content"] == []
        and start["stop_reason"] is None
        and start["usage"]["input_tokens"] > 0
    )
    for _, data in events[3:-3]:
        assert data["index"] == 0 and data["delta"]["type"] == "text_delta"
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 3


def test_multi_turn_with_system_blocks(client: anthropic.Anthropic, smollm2: Any) -> None:
    msg = client.messages.create(
        model=MODEL,
        max_tokens=8,
        extra_body=GREEDY,
        system=[
            {"type": "text", "text": "You are terse."},
            {"type": "text", "text": "Answer in one word."},
        ],
        messages=[
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": [{"type": "text", "text": "Blue."}]},
            {"role": "user", "content": [{"type": "text", "text": "Another one?"}]},
        ],
    )
    chat: list[ChatMessage] = [
        {
            "role": "system",
            "content": [
                {"type": "text", "text": "You are terse."},
                {"type": "text", "text": "Answer in one word."},
            ],
        },
        user("Name a colour."),
        {"role": "assistant", "content": [{"type": "text", "text": "Blue."}]},
        {"role": "user", "content": [{"type": "text", "text": "Another one?"}]},
    ]
    want = greedy(smollm2, chat, 8)
    assert msg.content[0].type == "text" and msg.content[0].text == want.text
    assert msg.usage.input_tokens == len(smollm2.encode(Chat(tuple(chat))))
    assert msg.usage.output_tokens == want.usage.completion_tokens


def test_string_system_equals_system_message(client: anthropic.Anthropic, smollm2: Any) -> None:
    count = client.messages.count_tokens(
        model=MODEL, system="Be brief.", messages=[{"role": "user", "content": FRANCE}]
    )
    chat = Chat(({"role": "system", "content": "Be brief."}, user(FRANCE)))
    assert count.input_tokens == len(smollm2.encode(chat))


def test_stop_sequence(client: anthropic.Anthropic, smollm2: Any) -> None:
    msg = client.messages.create(
        model=MODEL,
        max_tokens=16,
        extra_body=GREEDY,
        stop_sequences=["zebra", "Paris"],
        messages=[{"role": "user", "content": FRANCE}],
    )
    want = greedy(smollm2, [user(FRANCE)], 16, ["zebra", "Paris"])
    assert msg.stop_reason == "stop_sequence"
    assert msg.stop_sequence == "Paris"
    assert msg.content[0].type == "text" and msg.content[0].text == want.text
    assert "Paris" not in want.text and want.text.endswith("is ")
    assert msg.usage.output_tokens == want.usage.completion_tokens


def test_stop_sequence_streaming(client: anthropic.Anthropic) -> None:
    with client.messages.stream(
        model=MODEL,
        max_tokens=16,
        extra_body=GREEDY,
        stop_sequences=["France is"],
        messages=[{"role": "user", "content": FRANCE}],
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert "France is" not in text and text.endswith("of ")
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == "France is"


def test_max_tokens_stop_reason(client: anthropic.Anthropic, smollm2: Any) -> None:
    msg = client.messages.create(
        model=MODEL, max_tokens=2, extra_body=GREEDY, messages=[{"role": "user", "content": FRANCE}]
    )
    assert msg.stop_reason == "max_tokens" and msg.stop_sequence is None
    assert msg.usage.output_tokens == 2
    assert msg.content[0].type == "text"
    assert msg.content[0].text == greedy(smollm2, [user(FRANCE)], 2).text


def test_count_tokens(client: anthropic.Anthropic, smollm2: Any) -> None:
    messages: list[ChatMessage] = [
        user("Hi"),
        {"role": "assistant", "content": "Hello!"},
        user(FRANCE),
    ]
    count = client.messages.count_tokens(model=MODEL, messages=list(messages))  # type: ignore[arg-type]
    assert count.input_tokens == len(smollm2.encode(Chat(tuple(messages))))


def test_prefill_continues_the_final_assistant_turn(
    client: anthropic.Anthropic, smollm2: Any
) -> None:
    """A final assistant message is a prefill: the answer continues its text and holds only
    what follows, as Anthropic's API does."""
    prefill = "The capital of France is"
    messages: list[ChatMessage] = [user(FRANCE), {"role": "assistant", "content": prefill}]
    chat = Chat(tuple(messages), continue_final=True)
    want = smollm2.generate(chat, GenerationOptions(temperature=0, max_tokens=12))
    assert "Paris" in want.text and not want.text.startswith(prefill)
    msg = client.messages.create(
        model=MODEL, max_tokens=12, extra_body=GREEDY, messages=cast(Any, messages)
    )
    assert msg.content[0].type == "text" and msg.content[0].text == want.text
    assert msg.usage.input_tokens == len(smollm2.encode(chat))
    assert msg.usage.output_tokens == want.usage.completion_tokens
    with client.messages.stream(
        model=MODEL, max_tokens=12, extra_body=GREEDY, messages=cast(Any, messages)
    ) as stream:
        assert "".join(stream.text_stream) == want.text
    counted = client.messages.count_tokens(model=MODEL, messages=cast(Any, messages))
    assert counted.input_tokens == len(smollm2.encode(chat))
    # Content blocks too; an empty final assistant turn is no prefill at all.
    blocks = client.messages.create(
        model=MODEL,
        max_tokens=12,
        extra_body=GREEDY,
        messages=[
            {"role": "user", "content": FRANCE},
            {"role": "assistant", "content": [{"type": "text", "text": prefill}]},
        ],
    )
    assert blocks.content[0].type == "text" and blocks.content[0].text == want.text
    empty = client.messages.create(
        model=MODEL,
        max_tokens=12,
        extra_body=GREEDY,
        messages=[{"role": "user", "content": FRANCE}, {"role": "assistant", "content": ""}],
    )
    assert empty.content[0].type == "text"
    assert empty.content[0].text == greedy(smollm2, [user(FRANCE)], 12).text


def test_models_list_and_retrieve(client: anthropic.Anthropic) -> None:
    page = client.models.list()
    assert page.data[0].id == MODEL and page.data[0].type == "model"
    assert page.data[0].display_name and page.data[0].created_at is not None
    assert page.first_id == MODEL and page.has_more is False
    info = client.models.retrieve(MODEL)
    assert info.id == MODEL and info.type == "model"
    with pytest.raises(anthropic.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]


def test_unknown_model(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(
            model="no-such-model", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
    assert e.value.status_code == 404
    with (
        pytest.raises(anthropic.NotFoundError),
        client.messages.stream(
            model="acme/no-such-model", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        ) as stream,
    ):
        "".join(stream.text_stream)
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}]
        )


def _bad(client: anthropic.Anthropic, **kwargs: Any) -> anthropic.BadRequestError:
    kwargs.setdefault("model", MODEL)
    kwargs.setdefault("max_tokens", 4)
    kwargs.setdefault("messages", [{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(**kwargs)
    body = e.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    return e.value


def test_bad_requests(client: anthropic.Anthropic) -> None:
    assert "frobnicate" in _bad(client, extra_body={"frobnicate": 1}).message
    web = {"type": "web_search_20250305", "name": "web_search"}
    assert "tools.0.type" in _bad(client, tools=[web]).message
    assert "input_schema" in _bad(client, tools=[{"name": "f"}]).message
    assert "tool_choice" in _bad(client, tool_choice={"type": "any"}).message  # no tools
    assert "temperature" in _bad(client, extra_body={"temperature": "0.5"}).message
    assert "temperature" in _bad(client, extra_body={"temperature": 1.5}).message
    assert "max_tokens" in _bad(client, max_tokens=0).message
    image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"},
    }
    assert "image" in _bad(client, messages=[{"role": "user", "content": [image]}]).message
    tool_result = {"type": "tool_result", "tool_use_id": "t1", "content": "x"}
    in_assistant = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [tool_result]}]
    assert "tool_result" in _bad(client, messages=in_assistant).message
    document = {
        "type": "document",
        "source": {"type": "text", "media_type": "text/plain", "data": "x"},
    }
    assert "document" in _bad(client, messages=[{"role": "user", "content": [document]}]).message
    assert "role" in _bad(client, messages=[{"role": "tool", "content": "hi"}]).message
    assert (
        "trailing whitespace"
        in _bad(
            client,
            messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Well "}],
        ).message
    )
    assert "messages" in _bad(client, messages=[]).message
    with (
        pytest.raises(anthropic.BadRequestError),
        client.messages.stream(
            model=MODEL,
            max_tokens=4,
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"seed": 1},
        ) as stream,
    ):
        "".join(stream.text_stream)


def test_missing_max_tokens(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as e:
        client.post(
            "/v1/messages",
            body={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
            cast_to=httpx.Response,
        )
    assert "max_tokens" in e.value.message


def test_context_overflow(client: anthropic.Anthropic) -> None:
    long = "hello " * 9000
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": long}]
        )
    assert "context" in e.value.message
    # The server is still up and answering.
    msg = client.messages.create(
        model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "hi"}]
    )
    assert msg.usage.output_tokens == 1


def test_invalid_json_shape(server: LiveServer) -> None:
    r = httpx.post(
        server.url + "/api/anthropic/v1/messages",
        content=b"{not json",
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 400
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"


def _breaks_mid_stream(path: Path) -> Model:
    """A real tiny model whose answers fail after their first piece (as a grammar that cannot be
    followed, or a tokenizer error, would end one answer mid-stream)."""
    model = load(path)
    plain = model.generation

    def generation(input: Chat | str, options: GenerationOptions | None = None) -> Generation:
        answer = plain(input, options)
        add, sent = answer.add, [False]

        def failing(token: int | None) -> list[Piece]:
            if sent[0]:
                raise InvalidOptionsError("the engine broke")
            pieces = add(token)
            sent[0] = bool(pieces)
            return pieces

        answer.add = failing  # type: ignore[method-assign]
        return answer

    model.generation = generation  # type: ignore[method-assign]
    return model


def test_error_after_stream_started_is_an_error_event(tmp_path: Path) -> None:
    settings = Settings()
    path = write_tiny_llama(tmp_path / "broken")
    manager = ModelManager(settings, loader=lambda ref: _breaks_mid_stream(path))
    manager.add_alias(path)
    with live_server(settings, manager) as s:
        body = {
            "model": "broken",
            "max_tokens": 4,
            "stream": True,
            "messages": [{"role": "user", "content": "hi"}],
        }
        with httpx.stream("POST", s.url + "/api/anthropic/v1/messages", json=body, timeout=30) as r:
            assert r.status_code == 200
            raw = r.read().decode()
        assert "event: content_block_delta" in raw and '"type":"text_delta"' in raw
        last = raw.strip().split("\n\n")[-1]
        assert last.startswith("event: error\n")
        error = json.loads(last.split("data: ", 1)[1])
        assert error == {
            "type": "error",
            "error": {"type": "invalid_request_error", "message": "the engine broke"},
        }
        client = anthropic.Anthropic(base_url=s.url + "/api/anthropic", api_key="x", max_retries=0)
        with (
            pytest.raises(anthropic.APIStatusError) as e,
            client.messages.stream(
                model="broken", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
            ) as stream,
        ):
            "".join(stream.text_stream)
        assert "the engine broke" in str(e.value)
        # The server survives and still answers.
        assert (
            client.messages.count_tokens(
                model="broken", messages=[{"role": "user", "content": "hi"}]
            ).input_tokens
            > 0
        )


def test_top_k_and_top_p_are_honoured(client: anthropic.Anthropic, smollm2: Any) -> None:
    # Sampling at temperature 1 restricted to the single most likely token is greedy decoding.
    msg = client.messages.create(
        model=MODEL,
        max_tokens=8,
        extra_body={"temperature": 1.0, "top_k": 1, "top_p": 0.9},
        messages=[{"role": "user", "content": FRANCE}],
    )
    assert msg.content[0].type == "text"
    assert msg.content[0].text == greedy(smollm2, [user(FRANCE)], 8).text
    assert "top_p" in _bad(client, extra_body={"top_p": 0}).message
    assert "top_k" in _bad(client, extra_body={"top_k": -1}).message


def test_claude_code_hints_are_accepted(client: anthropic.Anthropic, smollm2: Any) -> None:
    """What Claude Code sends besides the prompt: `?beta=true`, anthropic-beta, adaptive
    thinking, an effort and a context edit that clears thinking (never in our prompts)."""
    msg = client.messages.create(
        model=MODEL,
        max_tokens=8,
        messages=[{"role": "user", "content": FRANCE}],
        extra_query={"beta": "true"},
        extra_headers={"anthropic-beta": "context-management-2025-06-27,effort-2025-11-24"},
        extra_body={
            **GREEDY,
            "thinking": {"type": "adaptive", "display": "omitted"},
            "output_config": {"effort": "high"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        },
    )
    assert msg.content[0].type == "text"
    assert msg.content[0].text == greedy(smollm2, [user(FRANCE)], 8).text
    assert "output_config.effort" in _bad(client, extra_body={"output_config": {"effort": "huge"}}).message
    unknown = {"context_management": {"edits": [{"type": "clear_everything"}]}}
    assert "context_management.edits.0.type" in _bad(client, extra_body=unknown).message


def test_context_management_clears_old_tool_results(client: anthropic.Anthropic) -> None:
    """clear_tool_uses past its trigger: all but the last `keep` results replaced, reported in
    applied_edits with the tokens saved."""
    messages: list[Any] = [{"role": "user", "content": "Read the files."}]
    for n in range(4):
        messages += [
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": f"t{n}", "name": "read", "input": {"n": n}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": f"t{n}", "content": "lorem ipsum " * 40}]},
        ]
    edit = {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 10},
            "keep": {"type": "tool_uses", "value": 1}}
    tools = [{"name": "read", "input_schema": {"type": "object"}}]
    plain = client.messages.create(
        model=MODEL, max_tokens=1, messages=messages, tools=tools, extra_body=GREEDY
    )
    raw = client.messages.with_raw_response.create(
        model=MODEL, max_tokens=1, messages=messages, tools=tools,
        extra_body={**GREEDY, "context_management": {"edits": [edit]}},
    )
    applied = raw.http_response.json()["context_management"]["applied_edits"]
    assert applied[0]["type"] == "clear_tool_uses_20250919"
    assert applied[0]["cleared_tool_uses"] == 3
    saved = applied[0]["cleared_input_tokens"]
    edited = raw.parse().usage

    def prompt(u: anthropic.types.Usage) -> int:  # input_tokens leave out the prefix cache's
        return u.input_tokens + (u.cache_read_input_tokens or 0)

    assert saved > 100 and prompt(edited) == prompt(plain.usage) - saved


def test_reachability_probes_need_no_key() -> None:
    """Claude Code probes HEAD {base} and {base}/api/hello without its key."""
    with live_server(Settings(api_key="secret")) as server:
        for path in ("/api/anthropic", "/api/anthropic/api/hello"):
            probe = httpx.head(server.url + path)
            assert (probe.status_code, probe.content) == (200, b"")
        denied = httpx.post(server.url + "/api/anthropic/v1/messages", json={})
        assert denied.status_code == 401
