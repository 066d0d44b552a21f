"""The registry of request fields (server/dialects/fields.py) is what the server does: each
ignored field is accepted (2xx) and each refused one answers 400 in the dialect's own error
shape naming it, sent to a live server with a tiny llama and a one-token answer. And every
field of the installed SDKs' request types has a decision."""

from __future__ import annotations

import re
import typing
from collections.abc import Iterator, Mapping
from typing import Any

import httpx
import pytest

from mlx_omnia.server.dialects.fields import (
    CHAT,
    COMPLETIONS,
    COUNT_TOKENS,
    ENDPOINTS,
    GENERATE,
    MESSAGES,
    RESPONSES,
    Endpoint,
    Field,
)
from tests.fixtures.tiny import write_tiny_llama
from tests.server_harness import LiveServer, live_server

HI = [{"role": "user", "content": "hi"}]
# The smallest request of each route (one token of answer), which a field's sample is merged in.
BASES: dict[str, dict[str, Any]] = {
    "/chat/completions": {"messages": HI, "max_tokens": 1},
    "/completions": {"prompt": "hi", "max_tokens": 1},
    "/responses": {"input": "hi", "max_output_tokens": 1},
    "/messages": {"messages": HI, "max_tokens": 1},
    "/messages/count_tokens": {"messages": HI},
    ":generateContent": {"contents": [{"role": "user", "parts": [{"text": "hi"}]}],
                         "generationConfig": {"maxOutputTokens": 1}},
    ":countTokens": {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]},
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A tiny llama whose context holds a request with tools in it."""
    tiny = write_tiny_llama(tmp_path_factory.mktemp("fields") / "tiny", max_position_embeddings=2048)
    with live_server(models=[tiny]) as s:
        yield s


def merged(base: Mapping[str, Any], more: Mapping[str, Any]) -> dict[str, Any]:
    """`base` with `more` in it: objects merged member by member, anything else replaced."""
    out = dict(base)
    for key, value in more.items():
        old = out.get(key)
        if isinstance(old, Mapping) and isinstance(value, Mapping):
            out[key] = merged(typing.cast(Mapping[str, Any], old),
                              typing.cast(Mapping[str, Any], value))
        else:
            out[key] = value
    return out


def request(server: LiveServer, endpoint: Endpoint, field: Field) -> httpx.Response:
    model = next(iter(server.state.manager.aliases()))
    path = endpoint.route.split(" ", 1)[1].replace("{model}", model)
    base = next(b for suffix, b in BASES.items() if path.endswith(suffix))
    body = merged(base, field.sample or {})
    if endpoint.dialect != "gemini":
        body.setdefault("model", model)
    stream = body.get("stream") is True
    return httpx.post(server.url + path, json=body, timeout=60, headers={} if not stream else
                      {"accept": "text/event-stream"})


def error_of(dialect: str, r: httpx.Response) -> str:
    """The text of a 400 (OpenAI's param with its message), after checking its shape."""
    error = r.json()
    message = error["error"]["message"]
    if dialect == "openai":
        assert error == {"error": {"message": message, "type": "invalid_request_error",
                                   "param": error["error"]["param"], "code": None}}
        return f"{error['error']['param']} {message}"
    if dialect == "anthropic":
        assert error == {"type": "error",
                         "error": {"type": "invalid_request_error", "message": message}}
        return message
    assert error == {"error": {"code": 400, "message": message, "status": "INVALID_ARGUMENT"}}
    return message


CASES = [
    pytest.param(e, f, id=f"{e.route.split('/v1')[1].split(':')[-1].lstrip('/')}:{f.path}")
    for e in ENDPOINTS for f in e.fields if f.treatment != "honoured"
]


@pytest.mark.parametrize(("endpoint", "field"), CASES)
def test_ignored_fields_are_accepted_and_refused_ones_named(
    server: LiveServer, endpoint: Endpoint, field: Field
) -> None:
    r = request(server, endpoint, field)
    if field.treatment == "ignored":
        assert r.status_code == 200, r.text
        return
    assert r.status_code == 400, r.text
    assert field.names in error_of(endpoint.dialect, r), r.text


def test_every_ignored_or_refused_field_has_a_sample() -> None:
    for endpoint in ENDPOINTS:
        for f in endpoint.fields:
            assert (f.sample is None) == (f.treatment == "honoured"), f.path


def _keys(cls: Any) -> set[str]:
    """A TypedDict's keys, its bases' included."""
    return set(cls.__required_keys__ | cls.__optional_keys__)


def _top(endpoint: Endpoint) -> set[str]:
    return {f.path.split(".")[0].split("[")[0].split(" ")[0] for f in endpoint.fields}


def test_every_sdk_request_field_has_a_decision() -> None:
    """The installed SDKs' request types (the APIs' current references): each top-level field
    is in the registry (headers the SDKs send apart, such as betas, are not body fields)."""
    from anthropic.types import message_count_tokens_params, message_create_params
    from anthropic.types.beta import message_create_params as beta_create_params
    from google.genai import types
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_params
    from openai.types.responses import response_create_params

    headers = {"betas", "workspace_id"}
    expected = {
        CHAT.route: _keys(chat_params.CompletionCreateParamsBase) | {"stream"},
        COMPLETIONS.route: _keys(completion_create_params.CompletionCreateParamsBase) | {"stream"},
        RESPONSES.route: _keys(response_create_params.ResponseCreateParamsBase) | {"stream"},
        MESSAGES.route: _keys(message_create_params.MessageCreateParamsBase)
        | _keys(beta_create_params.MessageCreateParamsBase) | {"stream"},
        COUNT_TOKENS.route: _keys(message_count_tokens_params.MessageCountTokensParams),
    }
    endpoints = {e.route: e for e in ENDPOINTS}
    for route, keys in expected.items():
        missing = keys - headers - _top(endpoints[route])
        assert not missing, (route, sorted(missing))
    # Gemini: what google-genai writes at the top level of a request from GenerateContentConfig
    # (models.py, _GenerateContentConfig_to_mldev and _to_vertex), then GenerationConfig's
    # fields (camelCase on the wire) under generationConfig, Part's and Tool's.
    top = {"contents", "systemInstruction", "generationConfig", "safetySettings", "tools",
           "toolConfig", "labels", "cachedContent", "serviceTier", "modelArmorConfig",
           "continuationToken", "store"}
    assert not top - _top(GENERATE), sorted(top - _top(GENERATE))
    for prefix, model in (("generationConfig.", types.GenerationConfig),
                          ("contents[].parts[].", types.Part), ("tools[].", types.Tool)):
        listed = {re.split(r"[^\w]", f.path.removeprefix(prefix))[0]
                  for f in GENERATE.fields if f.path.startswith(prefix)}
        missing = {_camel(k) for k in model.model_fields} - listed
        assert not missing, (prefix, sorted(missing))


def _camel(key: str) -> str:
    head, *rest = key.split("_")
    return head + "".join(p[:1].upper() + p[1:] for p in rest)


def test_chat_takes_names_and_an_assistants_refusal_parts(server: LiveServer) -> None:
    """Newly honoured: a message's name reaches the template, a refusal part is its text."""
    model = next(iter(server.state.manager.aliases()))
    messages = [
        {"role": "user", "content": "hi", "name": "ada"},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
        {"role": "user", "content": "why"},
    ]
    r = httpx.post(f"{server.url}/api/openai/v1/chat/completions", timeout=60,
                   json={"model": model, "messages": messages, "max_tokens": 1})
    assert r.status_code == 200, r.text
    bad = httpx.post(f"{server.url}/api/openai/v1/chat/completions", timeout=60,
                     json={"model": model, "messages": [{**messages[0], "name": 5}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages[0].name"
