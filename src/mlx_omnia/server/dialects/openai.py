"""OpenAI dialect, under /api/openai/v1: chat completions, legacy completions, responses, models."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Literal, cast

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, StrictBool, StrictFloat, StrictInt, StrictStr

from mlx_omnia import Bounds, Chat, ChatMessage, Piece, TokenLogprob
from mlx_omnia.server.dialects.common import Request as Body
from mlx_omnia.server.dialects.common import new_id, now, refuse_unknown, sse
from mlx_omnia.server.dialects.errors import error_body
from mlx_omnia.server.dialects.generation import Options
from mlx_omnia.server.errors import ApiError
from mlx_omnia.server.state import ServerState, state_of

router = APIRouter()

# Fields accepted and ignored because they cannot change the output.
HARMLESS = (
    "user",
    "metadata",
    "store",
    "service_tier",
    "parallel_tool_calls",
    "prompt_cache_key",
    "prompt_cache_retention",
    "safety_identifier",
)
RESPONSES_HARMLESS = (*HARMLESS, "stream_options", "max_tool_calls", "background_options")

# Legacy completions answer at most this many tokens when max_tokens is not given (as OpenAI's do).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# OpenAI's own bounds, tighter than the engine's (logprobs: alternatives a token, chat's
# top_logprobs; legacy completions take 5 at most).
LIMITS = {
    "max_tokens": Bounds(ge=1),
    "temperature": Bounds(le=2.0),
    "presence_penalty": Bounds(ge=-2.0, le=2.0),
    "frequency_penalty": Bounds(ge=-2.0, le=2.0),
    "logit_bias": Bounds(ge=-100.0, le=100.0),
    "stop": Bounds(max_items=4, nonempty=True),
    "logprobs": Bounds(le=20),
}
COMPLETIONS_LIMITS = {**LIMITS, "logprobs": Bounds(le=5)}


def _refuse_unknown(body: BaseModel, harmless: tuple[str, ...]) -> None:
    """Unknown fields sent as null cannot change the output; any other one is refused by name."""
    nulls = tuple(name for name, value in (body.model_extra or {}).items() if value is None)
    refuse_unknown(body, (*harmless, *nulls))


class StreamOptions(BaseModel):
    include_usage: StrictBool | None = False
    include_obfuscation: StrictBool | None = None  # harmless: only pads stream events


class Sampling(Body):
    """Fields shared by chat and legacy completions."""

    model: StrictStr
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    logit_bias: dict[str, StrictFloat] | None = None
    n: StrictInt | None = None


class ChatCompletionRequest(Sampling):
    messages: list[dict[str, Any]]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    modalities: list[StrictStr] | None = None


class CompletionRequest(Sampling):
    prompt: StrictStr | list[Any]
    echo: StrictBool | None = None
    suffix: StrictStr | None = None
    logprobs: StrictInt | None = None
    best_of: StrictInt | None = None


class ResponsesRequest(Body):
    model: StrictStr | None = None
    input: StrictStr | list[Any]
    instructions: StrictStr | None = None
    max_output_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    stream: StrictBool | None = False
    tools: list[Any] | None = None
    tool_choice: Any = None
    previous_response_id: StrictStr | None = None
    conversation: Any = None
    prompt: Any = None
    include: list[Any] | None = None
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    truncation: StrictStr | None = None
    background: StrictBool | None = None
    top_logprobs: StrictInt | None = None


# -- options shared by the routes ------------------------------------------------------------
def _sampling_options(body: Sampling, limits: dict[str, Bounds]) -> Options:
    if body.n not in (None, 1):
        raise ApiError("invalid_request", "only n=1 is supported", "n")
    if body.stream_options is not None and not body.stream:
        raise ApiError(
            "invalid_request",
            "stream_options is only allowed when stream is true",
            "stream_options",
        )
    bias: dict[int, float] = {}
    for key, value in (body.logit_bias or {}).items():
        if not key.isdigit():
            raise ApiError(
                "invalid_request", f"logit_bias key {key!r} is not a token id", "logit_bias"
            )
        bias[int(key)] = value
    options = Options(limits)
    options.set("temperature", body.temperature)
    options.set("top_p", body.top_p)
    options.set("stop", [body.stop] if isinstance(body.stop, str) else body.stop)
    options.set("seed", body.seed)
    options.set("presence_penalty", body.presence_penalty)
    options.set("frequency_penalty", body.frequency_penalty)
    options.set("logit_bias", bias)
    return options


def token_text(raw: bytes) -> str:
    """A token's text for a logprobs entry: its bytes as UTF-8, a byte of a character split
    across tokens written as \\xNN (the entry's `bytes` has them all)."""
    return raw.decode("utf-8", errors="backslashreplace")


def _chat_logprob(entry: TokenLogprob) -> dict[str, Any]:
    return {
        "token": token_text(entry.token_bytes),
        "logprob": entry.logprob,
        "bytes": list(entry.token_bytes),
        "top_logprobs": [
            {"token": token_text(t.token_bytes), "logprob": t.logprob, "bytes": list(t.token_bytes)}
            for t in entry.top
        ],
    }


def chat_logprobs(entries: list[TokenLogprob] | tuple[TokenLogprob, ...]) -> dict[str, Any]:
    """A chat choice's `logprobs`: one entry a generated token (OpenAI's ChoiceLogprobs)."""
    return {"content": [_chat_logprob(e) for e in entries], "refusal": None}


def completion_logprobs(entries: tuple[TokenLogprob, ...], offset: int) -> dict[str, Any]:
    """A legacy completion choice's `logprobs`; `offset`: characters of the completion's text
    before these tokens (text_offset counts from the completion's start)."""
    tokens: list[str] = []
    offsets: list[int] = []
    text = b""
    for e in entries:
        offsets.append(offset + len(text.decode("utf-8", errors="ignore")))
        tokens.append(token_text(e.token_bytes))
        text += e.token_bytes
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{token_text(t.token_bytes): t.logprob for t in e.top} for e in entries],
        "text_offset": offsets,
    }


