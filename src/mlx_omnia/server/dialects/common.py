"""Helpers every dialect uses: strict extra-field policy, SSE framing, ids, model lists, token
texts."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ConfigDict

from mlx_omnia.server.errors import ApiError
from mlx_omnia.server.state import ServerState


class Request(BaseModel):
    """Request bodies keep unknown fields so that each can be judged, never silently dropped."""

    model_config = ConfigDict(extra="allow")


# One server-sent event (its schema describes each event of a text/event-stream, as OpenAPI
# 3.2's itemSchema does): the JSON text of `data`, named by `event` in some dialects.
SSE_EVENT: dict[str, Any] = {
    "type": "object",
    "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
    "required": ["data"],
}
# A route that answers with server-sent events when the request asks for a stream.
STREAMED: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The answer; with stream: true, its server-sent events.",
        "content": {"text/event-stream": {"schema": SSE_EVENT}},
    }
}


def text_part(kinds: list[str], **more: dict[str, Any]) -> dict[str, Any]:
    """The schema of a text content part whose `type` is one of `kinds`."""
    return {
        "type": "object",
        "properties": {"type": {"enum": kinds}, "text": {"type": "string"}, **more},
        "required": ["type", "text"],
    }


def refuse_unknown(body: BaseModel, harmless: Iterable[str] = ()) -> None:
    """400 naming the first field the server does not honour and that could change the output."""
    allowed = set(harmless)
    for name in body.model_extra or {}:
        if name not in allowed:
            raise ApiError("invalid_request", f"field {name!r} is not supported by this server", name)


def sse(data: Any, event: str | None = None) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n"


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def model_ids(state: ServerState) -> list[str]:
    """The models a dialect lists: the default, the resident ones, the aliases; once each."""
    ids = [
        state.manager.default_id,
        *[r.id for r in state.manager.resident()],
        *state.manager.aliases(),
    ]
    return list(dict.fromkeys(ids))


def token_text(raw: bytes) -> str:
    """A token's text for a logprobs entry: its bytes as UTF-8, a byte of a character split
    across tokens written as \\xNN (OpenAI's entries carry the exact bytes too)."""
    return raw.decode("utf-8", errors="backslashreplace")
