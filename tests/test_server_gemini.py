"""The Gemini dialect through the official google-genai SDK (and raw HTTP for wire details),
against a real server on loopback and the real SmolLM2-135M-Instruct."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from google import genai
from google.genai import errors, types

from mlx_omnia import Chat, ChatMessage, GenerationOptions, Model
from mlx_omnia.server.settings import Settings
from tests.server_harness import LiveServer, live_server

MODEL = "smollm2-135m-instruct"
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with live_server(Settings()) as s:
        yield s


def client_for(s: LiveServer, key: str = "x") -> genai.Client:
    return genai.Client(
        api_key=key,
        http_options=types.HttpOptions(base_url=s.url + "/api/gemini", api_version="v1beta"),
    )


@pytest.fixture(scope="module")
def client(server: LiveServer) -> genai.Client:
    return client_for(server)


def user(text: str) -> ChatMessage:
    return ChatMessage(role="user", content=text)


def greedy(model: Model, chat: Chat, n: int):  # type: ignore[no-untyped-def]
    return model.generate(chat, GenerationOptions(temperature=0, max_tokens=n))


def url(s: LiveServer, path: str) -> str:
    return f"{s.url}/api/gemini/v1beta/{path}"


# -- generation ----------------------------------------------------------------------------------


def test_candidate_count_whole_and_streamed(client: genai.Client) -> None:
    """candidateCount alternatives: with a seed, candidate i samples with seed + i; the usage
    counts the prompt once; a stream gives each candidate's chunks by index, the usage of all
    on the chunk that finishes the last."""
    def config(count: int, seed: int) -> types.GenerateContentConfig:
        return types.GenerateContentConfig(
            candidate_count=count, seed=seed, temperature=1.0, top_p=1.0, max_output_tokens=12
        )

    whole = client.models.generate_content(model=MODEL, contents=QUESTION, config=config(3, 5))
    assert whole.candidates is not None and [c.index for c in whole.candidates] == [0, 1, 2]
    texts = [c.content.parts[0].text for c in whole.candidates if c.content and c.content.parts]
    alone = [
        client.models.generate_content(model=MODEL, contents=QUESTION, config=config(1, 5 + i))
        for i in range(3)
    ]
    assert texts == [a.text for a in alone] and len(set(texts)) > 1
    usage, single = whole.usage_metadata, [a.usage_metadata for a in alone]
    assert usage is not None and all(u is not None for u in single)
    assert usage.prompt_token_count == single[0].prompt_token_count  # type: ignore[union-attr]
    assert usage.candidates_token_count == sum(
        u.candidates_token_count or 0 for u in single if u is not None
    )
    streamed = ["", "", ""]
    chunks = list(client.models.generate_content_stream(
        model=MODEL, contents=QUESTION, config=config(3, 5)
    ))
    for chunk in chunks:
        for c in chunk.candidates or []:
            streamed[c.index or 0] += "".join(p.text or "" for p in (c.content.parts or [])) if c.content else ""
    assert streamed == texts
    with_usage = [c for c in chunks if c.usage_metadata is not None]
    assert with_usage and with_usage[-1].usage_metadata == usage


def test_generate_content_greedy_equals_engine_and_usage_exact(
    client: genai.Client, smollm2: Model
) -> None:
    r = client.models.generate_content(
        model=MODEL,
        contents=QUESTION,
        config=types.GenerateContentConfig(temperature=0, max_output_tokens=16),
    )
    chat = Chat((user(QUESTION),))
    want = greedy(smollm2, chat, 16)
    assert r.text == want.text == "The capital of France is Paris."
    assert r.candidates and r.candidates[0].finish_reason == types.FinishReason.STOP
    assert r.candidates[0].content and r.candidates[0].content.role == "model"
    u = r.usage_metadata
    assert u is not None
    assert u.prompt_token_count == len(smollm2.encode(chat)) == want.usage.prompt_tokens
    assert u.candidates_token_count == want.usage.completion_tokens
    assert u.total_token_count == u.prompt_token_count + u.candidates_token_count
    assert r.model_version == MODEL
    assert r.response_id


def test_stream_generate_content(client: genai.Client, smollm2: Model) -> None:
    chunks = list(
        client.models.generate_content_stream(
            model=MODEL,
            contents=QUESTION,
            config=types.GenerateContentConfig(temperature=0, max_output_tokens=5),
        )
    )
    want = greedy(smollm2, Chat((user(QUESTION),)), 5)
    assert len(chunks) > 1
    assert "".join(c.text or "" for c in chunks) == want.text
    last = chunks[-1]
    assert last.candidates and last.candidates[0].finish_reason == types.FinishReason.MAX_TOKENS
    assert all(c.candidates and c.candidates[0].finish_reason is None for c in chunks[:-1])
    assert last.usage_metadata is not None
    assert last.usage_metadata.prompt_token_count == want.usage.prompt_tokens
    assert last.usage_metadata.candidates_token_count == 5
    assert last.usage_metadata.total_token_count == want.usage.prompt_tokens + 5
    assert len({c.response_id for c in chunks}) == 1


def test_system_instruction_and_multi_turn(client: genai.Client, smollm2: Model) -> None:
    system = "You are a terse assistant. Answer in one word."
    contents = [
        types.Content(role="user", parts=[types.Part(text="Name a color.")]),
        types.Content(role="model", parts=[types.Part(text="Blue.")]),
        types.Content(role="user", parts=[types.Part(text="Name another one.")]),
    ]
    r = client.models.generate_content(
        model=MODEL,
        contents=contents,
        config=types.GenerateContentConfig(
            system_instruction=system, temperature=0, max_output_tokens=8
        ),
    )
    chat = Chat(
        (
            ChatMessage(role="system", content=system),
            user("Name a color."),
            ChatMessage(role="assistant", content="Blue."),
            user("Name another one."),
        )
    )
    want = greedy(smollm2, chat, 8)
    assert r.text == want.text
    assert r.usage_metadata is not None
    assert r.usage_metadata.prompt_token_count == len(smollm2.encode(chat))
    assert r.usage_metadata.candidates_token_count == want.usage.completion_tokens


def test_stop_sequences(client: genai.Client) -> None:
    r = client.models.generate_content(
        model=MODEL,
        contents=QUESTION,
        config=types.GenerateContentConfig(
            temperature=0, max_output_tokens=16, stop_sequences=["Paris"]
        ),
    )
    assert r.text == "The capital of France is "
    assert r.candidates and r.candidates[0].finish_reason == types.FinishReason.STOP


def test_max_output_tokens_gives_max_tokens(client: genai.Client) -> None:
    r = client.models.generate_content(
        model=MODEL,
        contents=QUESTION,
        config=types.GenerateContentConfig(temperature=0, max_output_tokens=3),
    )
    assert r.text == "The capital of"
    assert r.candidates and r.candidates[0].finish_reason == types.FinishReason.MAX_TOKENS
    assert r.usage_metadata is not None and r.usage_metadata.candidates_token_count == 3


def test_count_tokens(client: genai.Client, smollm2: Model) -> None:
    r = client.models.count_tokens(model=MODEL, contents=QUESTION)
    assert r.total_tokens == len(smollm2.encode(Chat((user(QUESTION),))))
    # "models/" prefixed names work as well.
    r2 = client.models.count_tokens(model=f"models/{MODEL}", contents=QUESTION)
    assert r2.total_tokens == r.total_tokens


def test_count_tokens_generate_content_request(server: LiveServer, smollm2: Model) -> None:
    body = {
        "generateContentRequest": {
            "model": f"models/{MODEL}",
            "systemInstruction": {"parts": [{"text": "Be brief."}]},
            "contents": [{"role": "user", "parts": [{"text": QUESTION}]}],
        }
    }
    r = httpx.post(url(server, f"models/{MODEL}:countTokens"), json=body, timeout=60)
    assert r.status_code == 200, r.text
    chat = Chat((ChatMessage(role="system", content="Be brief."), user(QUESTION)))
    assert r.json()["totalTokens"] == len(smollm2.encode(chat))


# -- models --------------------------------------------------------------------------------------


def test_models_list_and_get(client: genai.Client) -> None:
    models = list(client.models.list())
    assert models and models[0].name == f"models/{MODEL}"
    assert models[0].supported_actions is not None
    assert "generateContent" in models[0].supported_actions
    m = client.models.get(model=MODEL)
    assert m.name == f"models/{MODEL}"
    assert m.display_name == MODEL
    assert m.input_token_limit == 8192 and m.output_token_limit
    with pytest.raises(errors.ClientError) as e:
        client.models.get(model="no-such-model")
    assert e.value.code == 404 and e.value.status == "NOT_FOUND"


# -- errors --------------------------------------------------------------------------------------


def _client_error(fn: Any, **kw: Any) -> errors.ClientError:
    with pytest.raises(errors.ClientError) as e:
        result = fn(**kw)
        if not isinstance(result, types.GenerateContentResponse):
            list(result)  # a stream: the error comes with the response status
    return e.value


def test_unknown_model_404(client: genai.Client) -> None:
    e = _client_error(client.models.generate_content, model="no-such-model", contents="hi")
    assert e.code == 404 and e.status == "NOT_FOUND"
    # A hub repo id holds a slash: the path still parses, and the model is named.
    e = _client_error(client.models.generate_content, model="acme/tiny", contents="hi")
    assert e.code == 404 and "acme/tiny" in (e.message or "")
    e = _client_error(client.models.generate_content_stream, model="acme/tiny", contents="hi")
    assert e.code == 404


@pytest.mark.parametrize(
    ("config", "field"),
    [
        (types.GenerateContentConfig(response_mime_type="text/html"), "responseMimeType"),
        (types.GenerateContentConfig(response_schema={"type": "STRING"}), "responseSchema"),
        (types.GenerateContentConfig(candidate_count=9), "candidateCount"),
        (types.GenerateContentConfig(logprobs=3), "logprobs"),
        (types.GenerateContentConfig(response_logprobs=True, logprobs=21), "logprobs"),
        (
            types.GenerateContentConfig(
                tools=[types.Tool(google_search=types.GoogleSearch())],
                automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True),
            ),
            "googleSearch",
        ),
        (types.GenerateContentConfig(cached_content="cachedContents/abc"), "cachedContent"),
    ],
)
def test_unsupported_fields_400(
    client: genai.Client, config: types.GenerateContentConfig, field: str
) -> None:
    e = _client_error(client.models.generate_content, model=MODEL, contents="hi", config=config)
    assert e.code == 400 and e.status == "INVALID_ARGUMENT"
    assert field in (e.message or "")
    # Streaming refuses before the first event, with the status.
    e = _client_error(
        client.models.generate_content_stream, model=MODEL, contents="hi", config=config
    )
    assert e.code == 400 and field in (e.message or "")


def test_non_text_parts_400(client: genai.Client) -> None:
    image = types.Part.from_bytes(data=b"\x89PNG....", mime_type="image/png")
    e = _client_error(
        client.models.generate_content, model=MODEL, contents=[types.Content(role="user", parts=[image])]
    )
    assert e.code == 400 and "inlineData" in (e.message or "")
    call = types.Part(function_call=types.FunctionCall(name="f", args={}))
    e = _client_error(
        client.models.generate_content,
        model=MODEL,
        contents=[types.Content(role="user", parts=[types.Part(text="hi"), call])],
    )
    assert e.code == 400 and "functionCall" in (e.message or "")


def test_harmless_fields_accepted(client: genai.Client) -> None:
    r = client.models.generate_content(
        model=MODEL,
        contents=QUESTION,
        config=types.GenerateContentConfig(
            temperature=0,
            max_output_tokens=2,
            response_mime_type="text/plain",
            candidate_count=1,
            thinking_config=types.ThinkingConfig(thinking_budget=0),
            safety_settings=[
                types.SafetySetting(
                    category=types.HarmCategory.HARM_CATEGORY_HARASSMENT,
                    threshold=types.HarmBlockThreshold.BLOCK_NONE,
                )
            ],
        ),
    )
    assert r.text == "The capital"


def test_context_overflow_400(client: genai.Client) -> None:
    long = "hello " * 9000
    assert (client.models.count_tokens(model=MODEL, contents=long).total_tokens or 0) > 8192
    e = _client_error(
        client.models.generate_content,
        model=MODEL,
        contents=long,
        config=types.GenerateContentConfig(max_output_tokens=4),
    )
    assert e.code == 400 and e.status == "INVALID_ARGUMENT" and "context" in (e.message or "")


def test_auth() -> None:
    with live_server(Settings(api_key="k")) as s:
        # Keep each client referenced: a collected genai.Client closes its HTTP session.
        wrong, right = client_for(s, "wrong"), client_for(s, "k")
        e = _client_error(wrong.models.count_tokens, model=MODEL, contents="hi")
        assert e.code == 401 and e.status == "UNAUTHENTICATED"
        ok = right.models.count_tokens(model=MODEL, contents="hi")
        assert ok.total_tokens and ok.total_tokens > 0
        # ?key= works too, and errors keep Gemini's shape.
        r = httpx.get(url(s, "models") + "?key=k", timeout=30)
        assert r.status_code == 200 and r.json()["models"][0]["name"] == f"models/{MODEL}"
        r = httpx.get(url(s, "models") + "?key=nope", timeout=30)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == 401
        assert r.json()["error"]["status"] == "UNAUTHENTICATED"


# -- wire details (raw HTTP) ---------------------------------------------------------------------


def test_raw_snake_case_and_json_array_stream(server: LiveServer) -> None:
    body = {
        "contents": [{"role": "user", "parts": [{"text": QUESTION}]}],
        "generation_config": {"temperature": 0, "max_output_tokens": 3},
    }
    r = httpx.post(url(server, f"models/{MODEL}:generateContent"), json=body, timeout=60)
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["candidates"][0]["content"] == {"role": "model", "parts": [{"text": "The capital of"}]}
    assert data["candidates"][0]["finishReason"] == "MAX_TOKENS"
    assert data["candidates"][0]["index"] == 0
    assert set(data["usageMetadata"]) >= {"promptTokenCount", "candidatesTokenCount", "totalTokenCount"}
    # Without alt=sse the stream is one JSON array of responses.
    r = httpx.post(url(server, f"models/{MODEL}:streamGenerateContent"), json=body, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    chunks = json.loads(r.text)
    assert "".join(c["candidates"][0]["content"]["parts"][0]["text"] for c in chunks) == "The capital of"
    assert chunks[-1]["candidates"][0]["finishReason"] == "MAX_TOKENS"
    # With alt=sse each event is one response.
    r = httpx.post(url(server, f"models/{MODEL}:streamGenerateContent?alt=sse"), json=body, timeout=60)
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1]["usageMetadata"]["candidatesTokenCount"] == 3


@pytest.mark.parametrize(
    ("path", "body", "status", "field"),
    [
        (f"models/{MODEL}:generateContent", {"contents": [{"parts": [{"text": "hi"}]}], "bogus": 1}, 400, "bogus"),
        (f"models/{MODEL}:generateContent", {"contents": []}, 400, "contents"),
        (f"models/{MODEL}:generateContent", {"contents": [{"role": "bot", "parts": [{"text": "x"}]}]}, 400, "role"),
        (f"models/{MODEL}:generateContent",
         {"contents": [{"parts": [{"text": "hi"}]}], "generationConfig": {"topK": "many"}}, 400, "topK"),
        (f"models/{MODEL}:generateContent",
         {"contents": [{"parts": [{"text": "hi"}]}], "generationConfig": {"temperature": -1}}, 400, "temperature"),
        (f"models/{MODEL}:generateContent",
         {"contents": [{"parts": [{"text": "hi"}]}], "generationConfig": {"stopSequences": list("abcdef")}},
         400, "stopSequences"),
        (f"models/{MODEL}:countTokens", {"contents": [{"parts": [{"text": "hi"}]}], "extra": True}, 400, "extra"),
        (f"models/{MODEL}:embedContent", {}, 404, "embedContent"),
        (f"models/{MODEL}", {}, 405, "use GET"),  # a model is a GET resource; methods take ':'

    ],
)
def test_raw_errors_in_gemini_shape(
    server: LiveServer, path: str, body: dict[str, Any], status: int, field: str
) -> None:
    r = httpx.post(url(server, path), json=body, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and isinstance(err["status"], str)
    assert field in err["message"]


def test_raw_invalid_json_and_server_survives(server: LiveServer) -> None:
    r = httpx.post(
        url(server, f"models/{MODEL}:generateContent"),
        content=b"{not json",
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["status"] == "INVALID_ARGUMENT"
    r = httpx.post(url(server, f"models/{MODEL}:generateContent"), json=[1, 2], timeout=30)
    assert r.status_code == 400
    assert httpx.get(f"{server.url}/admin/health", timeout=10).status_code == 200


def test_logprobs_result(client: genai.Client, smollm2: Model) -> None:
    """responseLogprobs: each chosen token's log-probability under the model and, with
    logprobs=N, the N likeliest tokens of each step, in generateContent and in its stream."""
    config = types.GenerateContentConfig(
        temperature=0, max_output_tokens=8, response_logprobs=True, logprobs=2
    )
    r = client.models.generate_content(model=MODEL, contents=QUESTION, config=config)
    assert r.candidates
    result = r.candidates[0].logprobs_result
    assert result is not None and result.chosen_candidates and result.top_candidates
    want = smollm2.generate(
        Chat((user(QUESTION),)), GenerationOptions(temperature=0, max_tokens=8, logprobs=2)
    )
    assert [c.token_id for c in result.chosen_candidates] == [e.token_id for e in want.logprobs]
    assert [c.log_probability for c in result.chosen_candidates] == [
        e.logprob for e in want.logprobs
    ]
    assert "".join(c.token or "" for c in result.chosen_candidates) == r.text
    assert all(len(t.candidates or []) == 2 for t in result.top_candidates)
    avg = r.candidates[0].avg_logprobs
    assert avg is not None
    assert abs(avg - sum(e.logprob for e in want.logprobs) / len(want.logprobs)) < 1e-9
    chunks = list(client.models.generate_content_stream(model=MODEL, contents=QUESTION, config=config))
    streamed = [
        c.token_id
        for chunk in chunks
        if chunk.candidates and chunk.candidates[0].logprobs_result
        for c in chunk.candidates[0].logprobs_result.chosen_candidates or []
    ]
    assert streamed == [e.token_id for e in want.logprobs]
    # Off unless asked.
    plain = client.models.generate_content(
        model=MODEL, contents=QUESTION,
        config=types.GenerateContentConfig(temperature=0, max_output_tokens=2),
    )
    assert plain.candidates and plain.candidates[0].logprobs_result is None