def _usage(prompt: int, completion: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }


# -- chat completions ------------------------------------------------------------------------
def _as_dict(value: object) -> dict[str, Any] | None:
    return cast("dict[str, Any]", value) if isinstance(value, dict) else None


def _parts(content: object, where: str) -> list[dict[str, Any] | None]:
    if not isinstance(content, list):
        raise ApiError(
            "invalid_request", f"{where} must be a string or a list of content parts", where
        )
    return [_as_dict(part) for part in cast("list[object]", content)]


def _refuse_part(part: dict[str, Any] | None, where: str, allowed: str) -> ApiError:
    kind = part.get("type") if part is not None else None
    return ApiError(
        "invalid_request",
        f"{where}: content part {kind!r} is not supported by this model ({allowed} only)",
        where,
    )


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts: list[str] = []
    for j, part in enumerate(_parts(content, where)):
        text = part.get("text") if part is not None and part.get("type") == "text" else None
        if not isinstance(text, str):
            raise _refuse_part(part, f"{where}[{j}]", "text parts")
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
        role = ROLES.get(str(m.get("role")))
        if role is None:
            raise ApiError(
                "invalid_request",
                f"messages[{i}].role {m.get('role')!r} is not valid",
                f"messages[{i}].role",
            )
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
    if body.tools:
        raise ApiError("invalid_request", "tools are not supported yet", "tools")
    if body.tool_choice not in (None, "none", "auto"):
        raise ApiError(
            "invalid_request", "tool_choice needs tools, which are not supported yet", "tool_choice"
        )
    if body.response_format and body.response_format.get("type") not in (None, "text"):
        raise ApiError(
            "invalid_request", "only response_format type 'text' is supported", "response_format"
        )
    if body.modalities is not None and body.modalities != ["text"]:
        raise ApiError("invalid_request", "only the text modality is supported", "modalities")
    options = _sampling_options(body, LIMITS)
    if body.max_completion_tokens is not None:
        options.set("max_tokens", body.max_completion_tokens, "max_completion_tokens")
    else:
        options.set("max_tokens", body.max_tokens)
    if body.logprobs:
        options.set("logprobs", body.top_logprobs or 0, "top_logprobs")
    return options


