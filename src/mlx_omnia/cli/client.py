"""HTTP access to omnia-server: JSON requests, server-sent events, errors as exit codes."""

from __future__ import annotations

import json
from collections.abc import Generator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import quote

import httpx

# Exit codes scripts can rely on (also in `omnia --help` and the README).
EXIT_OK = 0
EXIT_ERROR = 1  # the server answered with an error (unknown model, bad request, failed download...)
EXIT_USAGE = 2  # bad command line
EXIT_UNREACHABLE = 3  # no server answers at the URL (and it was not started automatically)
EXIT_INTERRUPTED = 130  # Ctrl-C


class CliError(Exception):
    """An error reported on stderr as `error: MESSAGE`, ending the command with `exit_code`."""

    exit_code = EXIT_ERROR

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ServerError(CliError):
    exit_code = EXIT_ERROR

    def __init__(
        self, message: str, status: int | None = None, kind: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.code = code  # OpenAI's error.code: "context_length_exceeded", "model_not_found"


class Unreachable(CliError):
    exit_code = EXIT_UNREACHABLE


class UsageError(CliError):
    exit_code = EXIT_USAGE


JsonObject = dict[str, Any]


def as_object(value: Any) -> JsonObject:
    return cast(JsonObject, value) if isinstance(value, dict) else {}


def as_list(value: Any) -> list[Any]:
    return cast(list[Any], value) if isinstance(value, list) else []


# -- server-sent events ----------------------------------------------------------------------------


@dataclass
class SseEvent:
    event: str | None
    data: str


def parse_sse(lines: Iterable[str]) -> Iterator[SseEvent]:
    """Events from the lines of a text/event-stream body (comments and id/retry fields ignored)."""
    event: str | None = None
    data: list[str] = []
    for raw in lines:
        line = raw.rstrip("\r\n")
        if not line:
            if data:
                yield SseEvent(event, "\n".join(data))
            event, data = None, []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            data.append(value)
        elif name == "event":
            event = value
    if data:
        yield SseEvent(event, "\n".join(data))


# -- errors ----------------------------------------------------------------------------------------


def _error_message(response: httpx.Response) -> tuple[str, str | None, str | None]:
    """The message, kind and code of an error body in either shape: OpenAI's or the native
    one."""
    try:
        body = as_object(json.loads(response.read()))
    except (ValueError, httpx.HTTPError):
        body = {}
    error = body.get("error")
    if isinstance(error, dict):
        err = as_object(error)
        message = err.get("message")
        kind, code = err.get("type"), err.get("code")
        return (
            str(message) if message else f"HTTP {response.status_code}",
            str(kind) if kind else None,
            str(code) if code else None,
        )
    detail = body.get("detail")
    if isinstance(detail, str):
        return detail, None, None
    return f"HTTP {response.status_code} {response.reason_phrase}".strip(), None, None


def _raise_for(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    message, kind, code = _error_message(response)
    if response.status_code == 401:
        message += " (give the server's key with --api-key or OMNIA_API_KEY)"
    raise ServerError(message, response.status_code, kind, code)


# -- the client ------------------------------------------------------------------------------------


@dataclass
class Answer:
    """What a streamed chat answer said besides its text."""

    text: str = ""
    model: str | None = None
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


class Client:
    def __init__(self, url: str, api_key: str | None = None) -> None:
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # Reads wait without limit: a first token may wait for a model to load.
        timeout = httpx.Timeout(30.0, connect=5.0, read=None)
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _unreachable(self, error: Exception) -> Unreachable:
        return Unreachable(f"cannot reach omnia-server at {self.url} ({error})")

    def request(self, method: str, path: str, body: JsonObject | None = None) -> JsonObject:
        try:
            response = self._http.request(method, path, json=body)
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            raise self._unreachable(e) from e
        except httpx.HTTPError as e:
            raise ServerError(f"request to {self.url}{path} failed: {e}") from e
        _raise_for(response)
        try:
            return as_object(response.json())
        except ValueError as e:
            raise ServerError(f"{self.url}{path} did not answer JSON") from e

    def get(self, path: str) -> JsonObject:
        return self.request("GET", path)

    def healthy(self) -> bool:
        try:
            response = self._http.get("/admin/health", timeout=2.0)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    def events(self, method: str, path: str, body: JsonObject | None = None) -> Generator[SseEvent]:
        """The server-sent events of one request; leaving the iteration early (break, Ctrl-C,
        `close()`) closes the connection, which tells the server to stop."""
        try:
            with self._http.stream(method, path, json=body) as response:
                _raise_for(response)
                yield from parse_sse(response.iter_lines())
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            raise self._unreachable(e) from e
        except httpx.HTTPError as e:
            raise ServerError(f"the connection to {self.url} broke: {e}") from e

    def default_model(self) -> str:
        model = self.get("/admin/status").get("default_model")
        if not isinstance(model, str) or not model:
            raise ServerError("the server names no default model; give one with -m")
        return model

    def chat(self, body: JsonObject, answer: Answer) -> Generator[str]:
        """Stream one chat completion (OpenAI's chat/completions): yields text, fills `answer`."""
        payload: JsonObject = {
            **body,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        for event in self.events("POST", "/api/openai/v1/chat/completions", payload):
            if event.data.strip() == "[DONE]":
                return
            try:
                chunk = as_object(json.loads(event.data))
            except ValueError as e:
                raise ServerError(
                    f"the server sent an unreadable event: {event.data[:80]!r}"
                ) from e
            error = chunk.get("error")
            if error is not None:
                message = as_object(error).get("message") or "generation failed"
                raise ServerError(str(message))
            if isinstance(chunk.get("model"), str):
                answer.model = chunk["model"]
            usage = as_object(chunk.get("usage"))
            if usage:
                answer.prompt_tokens = _int(usage.get("prompt_tokens"))
                answer.completion_tokens = _int(usage.get("completion_tokens"))
            for choice in as_list(chunk.get("choices")):
                c = as_object(choice)
                text = as_object(c.get("delta")).get("content")
                if isinstance(text, str) and text:
                    answer.text += text
                    yield text
                reason = c.get("finish_reason")
                if isinstance(reason, str):
                    answer.finish_reason = reason
        raise ServerError("the answer stream ended early (no [DONE])")


def _int(value: object) -> int | None:
    return value if isinstance(value, int) else None


def model_path(model_id: str) -> str:
    """A model id as a URL path part (ids may hold one slash: owner/name)."""
    return quote(model_id, safe="/")
