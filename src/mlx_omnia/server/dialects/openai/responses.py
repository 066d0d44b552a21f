"""OpenAI responses: POST /responses (stateless: the whole conversation comes in `input`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field, StrictBool, StrictFloat, StrictInt, StrictStr

from mlx_omnia import Chat, ChatMessage, Piece, TokenLogprob
from mlx_omnia.server.dialects.common import STREAMED, new_id, now, sse, text_part
from mlx_omnia.server.dialects.common import Request as Body
from mlx_omnia.server.dialects.generation import Options, documented
from mlx_omnia.server.dialects.openai.shared import (
    HARMLESS,
    LIMITS,
    accepted,
    as_dict,
    format_schema,
    logprob_entry,
    output_format,
    parts_of,
    refuse_part,
    refuse_tools,
    role_of,
)
from mlx_omnia.server.errors import ApiError

router = APIRouter()

# (client_metadata: what the Codex CLI says of itself on every request.)
RESPONSES_HARMLESS = (
    *HARMLESS, "stream_options", "max_tool_calls", "background_options", "client_metadata"
)
# The one `include` value there is to honour: each output_text part's tokens' logprobs.
LOGPROBS = "message.output_text.logprobs"
# The others add what the answers here never hold (tool results, images, reasoning): accepted.
INCLUDABLE = (
    LOGPROBS,
    "reasoning.encrypted_content",
    "message.input_image.image_url",
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
)


INPUT_ITEM: dict[str, Any] = {
    "type": "object",
    "properties": {
        "type": {"const": "message"},
        "role": {"enum": ["system", "developer", "user", "assistant"]},
        "content": {
            "anyOf": [
                {"type": "string"},
                {
                    "type": "array",
                    "items": {
                        "anyOf": [
                            text_part(["input_text", "output_text"]),
                            {
                                "type": "object",
                                "properties": {
                                    "type": {"const": "refusal"}, "refusal": {"type": "string"}
                                },
                                "required": ["type", "refusal"],
                            },
                        ]
                    },
                },
            ]
        },
    },
    "required": ["role", "content"],
}


# `text`: the output format, and verbosity at OpenAI's default, medium, which is what every
# answer here is (low or high would ask the model for shorter or longer answers: refused).
TEXT: dict[str, Any] = {
    "properties": {
        "format": format_schema(flat=True),
        "verbosity": {"enum": ["medium", None]},
    },
    "additionalProperties": False,
}


class ResponsesRequest(Body):
    model: StrictStr | None = None
    input: StrictStr | list[Any] = Field(
        description="Text, or message items (input_text parts; output_text or refusal parts in "
        "an assistant's).",
        json_schema_extra={"minItems": 1, "items": INPUT_ITEM},
    )
    instructions: StrictStr | None = None
    max_output_tokens: StrictInt | None = Field(
        None, json_schema_extra=documented("max_tokens", LIMITS)
    )
    temperature: StrictFloat | None = Field(
        None, json_schema_extra=documented("temperature", LIMITS)
    )
    top_p: StrictFloat | None = Field(None, json_schema_extra=documented("top_p", LIMITS))
    stream: StrictBool | None = False
    tools: list[Any] | None = None
    tool_choice: Any = None
    previous_response_id: StrictStr | None = None
    conversation: Any = None
    prompt: Any = None
    include: list[Any] | None = Field(
        None, json_schema_extra={"items": {"enum": list(INCLUDABLE)}}
    )
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = Field(None, json_schema_extra=TEXT)
    truncation: StrictStr | None = Field(None, json_schema_extra={"enum": ["disabled", None]})
    background: StrictBool | None = Field(None, json_schema_extra={"not": {"const": True}})
    top_logprobs: StrictInt | None = Field(None, json_schema_extra=documented("logprobs", LIMITS))


RESPONSE_ROLES: dict[str, Literal["system", "user", "assistant"]] = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
}


def _item_text(content: Any, role: str, where: str) -> str:
    if isinstance(content, str):
        return content
    allowed = ("output_text", "refusal") if role == "assistant" else ("input_text",)
    texts: list[str] = []
    for j, part in enumerate(parts_of(content, where)):
        kind = part.get("type") if part is not None else None
        text = part.get("refusal" if kind == "refusal" else "text") if part is not None else None
        if kind not in allowed or not isinstance(text, str):
            raise refuse_part(part, f"{where}[{j}]", " or ".join(allowed))
        texts.append(text)
    return "\n".join(texts)


def _responses_chat(body: ResponsesRequest) -> Chat:
    messages: list[ChatMessage] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        messages.append({"role": "user", "content": body.input})
        return Chat(tuple(messages))
    if not body.input:
        raise ApiError("invalid_request", "input must not be empty", "input")
    for i, raw in enumerate(body.input):
        where = f"input[{i}]"
        item = as_dict(raw)
        if item is None:
            raise ApiError("invalid_request", f"{where} must be an object", where)
        kind = item.get("type", "message")
        if kind != "message":
            raise ApiError(
                "invalid_request",
                f"{where}: item type {kind!r} is not supported (messages only)",
                where,
            )
        role = role_of(RESPONSE_ROLES, item, where)
        messages.append(
            {"role": role, "content": _item_text(item.get("content"), role, f"{where}.content")}
        )
    return Chat(tuple(messages))


def _responses_options(body: ResponsesRequest) -> Options:
    refuse_tools(body.tools, body.tool_choice)
    if body.previous_response_id is not None:
        raise ApiError(
            "invalid_request",
            "previous_response_id is not supported: this server stores no responses; send the "
            "whole conversation in input",
            "previous_response_id",
        )
    if body.conversation is not None:
        raise ApiError(
            "invalid_request",
            "conversations are not supported: send the whole conversation in input",
            "conversation",
        )
    if body.prompt is not None:
        raise ApiError("invalid_request", "stored prompts are not supported", "prompt")
    for i, what in enumerate(body.include or []):
        if what not in INCLUDABLE:
            raise ApiError("invalid_request", f"include {what!r} is not valid", f"include[{i}]")
    if body.reasoning and any(v is not None for v in body.reasoning.values()):
        raise ApiError(
            "invalid_request", "reasoning options are not supported by this model", "reasoning"
        )
    if body.truncation not in (None, "disabled"):
        raise ApiError("invalid_request", "only truncation 'disabled' is supported", "truncation")
    if body.background:
        raise ApiError("invalid_request", "background responses are not supported", "background")
    options = Options(LIMITS)
    if wants_logprobs(body):
        options.set("logprobs", body.top_logprobs or 0, "top_logprobs")
    options.set("max_tokens", body.max_output_tokens, "max_output_tokens")
    options.set("temperature", body.temperature)
    options.set("top_p", body.top_p)
    text = body.text or {}
    for key in text:
        if key not in ("format", "verbosity"):
            raise ApiError("invalid_request", f"text.{key} is not supported", f"text.{key}")
    if text.get("verbosity") not in (None, "medium"):
        raise ApiError(
            "invalid_request",
            "only text.verbosity 'medium' is supported (the model is not told to be shorter or "
            "longer)",
            "text.verbosity",
        )
    if text.get("format") is not None:
        output_format(text["format"], "text.format", options, flat=True)
    return options


def wants_logprobs(body: ResponsesRequest) -> bool:
    """Logprobs come with the output text when `include` asks for them or top_logprobs is set."""
    return LOGPROBS in (body.include or []) or body.top_logprobs is not None


class _ResponseShape:
    """Builds the Response object and its output message as generation goes."""

    def __init__(self, body: ResponsesRequest, model_id: str) -> None:
        self.body = body
        self.model_id = model_id
        self.id = new_id("resp_")
        self.item_id = new_id("msg_")
        self.created = now()

    def part(self, text: str, logprobs: Sequence[TokenLogprob] = ()) -> dict[str, Any]:
        entries = [logprob_entry(e) for e in logprobs]
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": entries}

    def item(self, status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.item_id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": content,
        }

    def response(
        self, status: str, output: list[dict[str, Any]], piece: Piece | None = None
    ) -> dict[str, Any]:
        b = self.body
        usage = None
        incomplete = None
        completed_at = None
        if piece is not None and piece.usage is not None:
            u = piece.usage
            usage = {
                "input_tokens": u.prompt_tokens,
                "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens": u.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": u.prompt_tokens + u.completion_tokens,
            }
            if piece.finish_reason == "length":
                incomplete = {"reason": "max_output_tokens"}
            else:
                completed_at = now()
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "completed_at": completed_at,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "model": self.model_id,
            "output": output,
            "parallel_tool_calls": False,
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "store": False,
            "temperature": b.temperature,
            "text": {
                "format": (b.text or {}).get("format") or {"type": "text"}, "verbosity": "medium"
            },
            "tool_choice": "none",
            "tools": [],
            "top_logprobs": b.top_logprobs,
            "top_p": b.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": getattr(b, "user", None),
            "metadata": getattr(b, "metadata", None) or {},
        }


@router.post("/responses", response_model=None, responses=STREAMED)
async def responses(request: Request, body: ResponsesRequest) -> JSONResponse | StreamingResponse:
    model_id = accepted(request, body, body.model, RESPONSES_HARMLESS)
    generation = _responses_options(body).generation(model_id, _responses_chat(body), "input")
    shape = _ResponseShape(body, model_id)
    if not body.stream:
        answer = await generation.run(request)
        status = "incomplete" if answer.last.finish_reason == "length" else "completed"
        item = shape.item(status, [shape.part(answer.text, answer.logprobs)])
        return JSONResponse(shape.response(status, [item], answer.last))
    stream = await generation.stream(request)

    async def events() -> AsyncIterator[str]:
        seq = 0

        def event(kind: str, **fields: Any) -> str:
            nonlocal seq
            out = sse({"type": kind, "sequence_number": seq, **fields}, event=kind)
            seq += 1
            return out

        where = {"item_id": shape.item_id, "output_index": 0}
        yield event("response.created", response=shape.response("in_progress", []))
        yield event("response.in_progress", response=shape.response("in_progress", []))
        yield event(
            "response.output_item.added", output_index=0, item=shape.item("in_progress", [])
        )
        yield event("response.content_part.added", **where, content_index=0, part=shape.part(""))
        texts: list[str] = []
        logprobs: list[TokenLogprob] = []
        try:
            async for piece in stream:
                if piece.text or piece.logprobs:
                    texts.append(piece.text)
                    logprobs += piece.logprobs
                    yield event(
                        "response.output_text.delta",
                        **where,
                        content_index=0,
                        delta=piece.text,
                        logprobs=[logprob_entry(e) for e in piece.logprobs],
                    )
                if piece.finish_reason is None:
                    continue
                text = "".join(texts)
                status = "incomplete" if piece.finish_reason == "length" else "completed"
                part = shape.part(text, logprobs)
                item = shape.item(status, [part])
                yield event(
                    "response.output_text.done", **where, content_index=0, text=text,
                    logprobs=part["logprobs"],
                )
                yield event("response.content_part.done", **where, content_index=0, part=part)
                yield event("response.output_item.done", output_index=0, item=item)
                yield event(f"response.{status}", response=shape.response(status, [item], piece))
        except Exception as e:
            err = stream.error(e)
            code = "model_not_found" if err.kind == "not_found" else err.kind
            yield event("error", code=code, message=err.message, param=err.param)
        finally:
            await stream.aclose()

    return StreamingResponse(events(), media_type="text/event-stream")
