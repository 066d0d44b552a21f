"""Anthropic dialect (Messages API), under /api/anthropic/v1."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Literal, cast

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ConfigDict, Field

from mlx_omnia import Bounds, Chat, ChatMessage, Piece, TextPart
from mlx_omnia.server.dialects.common import (
    STREAMED,
    model_ids,
    new_id,
    refuse_unknown,
    sse,
    text_part,
)
from mlx_omnia.server.dialects.common import Request as Body
from mlx_omnia.server.dialects.errors import error_body
from mlx_omnia.server.dialects.generation import Options, documented
from mlx_omnia.server.errors import ApiError
from mlx_omnia.server.state import ServerState, state_of

router = APIRouter()

# Request fields accepted and ignored because they cannot change the output.
# (cache_control: a prompt-caching hint; speed: a latency tier; diagnostics: prompt-cache
# divergence reports, always null here.)
HARMLESS = (
    "metadata",
    "service_tier",
    "cache_control",
    "speed",
    "inference_geo",
    "user_profile_id",
    "diagnostics",
)
# Keys of a text content block that cannot change the output.
TEXT_BLOCK_KEYS = frozenset({"type", "text", "cache_control", "citations"})
EPOCH = "1970-01-01T00:00:00Z"
# Anthropic's own bounds, tighter than the engine's.
LIMITS = {
    "max_tokens": Bounds(ge=1),
    "temperature": Bounds(le=1.0),
    "stop": Bounds(nonempty=True),
}

StopReason = Literal["end_turn", "max_tokens", "stop_sequence"]
ROLES: dict[str, Literal["user", "assistant"]] = {"user": "user", "assistant": "assistant"}


class _Strict(Body):
    """Types as Anthropic checks them: no strings for numbers, no floats for integers."""

    model_config = ConfigDict(extra="allow", strict=True)


_BLOCKS: dict[str, Any] = {
    "anyOf": [
        {"type": "string"},
        {
            "type": "array",
            "items": {
                **text_part(["text"], cache_control={}, citations={"enum": [None, []]}),
                "additionalProperties": False,
            },
        },
    ]
}
MESSAGE: dict[str, Any] = {
    "type": "object",
    "properties": {"role": {"enum": ["user", "assistant"]}, "content": _BLOCKS},
    "required": ["role", "content"],
    "additionalProperties": False,
}


class CountTokensRequest(_Strict):
    model: str
    messages: list[dict[str, Any]] = Field(json_schema_extra={"minItems": 1, "items": MESSAGE})
    system: str | list[dict[str, Any]] | None = Field(
        None, json_schema_extra={"anyOf": [*_BLOCKS["anyOf"], {"type": "null"}]}
    )
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(json_schema_extra=documented("max_tokens", LIMITS))
    stop_sequences: list[str] | None = Field(None, json_schema_extra=documented("stop", LIMITS))
    temperature: float | None = Field(None, json_schema_extra=documented("temperature", LIMITS))
    top_p: float | None = Field(None, json_schema_extra=documented("top_p", LIMITS))
    top_k: int | None = Field(None, json_schema_extra=documented("top_k", LIMITS))
    stream: bool = False
    metadata: dict[str, Any] | None = None


# -- request -> engine ---------------------------------------------------------------------------
def _text_blocks(content: Any, where: str) -> str | list[TextPart]:
    """A content value (string or list of text blocks) as the engine's message content."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(
            "invalid_request", f"{where}: must be a string or a list of content blocks", where
        )
    blocks: list[TextPart] = []
    for j, item in enumerate(cast(list[object], content)):
        at = f"{where}.{j}"
        if not isinstance(item, dict):
            raise ApiError("invalid_request", f"{at}: a content block must be an object", at)
        block = cast(dict[str, object], item)  # parsed JSON: string keys
        kind = block.get("type")
        if kind != "text":
            raise ApiError(
                "invalid_request",
                f"{at}: content blocks of type {kind!r} are not supported by this model; "
                "only 'text' blocks are",
                at,
            )
        text = block.get("text")
        if not isinstance(text, str):
            raise ApiError("invalid_request", f"{at}.text: must be a string", f"{at}.text")
        for key in block:
            if key not in TEXT_BLOCK_KEYS:
                raise ApiError(
                    "invalid_request",
                    f"{at}.{key}: field is not supported by this server",
                    f"{at}.{key}",
                )
        if block.get("citations") not in (None, []):
            raise ApiError(
                "invalid_request", f"{at}.citations: citations are not supported", f"{at}.citations"
            )
        blocks.append({"type": "text", "text": text})
    return blocks


