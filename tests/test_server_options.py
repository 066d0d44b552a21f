"""Generation options are checked in one place for every dialect: an option out of its bounds (the
engine's, under the API's own) or one the model's signature does not honour answers 400 in the
dialect's own error shape, named as the client sent it, streaming or not."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlx_omnia import Model, generation_options, load
from mlx_omnia.server.manager import ModelManager
from mlx_omnia.server.settings import Settings
from tests.fixtures.tiny import write_tiny_llama
from tests.server_harness import LiveServer, live_server

MODEL = "narrow"
OPENAI = "/api/openai/v1"
MESSAGES = [{"role": "user", "content": "hi"}]


def _narrow(path: Path) -> Model:
    """A real tiny model whose signature narrows what it takes: token ids bounded at 100 and no
    temperature (the server must name what a model's signature refuses)."""
    model = load(path)
    model.signature = replace(
        model.signature,
        options={k: v for k, v in generation_options(100).items() if k != "temperature"},
        context_length=64,
    )
    return model


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    settings = Settings()
    path = write_tiny_llama(tmp_path_factory.mktemp("narrow") / MODEL)
    manager = ModelManager(settings, loader=lambda ref: _narrow(path))
    manager.add_alias(path)
    with live_server(settings, manager) as s:
        yield s


def _chat(**extra: Any) -> tuple[str, dict[str, Any]]:
    return f"{OPENAI}/chat/completions", {"model": MODEL, "messages": MESSAGES, **extra}


def _completion(**extra: Any) -> tuple[str, dict[str, Any]]:
    return f"{OPENAI}/completions", {"model": MODEL, "prompt": "hi", **extra}


def _response(**extra: Any) -> tuple[str, dict[str, Any]]:
    return f"{OPENAI}/responses", {"model": MODEL, "input": "hi", **extra}


def _message(**extra: Any) -> tuple[str, dict[str, Any]]:
    body = {"model": MODEL, "max_tokens": 4, "messages": MESSAGES, **extra}
    return "/api/anthropic/v1/messages", body


def _gemini(**config: Any) -> tuple[str, dict[str, Any]]:
    body = {"contents": [{"parts": [{"text": "hi"}]}], "generationConfig": config}
    return f"/api/gemini/v1beta/models/{MODEL}:generateContent", body


def _refusal(
    server: LiveServer, path: str, body: dict[str, Any], stream: bool
) -> tuple[str | None, str]:
    """POST the request (as a stream when `stream`); the param (OpenAI's shape alone has one) and
    the message of its 400, after checking that the body is exactly the dialect's error shape."""
    if stream and path.endswith(":generateContent"):
        path = path.replace(":generateContent", ":streamGenerateContent") + "?alt=sse"
    elif stream:
        body = {**body, "stream": True}
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()
    if path.startswith(OPENAI):
        message = error["error"]["message"]
        assert error == {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": error["error"]["param"],
                "code": None,
            }
        }
        return error["error"]["param"], message
    if path.startswith("/api/anthropic/"):
        message = error["error"]["message"]
        assert error == {"type": "error", "error": {"type": "invalid_request_error", "message": message}}
        return None, message
    message = error["error"]["message"]
    assert error == {"error": {"code": 400, "message": message, "status": "INVALID_ARGUMENT"}}
    return None, message


OUT_OF_BOUNDS = [
    (_chat(max_completion_tokens=0), "max_completion_tokens", "must be >= 1"),
    (_chat(max_tokens=0), "max_tokens", "must be >= 1"),
    (_chat(temperature=2.5), "temperature", "must be in [0, 2]"),
    (_chat(top_p=0.0), "top_p", "must be in (0, 1]"),
    (_chat(presence_penalty=2.5), "presence_penalty", "must be in [-2, 2]"),
    (_chat(logit_bias={"7": 150}), "logit_bias", "values must be in [-100, 100] (token 7 has 150)"),
    (_chat(logprobs=True, top_logprobs=21), "top_logprobs", "must be between 0 and 20"),
    (_chat(seed=-1), "seed", "must be between 0 and 18446744073709551615"),
    (_completion(stop=["a", ""]), "stop", "must not hold an empty string"),
    (_completion(stop=["a", "b", "c", "d", "e"]), "stop", "must hold at most 4 values"),
    (_completion(logprobs=6), "logprobs", "must be between 0 and 5"),
    (_response(max_output_tokens=0), "max_output_tokens", "must be >= 1"),
    (_response(temperature=-1.0), "temperature", "must be in [0, 2]"),
    (_message(temperature=1.5), "temperature", "must be in [0, 1]"),
    (_message(max_tokens=0), "max_tokens", "must be >= 1"),
    (_message(top_k=-1), "top_k", "must be >= 0"),
    (_message(stop_sequences=["x", ""]), "stop_sequences", "must not hold an empty string"),
    (_gemini(maxOutputTokens=0), "generationConfig.maxOutputTokens", "must be >= 1"),
    (_gemini(topP=1.5), "generationConfig.topP", "must be in (0, 1]"),
    (_gemini(stopSequences=list("abcdef")), "generationConfig.stopSequences", "must hold at most 5 values"),
    (_gemini(responseLogprobs=True, logprobs=21), "generationConfig.logprobs", "must be between 0 and 20"),
]


# These pass the API's bounds and fail at the model's signature, once the request is queued.
MODEL_REFUSES = [
    (_chat(temperature=0.5), "temperature", "is not supported by this model"),
    (_chat(logit_bias={"150": 1}), "logit_bias", "names token 150, outside 0..99"),
    (_completion(temperature=0.5), "temperature", "is not supported by this model"),
    (_response(temperature=0.5), "temperature", "is not supported by this model"),
    (_message(temperature=0.5), "temperature", "is not supported by this model"),
    (_gemini(temperature=0.5), "generationConfig.temperature", "is not supported by this model"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("request_", "name", "reason"), OUT_OF_BOUNDS + MODEL_REFUSES)
def test_a_refused_option_is_named_as_sent(
    server: LiveServer, request_: tuple[str, dict[str, Any]], name: str, reason: str, stream: bool
) -> None:
    param, message = _refusal(server, *request_, stream=stream)
    assert message == f"{name} {reason}"
    assert param == (name if request_[0].startswith(OPENAI) else None)


def test_options_the_model_takes_generate(server: LiveServer) -> None:
    path, body = _chat(top_p=0.5, logit_bias={"99": 1}, max_tokens=1)
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 1
    path, body = _gemini(topK=3, maxOutputTokens=2)
    r = httpx.post(server.url + path.replace("generateContent", "streamGenerateContent"), json=body)
    assert r.status_code == 200, r.text
    assert json.loads(r.text)[-1]["usageMetadata"]["candidatesTokenCount"] == 2
