"""OpenAI chat completions: POST /chat/completions."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field, StrictBool, StrictInt, StrictStr

from mlx_omnia import Chat, ChatMessage, Piece, TokenLogprob
from mlx_omnia.server.dialects.common import STREAMED, new_id, text_part
from mlx_omnia.server.dialects.generation import Options, documented, run_all, stream_all
from mlx_omnia.server.dialects.openai.shared import (
    HARMLESS,
    LIMITS,
    Reply,
    Sampling,
    accepted,
    events,
    logprob_entry,
    parts_of,
    refuse_part,
    refuse_tools,
    role_of,
    sampling_options,
    usage_of,
)
from mlx_omnia.server.errors import ApiError

router = APIRouter()


MESSAGE: dict[str, Any] = {
    "type": "object",
    "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant"]},
        "content": {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": text_part(["text"])},
                {"type": "null"},
            ]
        },
        "name": {"type": "string"},
    },
    "required": ["role"],
}


class ChatCompletionRequest(Sampling):
    messages: list[dict[str, Any]] = Field(json_schema_extra={"minItems": 1, "items": MESSAGE})
    max_completion_tokens: StrictInt | None = Field(
        None, json_schema_extra=documented("max_tokens", LIMITS)
    )
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(None, json_schema_extra=documented("logprobs", LIMITS))
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    modalities: list[StrictStr] | None = None


def chat_logprobs(entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """A chat choice's `logprobs`: one entry a generated token (OpenAI's ChoiceLogprobs)."""
    return {"content": [logprob_entry(e) for e in entries], "refusal": None}


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts: list[str] = []
    for j, part in enumerate(parts_of(content, where)):
        text = part.get("text") if part is not None and part.get("type") == "text" else None
        if not isinstance(text, str):
            raise refuse_part(part, f"{where}[{j}]", "text parts")
        texts.append(text)
    return "\n".join(texts)


ROLES: dict[str, Literal["system", "user", "assistant", "tool"]] = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}


def chat_of(messages: list[dict[str, Any]]) -> Chat:
    if not messages:
        raise ApiError("invalid_request", "messages must not be empty", "messages")
    out: list[ChatMessage] = []
    for i, m in enumerate(messages):
        role = role_of(ROLES, m, f"messages[{i}]")
        if m.get("tool_calls") or m.get("function_call") or role == "tool":
            raise ApiError("invalid_request", "tool calls are not supported yet", f"messages[{i}]")
        if m.get("audio"):
            raise ApiError(
                "invalid_request", "audio is not supported by this model", f"messages[{i}].audio"
            )
        out.append({"role": role, "content": _text(m.get("content"), f"messages[{i}].content")})
    return Chat(tuple(out))


def options_of(body: ChatCompletionRequest) -> Options:
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError("invalid_request", "top_logprobs needs logprobs set to true", "top_logprobs")
    refuse_tools(body.tools, body.tool_choice)
    if body.response_format and body.response_format.get("type") not in (None, "text"):
        raise ApiError(
            "invalid_request", "only response_format type 'text' is supported", "response_format"
        )
    if body.modalities is not None and body.modalities != ["text"]:
        raise ApiError("invalid_request", "only the text modality is supported", "modalities")
    options = sampling_options(body, LIMITS)
    if body.max_completion_tokens is not None:
        options.set("max_tokens", body.max_completion_tokens, "max_completion_tokens")
    else:
        options.set("max_tokens", body.max_tokens)
    if body.logprobs:
        options.set("logprobs", body.top_logprobs or 0, "top_logprobs")
    return options


@router.post("/chat/completions", response_model=None, responses=STREAMED)
async def chat_completions(
    request: Request, body: ChatCompletionRequest
) -> JSONResponse | StreamingResponse:
    model_id = accepted(request, body, body.model, HARMLESS)
    generation = options_of(body).generation(model_id, chat_of(body.messages), "messages")
    reply = Reply(new_id("chatcmpl-"), model_id)
    n = body.n or 1
    if not body.stream:
        answers = await run_all(request, generation, n)
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": answer.text, "refusal": None},
                "finish_reason": answer.last.finish_reason,
                "logprobs": chat_logprobs(answer.logprobs) if body.logprobs else None,
            }
            for i, answer in enumerate(answers)
        ]
        out = reply.of("chat.completion", choices)
        return JSONResponse({**out, "usage": usage_of(*(a.usage for a in answers))})
    streams = await stream_all(request, generation, n)

    def chunk(
        index: int, delta: dict[str, Any], finish: str | None = None,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        return reply(
            "chat.completion.chunk", index=index, delta=delta, finish_reason=finish,
            logprobs=logprobs,
        )

    def chunk_of(piece: Piece, index: int, _: int) -> dict[str, Any]:
        probs = chat_logprobs(piece.logprobs) if body.logprobs else None
        return chunk(index, {"content": piece.text}, logprobs=probs)

    return events(
        streams, chunk_of, lambda i, finish: chunk(i, {}, finish), body.stream_options,
        lambda i: chunk(i, {"role": "assistant", "content": ""}),
    )
