"""OpenAI dialect, under /api/openai/v1."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel

from mlx_omnia import Chat, ChatMessage, GenerationOptions, OmniaError
from mlx_omnia.server.dialects.common import Request as Body
from mlx_omnia.server.dialects.common import new_id, now, refuse_unknown, sse
from mlx_omnia.server.dialects.errors import error_body, from_engine
from mlx_omnia.server.errors import ApiError
from mlx_omnia.server.state import state_of

router = APIRouter()

# Fields accepted and ignored because they cannot change the output.
HARMLESS = ("user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key",
            "safety_identifier")


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatCompletionRequest(Body):
    model: str
    messages: list[dict[str, Any]]
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    n: int | None = None
    logprobs: bool | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:  # pyright: ignore[reportUnknownVariableType]
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):  # pyright: ignore[reportUnknownMemberType]
                parts.append(part["text"])  # pyright: ignore[reportUnknownArgumentType]
            else:
                raise ApiError(
                    "invalid_request", f"{where}: only text content parts are supported by this model", where
                )
        return "\n".join(parts)
    raise ApiError("invalid_request", f"{where} must be a string or a list of text parts", where)


ROLES: dict[str, Literal["system", "user", "assistant", "tool"]] = {
    "system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool",
}


def chat_of(messages: list[dict[str, Any]]) -> Chat:
    if not messages:
        raise ApiError("invalid_request", "messages must not be empty", "messages")
    out: list[ChatMessage] = []
    for i, m in enumerate(messages):
        role = ROLES.get(str(m.get("role")))
        if role is None:
            raise ApiError("invalid_request", f"messages[{i}].role {m.get('role')!r} is not valid", f"messages[{i}].role")
        if m.get("tool_calls") or role == "tool":
            raise ApiError("invalid_request", "tool calls are not supported yet", f"messages[{i}]")
        out.append({"role": role, "content": _text(m.get("content"), f"messages[{i}].content")})
    return Chat(tuple(out))


def options_of(body: ChatCompletionRequest) -> GenerationOptions:
    if body.n not in (None, 1):
        raise ApiError("invalid_request", "only n=1 is supported", "n")
    if body.logprobs:
        raise ApiError("invalid_request", "logprobs are not supported yet", "logprobs")
    if body.tools:
        raise ApiError("invalid_request", "tools are not supported yet", "tools")
    if body.response_format and body.response_format.get("type") not in (None, "text"):
        raise ApiError("invalid_request", "only response_format type 'text' is supported", "response_format")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > 4:
        raise ApiError("invalid_request", "at most 4 stop sequences", "stop")
    bias: dict[int, float] = {}
    for key, value in (body.logit_bias or {}).items():
        if not key.lstrip("-").isdigit():
            raise ApiError("invalid_request", f"logit_bias key {key!r} is not a token id", "logit_bias")
        bias[int(key)] = max(-100.0, min(100.0, value))
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    return GenerationOptions(
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        stop=stop,
        seed=body.seed,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        logit_bias=bias,
    )


def _usage(prompt: int, completion: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


@router.post("/chat/completions", response_model=None)
async def chat_completions(request: Request, body: ChatCompletionRequest) -> JSONResponse | StreamingResponse:
    refuse_unknown(body, HARMLESS)
    state = state_of(request)
    model_id = state.manager.check_id(body.model)
    job = state.job(model_id, chat_of(body.messages), options_of(body))
    cid, created = new_id("chatcmpl-"), now()
    if not body.stream:
        pieces = await state.scheduler.run(job)
        last = pieces[-1]
        usage = last.usage
        assert usage is not None
        return JSONResponse({
            "id": cid, "object": "chat.completion", "created": created, "model": model_id,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": "".join(p.text for p in pieces), "refusal": None},
                "finish_reason": last.finish_reason, "logprobs": None,
            }],
            "usage": _usage(usage.prompt_tokens, usage.completion_tokens),
        })
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    stream = state.scheduler.stream(job)
    # Start now so that model and option errors answer with a status, not a broken stream.
    first = await _first(stream)

    async def events() -> AsyncIterator[str]:
        def chunk(delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
            return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model_id,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}

        yield sse(chunk({"role": "assistant", "content": ""}, None))
        piece = first
        try:
            while piece is not None:
                if piece.text:
                    yield sse(chunk({"content": piece.text}, None))
                if piece.finish_reason is not None:
                    yield sse(chunk({}, piece.finish_reason))
                    if include_usage and piece.usage is not None:
                        yield sse({"id": cid, "object": "chat.completion.chunk", "created": created,
                                   "model": model_id, "choices": [],
                                   "usage": _usage(piece.usage.prompt_tokens, piece.usage.completion_tokens)})
                piece = await anext(stream, None)
        except (ApiError, OmniaError) as e:
            err = e if isinstance(e, ApiError) else from_engine(e)
            yield sse(error_body("openai", err))
        finally:
            await stream.aclose()
        yield sse("[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream")


async def _first(stream: AsyncIterator[Any]) -> Any:
    try:
        return await anext(stream)
    except StopAsyncIteration:
        return None


@router.get("/models")
async def list_models(request: Request) -> dict[str, Any]:
    state = state_of(request)
    ids = [state.manager.default_id, *[r.id for r in state.manager.resident()], *state.manager.aliases()]
    seen: list[str] = []
    for i in ids:
        if i not in seen:
            seen.append(i)
    return {"object": "list", "data": [{"id": i, "object": "model", "created": 0, "owned_by": "mlx-omnia"} for i in seen]}
