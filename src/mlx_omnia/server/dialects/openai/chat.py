"""OpenAI chat completions: POST /chat/completions."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field, StrictBool, StrictInt, StrictStr

from mlx_omnia import Chat, ChatMessage, Piece, TokenLogprob, ToolCallDelta
from mlx_omnia.server.dialects.common import STREAMED, new_id, text_part
from mlx_omnia.server.dialects.fields import CHAT
from mlx_omnia.server.dialects.generation import (
    Answer,
    Options,
    documented,
    run_all,
    stream_all,
)
from mlx_omnia.server.dialects.openai.shared import (
    EFFORTS,
    LIMITS,
    Reply,
    Sampling,
    accepted,
    as_dict,
    events,
    format_schema,
    logprob_entry,
    output_format,
    parts_of,
    refuse_part,
    role_of,
    sampling_options,
    thinking_of,
    usage_of,
)
from mlx_omnia.server.dialects.tools import CallIds, declared, function_tool, unique
from mlx_omnia.server.errors import ApiError

ToolChoice = Literal["auto", "none", "required"]

router = APIRouter()


_REFUSAL_PART: dict[str, Any] = {
    "type": "object",
    "properties": {"type": {"const": "refusal"}, "refusal": {"type": "string"}},
    "required": ["type", "refusal"],
}
_TOOL_CALL: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {},
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}},
            "required": ["name", "arguments"],
        },
    },
    "required": ["function"],
}
# A message: system, developer, user, assistant (with its tool_calls and reasoning_content)
# or tool (with the tool_call_id it answers).
MESSAGE: dict[str, Any] = {
    "type": "object",
    "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"anyOf": [text_part(["text"]), _REFUSAL_PART]}},
                {"type": "null"},
            ]
        },
        "name": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "tool_calls": {"anyOf": [{"type": "array", "items": _TOOL_CALL, "minItems": 1},
                                 {"type": "null"}]},
        "tool_call_id": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "reasoning_content": {"anyOf": [{"type": "string"}, {"type": "null"}]},
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
    parallel_tool_calls: StrictBool | None = None
    reasoning_effort: StrictStr | None = Field(None, json_schema_extra={"enum": [*EFFORTS, None]})
    # vLLM's and SGLang's: variables for the chat template (Qwen3's enable_thinking, say).
    chat_template_kwargs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = Field(None, json_schema_extra=format_schema(flat=False))
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
        kind = part.get("type") if part is not None else None
        text = part.get(kind) if part is not None and kind in ("text", "refusal") else None
        if not isinstance(text, str):
            raise refuse_part(part, f"{where}[{j}]", "text and refusal parts")
        texts.append(text)
    return "\n".join(texts)


ROLES: dict[str, Literal["system", "user", "assistant", "tool"]] = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}


@dataclass(frozen=True)
class Tools:
    """A request's tools and how they may be called, in the engine's terms."""

    tools: tuple[dict[str, Any], ...] = ()
    choice: ToolChoice = "auto"
    allowed: tuple[str, ...] = ()
    parallel: bool = True


def _tool_calls(calls: object, where: str) -> list[dict[str, Any]]:
    """An assistant message's tool_calls, checked, in the engine's shape."""
    if not isinstance(calls, list) or not calls:
        raise ApiError("invalid_request", f"{where} must be a non-empty list", where)
    out: list[dict[str, Any]] = []
    for j, call in enumerate(cast(list[object], calls)):
        entry = as_dict(call)
        function = as_dict(entry.get("function")) if entry is not None else None
        if entry is None or function is None or entry.get("type", "function") != "function":
            raise ApiError(
                "invalid_request",
                f"{where}[{j}] must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}",
                f"{where}[{j}]",
            )
        name, args = function.get("name"), function.get("arguments")
        if not isinstance(name, str) or not isinstance(args, str):
            raise ApiError(
                "invalid_request",
                f"{where}[{j}].function needs a string name and string arguments",
                f"{where}[{j}].function",
            )
        out.append({
            "id": str(entry.get("id") or ""),
            "type": "function",
            "function": {"name": name, "arguments": args},
        })
    return out


def _optional_str(message: dict[str, Any], key: str, where: str) -> str | None:
    value = message.get(key)
    if value is not None and not isinstance(value, str):
        raise ApiError("invalid_request", f"{where}.{key} must be a string", f"{where}.{key}")
    return value


def chat_of(
    messages: list[dict[str, Any]], tools: Tools = Tools(), body: ChatCompletionRequest | None = None
) -> Chat:
    if not messages:
        raise ApiError("invalid_request", "messages must not be empty", "messages")
    out: list[ChatMessage] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if m.get("role") == "function" or m.get("function_call"):
            raise ApiError(
                "invalid_request",
                f"{where}: function_call and the function role are deprecated; use tool_calls "
                "and the tool role",
                where,
            )
        role = role_of(ROLES, m, where)
        if m.get("audio"):
            raise ApiError("invalid_request", "audio is not supported by this model", f"{where}.audio")
        message: ChatMessage = {"role": role, "content": _text(m.get("content"), f"{where}.content")}
        name = _optional_str(m, "name", where)
        if name:
            message["name"] = name  # a participant's name, for templates that show it
        if role == "assistant" and m.get("tool_calls") is not None:
            message["tool_calls"] = _tool_calls(m["tool_calls"], f"{where}.tool_calls")
        elif m.get("tool_calls") is not None:
            raise ApiError("invalid_request", f"{where}: only assistant messages have tool_calls", where)
        thought = _optional_str(m, "reasoning_content", where) or m.get("reasoning")
        if role == "assistant" and isinstance(thought, str) and thought:
            message["reasoning_content"] = thought  # as vLLM and DeepSeek's API take it back
        call_id = _optional_str(m, "tool_call_id", where)
        if role == "tool":
            if call_id is None:
                raise ApiError(
                    "invalid_request", f"{where}.tool_call_id is required for a tool message",
                    f"{where}.tool_call_id",
                )
            message["tool_call_id"] = call_id
        out.append(message)
    effort = body.reasoning_effort if body is not None else None
    return Chat(
        tuple(out), tools.tools, tools.choice, tools.allowed, tools.parallel,
        thinking=thinking_of(effort, "reasoning_effort"), reasoning_effort=effort,
        template_kwargs=(body.chat_template_kwargs or {}) if body is not None else {},
    )


def tools_of(body: ChatCompletionRequest) -> Tools:
    """`tools` (function tools), `tool_choice` (none, auto, required, a named function, or
    allowed_tools) and `parallel_tool_calls`, checked."""
    declared_tools: list[dict[str, Any]] = []
    for i, tool in enumerate(body.tools or []):
        where = f"tools[{i}]"
        function = as_dict(tool.get("function"))
        if tool.get("type") != "function" or function is None:
            raise ApiError(
                "invalid_request",
                f"{where}: only function tools are supported (type {tool.get('type')!r})",
                f"{where}.type",
            )
        declared_tools.append(function_tool(
            function.get("name"), function.get("description"), function.get("parameters"),
            f"{where}.function",
        ))
    tools = unique(declared_tools, "tools")
    parallel = body.parallel_tool_calls is not False
    choice = body.tool_choice
    if choice is None:
        return Tools(tools, "auto", (), parallel)
    if not tools and choice != "none":
        raise ApiError("invalid_request", "tool_choice needs tools", "tool_choice")
    if choice in ("none", "auto", "required"):
        return Tools(tools, choice, (), parallel)
    entry = as_dict(choice)
    if entry is not None and entry.get("type") == "function":
        function = as_dict(entry.get("function")) or {}
        name = declared(function.get("name"), tools, "tool_choice.function.name")
        return Tools(tools, "required", (name,), False)  # the named function, called once
    if entry is not None and entry.get("type") == "allowed_tools":
        allowed = as_dict(entry.get("allowed_tools")) or {}
        mode = allowed.get("mode")
        listed = allowed.get("tools")
        if mode not in ("auto", "required") or not isinstance(listed, list) or not listed:
            raise ApiError(
                "invalid_request",
                "tool_choice.allowed_tools needs mode 'auto' or 'required' and a list of tools",
                "tool_choice.allowed_tools",
            )
        names = tuple(
            declared((as_dict((as_dict(t) or {}).get("function")) or {}).get("name"), tools,
                     f"tool_choice.allowed_tools.tools[{j}]")
            for j, t in enumerate(cast(list[object], listed))
        )
        return Tools(
            tuple(t for t in tools if t["function"]["name"] in names), cast(ToolChoice, mode), (),
            parallel,
        )
    raise ApiError(
        "invalid_request",
        "tool_choice must be 'none', 'auto', 'required', a function or allowed_tools",
        "tool_choice",
    )


def options_of(body: ChatCompletionRequest) -> Options:
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError("invalid_request", "top_logprobs needs logprobs set to true", "top_logprobs")
    if body.modalities is not None and body.modalities != ["text"]:
        raise ApiError("invalid_request", "only the text modality is supported", "modalities")
    options = sampling_options(body, LIMITS)
    if body.max_completion_tokens is not None:
        options.set("max_tokens", body.max_completion_tokens, "max_completion_tokens")
    else:
        options.set("max_tokens", body.max_tokens)
    if body.logprobs:
        options.set("logprobs", body.top_logprobs or 0, "top_logprobs")
    if body.response_format is not None:
        output_format(body.response_format, "response_format", options, flat=False)
    return options


def _message(answer: Answer, call_id: Callable[[int], str]) -> dict[str, Any]:
    """A whole answer as an assistant message: its text (None when it is only calls) and calls."""
    message: dict[str, Any] = {"role": "assistant", "content": answer.text, "refusal": None}
    if answer.reasoning:
        message["reasoning_content"] = answer.reasoning
    if answer.tool_calls:
        message["content"] = answer.text or None
        message["tool_calls"] = [
            {"id": call_id(j), "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}
            for j, call in enumerate(answer.tool_calls)
        ]
    return message


def _call_delta(delta: ToolCallDelta, call_id: str) -> dict[str, Any]:
    """A streamed call's chunk: its id, type and name first, then its arguments as they come."""
    if delta.name is not None:
        return {
            "index": delta.index, "id": call_id, "type": "function",
            "function": {"name": delta.name, "arguments": delta.arguments},
        }
    return {"index": delta.index, "function": {"arguments": delta.arguments}}