def chat_of(body: CountTokensRequest) -> Chat:
    out: list[ChatMessage] = []
    if body.system is not None:
        system = _text_blocks(body.system, "system")
        if system:  # an empty system prompt is no system prompt
            out.append({"role": "system", "content": system})
    if not body.messages:
        raise ApiError("invalid_request", "messages: at least one message is required", "messages")
    for i, m in enumerate(body.messages):
        role = ROLES.get(str(m.get("role")))
        if role is None:
            raise ApiError(
                "invalid_request",
                f"messages.{i}.role: must be 'user' or 'assistant', not {m.get('role')!r}",
                f"messages.{i}.role",
            )
        for key in m:
            if key not in ("role", "content"):
                raise ApiError(
                    "invalid_request",
                    f"messages.{i}.{key}: field is not supported by this server",
                    f"messages.{i}.{key}",
                )
        if "content" not in m:
            raise ApiError(
                "invalid_request", f"messages.{i}.content: Field required", f"messages.{i}.content"
            )
        content = _text_blocks(m["content"], f"messages.{i}.content")
        out.append({"role": role, "content": content})
    # A final assistant turn is a prefill: the answer continues its text (and holds only what
    # follows it). As Anthropic's API, its text may not end with whitespace.
    prefill = body.messages[-1].get("role") == "assistant"
    final = _text_blocks(body.messages[-1]["content"], "messages")
    tail = final if isinstance(final, str) else "".join(b["text"] for b in final[-1:])
    if prefill and tail != tail.rstrip():
        at = f"messages.{len(body.messages) - 1}.content"
        raise ApiError(
            "invalid_request", f"{at}: final assistant content cannot end with trailing whitespace", at
        )
    if body.tools:
        raise ApiError(
            "invalid_request", "tools: tool use is not supported by this server", "tools"
        )
    if body.tool_choice is not None and body.tool_choice.get("type") not in ("auto", "none"):
        raise ApiError(
            "invalid_request",
            "tool_choice: tool use is not supported by this server",
            "tool_choice",
        )
    if body.thinking is not None and body.thinking.get("type") != "disabled":
        raise ApiError(
            "invalid_request",
            "thinking: extended thinking is not supported by this model",
            "thinking",
        )
    return Chat(tuple(out), continue_final=prefill)


def options_of(body: MessagesRequest) -> Options:
    options = Options(LIMITS)
    options.set("max_tokens", body.max_tokens)
    options.set("temperature", body.temperature)
    options.set("top_p", body.top_p)
    options.set("top_k", body.top_k)
    options.set("stop", body.stop_sequences, "stop_sequences")
    return options


# -- engine -> response --------------------------------------------------------------------------
def stop_of(last: Piece) -> tuple[StopReason, str | None]:
    if last.stop_sequence is not None:
        return "stop_sequence", last.stop_sequence
    if last.finish_reason == "length":
        return "max_tokens", None
    return "end_turn", None


def _usage(input_tokens: int, output_tokens: int) -> dict[str, int]:
    return {
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


def _message(
    mid: str,
    model_id: str,
    content: list[dict[str, Any]],
    stop: StopReason | None,
    stop_sequence: str | None,
    usage: dict[str, int],
) -> dict[str, Any]:
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model_id,
        "content": content,
        "stop_reason": stop,
        "stop_sequence": stop_sequence,
        "usage": usage,
    }


async def _count(state: ServerState, model_id: str, chat: Chat) -> int:
    return await state.with_model(model_id, lambda model: len(model.encode(chat)))