@router.post("/chat/completions", response_model=None)
async def chat_completions(
    request: Request, body: ChatCompletionRequest
) -> JSONResponse | StreamingResponse:
    _refuse_unknown(body, HARMLESS)
    state = state_of(request)
    model_id = state.manager.check_id(body.model)
    generation = options_of(body).generation(model_id, chat_of(body.messages), "messages")
    cid, created = new_id("chatcmpl-"), now()
    if not body.stream:
        pieces = await generation.run(state)
        last = pieces[-1]
        usage = last.usage
        assert usage is not None
        return JSONResponse(
            {
                "id": cid,
                "object": "chat.completion",
                "created": created,
                "model": model_id,
                "choices": [
                    {
                        "index": 0,
                        "message": {
                            "role": "assistant",
                            "content": "".join(p.text for p in pieces),
                            "refusal": None,
                        },
                        "finish_reason": last.finish_reason,
                        "logprobs": (
                            chat_logprobs([e for p in pieces for e in p.logprobs])
                            if body.logprobs
                            else None
                        ),
                    }
                ],
                "usage": _usage(usage.prompt_tokens, usage.completion_tokens),
            }
        )
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    stream = await generation.stream(state)

    def chunk(
        delta: dict[str, Any], finish: str | None, logprobs: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        return {
            "id": cid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model_id,
            "choices": [
                {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
            ],
        }

    async def events() -> AsyncIterator[str]:
        yield sse(chunk({"role": "assistant", "content": ""}, None))
        try:
            async for piece in stream:
                if piece.text or piece.logprobs:
                    probs = chat_logprobs(piece.logprobs) if body.logprobs else None
                    yield sse(chunk({"content": piece.text}, None, probs))
                if piece.finish_reason is not None:
                    yield sse(chunk({}, piece.finish_reason))
                    if include_usage and piece.usage is not None:
                        yield sse(
                            {
                                "id": cid,
                                "object": "chat.completion.chunk",
                                "created": created,
                                "model": model_id,
                                "choices": [],
                                "usage": _usage(
                                    piece.usage.prompt_tokens, piece.usage.completion_tokens
                                ),
                            }
                        )
        except Exception as e:
            yield sse(error_body("openai", stream.error(e)))
        finally:
            await stream.aclose()
        yield sse("[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream")


# -- legacy completions ----------------------------------------------------------------------
def _prompt_of(prompt: str | list[Any]) -> str:
    if isinstance(prompt, str):
        return prompt
    if len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    if len(prompt) != 1:
        raise ApiError(
            "invalid_request", "prompt must be a string or a list of exactly one string", "prompt"
        )
    raise ApiError("invalid_request", "prompt as token ids is not supported; send text", "prompt")


def _completion_options(body: CompletionRequest) -> Options:
    if body.echo:
        raise ApiError("invalid_request", "echo=true is not supported", "echo")
    if body.suffix is not None:
        raise ApiError("invalid_request", "suffix is not supported", "suffix")
    if body.best_of not in (None, 1):
        raise ApiError("invalid_request", "only best_of=1 is supported", "best_of")
    options = _sampling_options(body, COMPLETIONS_LIMITS)
    max_tokens = body.max_tokens if body.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
    options.set("max_tokens", max_tokens)
    options.set("logprobs", body.logprobs)
    return options


@router.post("/completions", response_model=None)
async def completions(
    request: Request, body: CompletionRequest
) -> JSONResponse | StreamingResponse:
    _refuse_unknown(body, HARMLESS)
    state = state_of(request)
    model_id = state.manager.check_id(body.model)
    generation = _completion_options(body).generation(model_id, _prompt_of(body.prompt), "prompt")
    cid, created = new_id("cmpl-"), now()

    def completion(
        text: str, finish: str | None, logprobs: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        return {
            "id": cid,
            "object": "text_completion",
            "created": created,
            "model": model_id,
            "choices": [
                {"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish}
            ],
        }

    wants = body.logprobs is not None
    if not body.stream:
        pieces = await generation.run(state)
        last = pieces[-1]
        assert last.usage is not None
        entries = tuple(e for p in pieces for e in p.logprobs)
        probs = completion_logprobs(entries, 0) if wants else None
        out = completion("".join(p.text for p in pieces), last.finish_reason, probs)
        out["usage"] = _usage(last.usage.prompt_tokens, last.usage.completion_tokens)
        return JSONResponse(out)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    stream = await generation.stream(state)

    async def events() -> AsyncIterator[str]:
        sent = 0  # characters of text so far (text_offset)
        try:
            async for piece in stream:
                if piece.text or piece.logprobs:
                    probs = completion_logprobs(piece.logprobs, sent) if wants else None
                    yield sse(completion(piece.text, None, probs))
                    sent += len(piece.text)
                if piece.finish_reason is not None:
                    yield sse(completion("", piece.finish_reason))
                    if include_usage and piece.usage is not None:
                        tail = completion("", None)
                        tail["choices"] = []
                        tail["usage"] = _usage(
                            piece.usage.prompt_tokens, piece.usage.completion_tokens
                        )
                        yield sse(tail)
        except Exception as e:
            yield sse(error_body("openai", stream.error(e)))
        finally:
            await stream.aclose()
        yield sse("[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream")


# -- responses -------------------------------------------------------------------------------
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
    for j, part in enumerate(_parts(content, where)):
        kind = part.get("type") if part is not None else None
        text = part.get("refusal" if kind == "refusal" else "text") if part is not None else None
        if kind not in allowed or not isinstance(text, str):
            raise _refuse_part(part, f"{where}[{j}]", " or ".join(allowed))
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
        item = _as_dict(raw)
        if item is None:
            raise ApiError("invalid_request", f"{where} must be an object", where)
        kind = item.get("type", "message")
        if kind != "message":
            raise ApiError(
                "invalid_request",
                f"{where}: item type {kind!r} is not supported (messages only)",
                where,
            )
        role = RESPONSE_ROLES.get(str(item.get("role")))
        if role is None:
            raise ApiError(
                "invalid_request",
                f"{where}.role {item.get('role')!r} is not valid",
                f"{where}.role",
            )
        messages.append(
            {"role": role, "content": _item_text(item.get("content"), role, f"{where}.content")}
        )
    return Chat(tuple(messages))


def _responses_options(body: ResponsesRequest) -> Options:
    if body.tools:
        raise ApiError("invalid_request", "tools are not supported yet", "tools")
    if body.tool_choice not in (None, "none", "auto"):
        raise ApiError(
            "invalid_request", "tool_choice needs tools, which are not supported yet", "tool_choice"
        )
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
    if body.include:
        raise ApiError("invalid_request", "include is not supported", "include")
    if body.reasoning and any(v is not None for v in body.reasoning.values()):
        raise ApiError(
            "invalid_request", "reasoning options are not supported by this model", "reasoning"
        )
    if body.text:
        fmt = body.text.get("format")
        if fmt is not None and (_as_dict(fmt) or {}).get("type") != "text":
            raise ApiError(
                "invalid_request", "only text.format type 'text' is supported", "text.format"
            )
        if body.text.get("verbosity") is not None:
            raise ApiError("invalid_request", "text.verbosity is not supported", "text.verbosity")
        for key in body.text:
            if key not in ("format", "verbosity"):
                raise ApiError("invalid_request", f"text.{key} is not supported", f"text.{key}")
    if body.truncation not in (None, "disabled"):
        raise ApiError("invalid_request", "only truncation 'disabled' is supported", "truncation")
    if body.background:
        raise ApiError("invalid_request", "background responses are not supported", "background")
    if body.top_logprobs:
        raise ApiError("invalid_request", "logprobs are not supported yet", "top_logprobs")
    options = Options(LIMITS)
    options.set("max_tokens", body.max_output_tokens, "max_output_tokens")
    options.set("temperature", body.temperature)
    options.set("top_p", body.top_p)
    return options


class _ResponseShape:
    """Builds the Response object and its output message as generation goes."""

    def __init__(self, body: ResponsesRequest, model_id: str) -> None:
        self.body = body
        self.model_id = model_id
        self.id = new_id("resp_")
        self.item_id = new_id("msg_")
        self.created = now()

    def part(self, text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

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
            "text": {"format": {"type": "text"}},
            "tool_choice": "none",
            "tools": [],
            "top_p": b.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": getattr(b, "user", None),
            "metadata": getattr(b, "metadata", None) or {},
        }


@router.post("/responses", response_model=None)
async def responses(request: Request, body: ResponsesRequest) -> JSONResponse | StreamingResponse:
    _refuse_unknown(body, RESPONSES_HARMLESS)
    state = state_of(request)
    model_id = state.manager.check_id(body.model)
    generation = _responses_options(body).generation(model_id, _responses_chat(body), "input")
    shape = _ResponseShape(body, model_id)
    if not body.stream:
        pieces = await generation.run(state)
        last = pieces[-1]
        status = "incomplete" if last.finish_reason == "length" else "completed"
        text = "".join(p.text for p in pieces)
        return JSONResponse(shape.response(status, [shape.item(status, [shape.part(text)])], last))
    stream = await generation.stream(state)

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
        try:
            async for piece in stream:
                if piece.text:
                    texts.append(piece.text)
                    yield event(
                        "response.output_text.delta",
                        **where,
                        content_index=0,
                        delta=piece.text,
                        logprobs=[],
                    )
                if piece.finish_reason is None:
                    continue
                text = "".join(texts)
                status = "incomplete" if piece.finish_reason == "length" else "completed"
                item = shape.item(status, [shape.part(text)])
                yield event(
                    "response.output_text.done", **where, content_index=0, text=text, logprobs=[]
                )
                yield event(
                    "response.content_part.done", **where, content_index=0, part=shape.part(text)
                )
                yield event("response.output_item.done", output_index=0, item=item)
                yield event(f"response.{status}", response=shape.response(status, [item], piece))
        except Exception as e:
            err = stream.error(e)
            code = "model_not_found" if err.kind == "not_found" else err.kind
            yield event("error", code=code, message=err.message, param=err.param)
        finally:
            await stream.aclose()

    return StreamingResponse(events(), media_type="text/event-stream")


# -- models ----------------------------------------------------------------------------------
def _model_ids(state: ServerState) -> list[str]:
    ids = [
        state.manager.default_id,
        *[r.id for r in state.manager.resident()],
        *state.manager.aliases(),
    ]
    return list(dict.fromkeys(ids))


def _model(model_id: str) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "mlx-omnia"}


@router.get("/models")
async def list_models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [_model(i) for i in _model_ids(state_of(request))]}


@router.get("/models/{model_id:path}")
async def retrieve_model(request: Request, model_id: str) -> dict[str, Any]:
    state = state_of(request)
    canonical = state.manager.check_id(model_id)
    if canonical not in _model_ids(state):
        raise ApiError(
            "not_found", f"model {model_id!r} is not loaded or known to this server", "model"
        )
    return _model(canonical)