@router.post("/chat/completions", response_model=None, responses=STREAMED)
async def chat_completions(
    request: Request, body: ChatCompletionRequest
) -> JSONResponse | StreamingResponse:
    model_id = accepted(request, body, body.model, CHAT)
    chat = chat_of(body.messages, tools_of(body), body)
    generation = options_of(body).generation(model_id, chat, "messages")
    reply = Reply(new_id("chatcmpl-"), model_id)
    n = body.n or 1
    ids = CallIds("call_")
    if not body.stream:
        answers = await run_all(request, generation, n)
        choices = [
            {
                "index": i,
                "message": _message(answer, lambda j, i=i: ids(i, j)),
                "finish_reason": answer.last.finish_reason,
                "logprobs": chat_logprobs(answer.logprobs) if body.logprobs else None,
            }
            for i, answer in enumerate(answers)
        ]
        out = reply.of("chat.completion", choices)
        usage = usage_of(*(a.usage for a in answers),
                         reasoning_tokens=sum(a.reasoning_tokens for a in answers))
        return JSONResponse({**out, "usage": usage})
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
        if piece.channel == "reasoning":
            return chunk(index, {"reasoning_content": piece.text}, logprobs=probs)
        delta: dict[str, Any] = {"content": piece.text} if piece.text or not piece.tool_calls else {}
        if piece.tool_calls:
            delta["tool_calls"] = [_call_delta(d, ids(index, d.index)) for d in piece.tool_calls]
        return chunk(index, delta, logprobs=probs)

    return events(
        streams, chunk_of, lambda i, finish: chunk(i, {}, finish), body.stream_options,
        lambda i: chunk(i, {"role": "assistant", "content": ""}),
    )