@router.post("/messages", response_model=None, responses=STREAMED)
async def messages(request: Request, body: MessagesRequest) -> JSONResponse | StreamingResponse:
    refuse_unknown(body, HARMLESS)
    state = state_of(request)
    model_id = state.manager.check_id(body.model)
    chat = chat_of(body)
    generation = options_of(body).generation(model_id, chat, "messages")
    mid = new_id("msg_")
    headers = {"request-id": new_id("req_")}
    if not body.stream:
        answer = await generation.run(request)
        stop, stop_sequence = stop_of(answer.last)
        return JSONResponse(
            _message(
                mid,
                model_id,
                [{"type": "text", "text": answer.text}],
                stop,
                stop_sequence,
                _usage(answer.usage.prompt_tokens, answer.usage.completion_tokens),
            ),
            headers=headers,
        )

    stream = await generation.stream(request)
    first = stream.first
    if first is None:
        raise ApiError("internal", "generation produced no output")
    input_tokens = first.usage.prompt_tokens if first.usage else await _count(state, model_id, chat)

    async def events() -> AsyncIterator[str]:
        yield sse(
            {
                "type": "message_start",
                "message": _message(mid, model_id, [], None, None, _usage(input_tokens, 0)),
            },
            "message_start",
        )
        yield sse(
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            },
            "content_block_start",
        )
        yield sse({"type": "ping"}, "ping")
        try:
            async for piece in stream:
                if piece.text:
                    yield sse(
                        {
                            "type": "content_block_delta",
                            "index": 0,
                            "delta": {"type": "text_delta", "text": piece.text},
                        },
                        "content_block_delta",
                    )
                if piece.finish_reason is not None:
                    assert piece.usage is not None
                    stop, stop_sequence = stop_of(piece)
                    yield sse({"type": "content_block_stop", "index": 0}, "content_block_stop")
                    yield sse(
                        {
                            "type": "message_delta",
                            "delta": {"stop_reason": stop, "stop_sequence": stop_sequence},
                            "usage": _usage(
                                piece.usage.prompt_tokens, piece.usage.completion_tokens
                            ),
                        },
                        "message_delta",
                    )
                    yield sse({"type": "message_stop"}, "message_stop")
                    return
            yield sse(
                error_body("anthropic", ApiError("internal", "generation ended without a finish")),
                "error",
            )
        except Exception as e:  # never leave a client hanging on a broken stream
            yield sse(error_body("anthropic", stream.error(e)), "error")
        finally:
            await stream.aclose()

    return StreamingResponse(
        events(), media_type="text/event-stream", headers={**headers, "cache-control": "no-cache"}
    )


@router.post("/messages/count_tokens")
async def count_tokens(request: Request, body: CountTokensRequest) -> dict[str, int]:
    refuse_unknown(body, HARMLESS)
    state = state_of(request)
    model_id = state.manager.check_id(body.model)
    return {"input_tokens": await _count(state, model_id, chat_of(body))}


# -- models --------------------------------------------------------------------------------------
def _model_info(model_id: str) -> dict[str, Any]:
    return {"type": "model", "id": model_id, "display_name": model_id, "created_at": EPOCH}


@router.get("/models")
async def list_models(
    request: Request,
    limit: int = Query(20, json_schema_extra={"minimum": 1, "maximum": 1000}),
    after_id: str | None = None,
    before_id: str | None = None,
) -> dict[str, Any]:
    """A page of the models (`after_id` / `before_id`: a listed model's id; empty: no cursor)."""
    if not 1 <= limit <= 1000:
        raise ApiError("invalid_request", "limit: must be between 1 and 1000", "limit")
    ids = model_ids(state_of(request))
    after_id, before_id = after_id or None, before_id or None
    for name, cursor in (("after_id", after_id), ("before_id", before_id)):
        if cursor is not None and cursor not in ids:
            raise ApiError("invalid_request", f"{name}: no model {cursor!r} to page from", name)
    if after_id is not None:
        rest = ids[ids.index(after_id) + 1 :]
        page, has_more = rest[:limit], len(rest) > limit
    elif before_id is not None:
        rest = ids[: ids.index(before_id)]
        page, has_more = rest[-limit:], len(rest) > limit
    else:
        page, has_more = ids[:limit], len(ids) > limit
    return {
        "data": [_model_info(i) for i in page],
        "has_more": has_more,
        "first_id": page[0] if page else None,
        "last_id": page[-1] if page else None,
    }


@router.get("/models/{model_id:path}")
async def get_model(request: Request, model_id: str) -> dict[str, Any]:
    state = state_of(request)
    ids = model_ids(state)
    canonical = model_id.lower() if model_id.lower() == state.manager.default_id else model_id
    if canonical not in ids:
        raise ApiError("not_found", f"model: {model_id}", "model")
    return _model_info(canonical)
