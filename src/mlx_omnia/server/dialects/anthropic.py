"""Anthropic dialect (Messages API), under /api/anthropic/v1."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any, Literal, cast

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ConfigDict, Field

from mlx_omnia import Bounds, Chat, ChatMessage, Piece, TextPart, ToolCallDelta, Usage
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
from mlx_omnia.server.dialects.fields import COUNT_TOKENS, MESSAGES
from mlx_omnia.server.dialects.generation import Options, documented, json_schema
from mlx_omnia.server.dialects.tools import arguments_object, declared, function_tool, unique
from mlx_omnia.server.errors import ApiError
from mlx_omnia.server.state import ServerState, state_of

router = APIRouter()
# Claude Code's reachability probes of its base URL, sent without a key: they answer 200 with
# no body, as Anthropic's API does; not an API, so not in the schema.
PROBES = ("/api/anthropic", "/api/anthropic/api/hello")
probes = APIRouter(include_in_schema=False)


@probes.api_route(PROBES[0], methods=["GET", "HEAD"])
@probes.api_route(PROBES[1], methods=["GET", "HEAD"])
async def probe() -> Response:
    return Response(status_code=200)

# Keys of a text content block: its text and those that cannot change the output.
TEXT_BLOCK_KEYS = frozenset({"type", "text"}) | MESSAGES.names("ignored", under="messages[].content[]")
EPOCH = "1970-01-01T00:00:00Z"
# A thinking block's signature: Anthropic's proves the thinking is the model's; this server's
# thinking is not checked when it comes back, so the signature says only where it came from.
SIGNATURE = "mlx-omnia"
# Anthropic's own bounds, tighter than the engine's.
LIMITS = {
    "max_tokens": Bounds(ge=1),
    "temperature": Bounds(le=1.0),
    "stop": Bounds(nonempty=True),
}

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
ROLES: dict[str, Literal["user", "assistant", "system"]] = {
    "user": "user", "assistant": "assistant", "system": "system"
}
ToolChoice = Literal["auto", "none", "required"]
# Keys of a custom tool (fields.py says why each is honoured or ignored).
TOOL_KEYS = MESSAGES.names("honoured", "ignored", under="tools[]")
OUTPUT_CONFIG_KEYS = MESSAGES.names("honoured", "ignored", under="output_config")
# output_config.effort: how much effort the model spends, a hint to Claude's thinking. A model
# without a thinking template answers the same at every level (Claude Code always sends one).
EFFORTS = ("low", "medium", "high", "xhigh", "max")
# An output format: JSON valid under `schema` (output_config.format, or the structured outputs
# beta's top-level output_format).
_FORMAT: dict[str, Any] = {
    "type": "object",
    "properties": {"type": {"const": "json_schema"}, "schema": {"type": "object"}},
    "required": ["type", "schema"],
    "additionalProperties": False,
}
_OUTPUT_CONFIG: dict[str, Any] = {
    "properties": {
        "effort": {"enum": [*EFFORTS, None]},
        "format": {"anyOf": [_FORMAT, {"type": "null"}]},
    },
    "additionalProperties": False,
}


class _Strict(Body):
    """Types as Anthropic checks them: no strings for numbers, no floats for integers."""

    model_config = ConfigDict(extra="allow", strict=True)


_TEXT_BLOCK: dict[str, Any] = {
    **text_part(["text"], cache_control={}, citations={"enum": [None, []]}),
    "additionalProperties": False,
}
_BLOCKS: dict[str, Any] = {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_BLOCK}]}


def _block(kind: str, required: tuple[str, ...] = (), **properties: Any) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"type": {"const": kind}, **properties},
        "required": ["type", *required],
    }


# A message's blocks: text; an assistant's tool_use and (earlier) thinking; a user's
# tool_result. A system message (Claude Code's) holds text.
_MESSAGE_BLOCKS: dict[str, Any] = {"anyOf": [
    {"type": "string"},
    {"type": "array", "items": {"anyOf": [
        _TEXT_BLOCK,
        _block("tool_use", ("id", "name", "input"), id={"type": "string"},
               name={"type": "string"}, input={"type": "object"}),
        _block("tool_result", ("tool_use_id",), tool_use_id={"type": "string"},
               content=_BLOCKS, is_error={"type": "boolean"}),
        _block("thinking", ("thinking",), thinking={"type": "string"}),
        _block("redacted_thinking"),
    ]}},
]}
MESSAGE: dict[str, Any] = {
    "type": "object",
    "properties": {"role": {"enum": ["user", "assistant", "system"]}, "content": _MESSAGE_BLOCKS},
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
    context_management: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = Field(None, json_schema_extra=_OUTPUT_CONFIG)
    output_format: dict[str, Any] | None = Field(
        None, json_schema_extra={"anyOf": [_FORMAT, {"type": "null"}]}
    )


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(json_schema_extra=documented("max_tokens", LIMITS))
    stop_sequences: list[str] | None = Field(None, json_schema_extra=documented("stop", LIMITS))
    temperature: float | None = Field(None, json_schema_extra=documented("temperature", LIMITS))
    top_p: float | None = Field(None, json_schema_extra=documented("top_p", LIMITS))
    top_k: int | None = Field(None, json_schema_extra=documented("top_k", LIMITS))
    kv_bits: int | None = Field(None, json_schema_extra=documented("kv_bits"))
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


def _blocks(content: Any, where: str) -> list[dict[str, object]]:
    """A message's content as a list of blocks (a string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise ApiError(
            "invalid_request", f"{where}: must be a string or a list of content blocks", where
        )
    blocks: list[dict[str, object]] = []
    for j, item in enumerate(cast(list[object], content)):
        if not isinstance(item, dict):
            at = f"{where}.{j}"
            raise ApiError("invalid_request", f"{at}: a content block must be an object", at)
        blocks.append(cast(dict[str, object], item))
    return blocks


def _result_text(block: dict[str, object], at: str) -> str:
    """A tool_result's content as text (a string or text blocks); an error result says so."""
    content = block.get("content", "")
    text = content if isinstance(content, str) else "\n".join(
        b["text"] for b in cast(list[TextPart], _text_blocks(content, f"{at}.content"))
    )
    error = block.get("is_error")
    if error is not None and not isinstance(error, bool):
        raise ApiError("invalid_request", f"{at}.is_error: must be a boolean", f"{at}.is_error")
    if error:
        return f"Error: {text}"
    return text


def _turns(role: Literal["user", "assistant"], content: Any, where: str) -> list[ChatMessage]:
    """One Anthropic message as the engine's turns: text, an assistant's tool_use blocks as its
    tool calls, a user's tool_result blocks as tool turns (before the user's text). Earlier
    thinking is dropped, as templates drop it (clear_thinking keeps nothing more)."""
    texts: list[TextPart] = []
    calls: list[dict[str, Any]] = []
    results: list[ChatMessage] = []
    thoughts: list[str] = []
    for j, block in enumerate(_blocks(content, where)):
        at = f"{where}.{j}"
        kind = block.get("type")
        if kind == "thinking" and role == "assistant":
            thought = block.get("thinking")
            if not isinstance(thought, str):
                raise ApiError("invalid_request", f"{at}.thinking: must be a string", f"{at}.thinking")
            if thought:
                thoughts.append(thought)
            continue
        if kind == "redacted_thinking" and role == "assistant":
            continue
        if kind == "tool_use" and role == "assistant":
            name, call_id, arguments = block.get("name"), block.get("id"), block.get("input")
            if not isinstance(name, str) or not isinstance(call_id, str) or not isinstance(arguments, dict):
                raise ApiError(
                    "invalid_request", f"{at}: a tool_use block needs id, name and an input object", at
                )
            calls.append({"id": call_id, "type": "function", "function": {
                "name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}})
            continue
        if kind == "tool_result" and role == "user":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str):
                raise ApiError("invalid_request", f"{at}.tool_use_id: must be a string", f"{at}.tool_use_id")
            results.append({"role": "tool", "tool_call_id": call_id, "content": _result_text(block, at)})
            continue
        texts += cast(list[TextPart], _text_blocks([block], where))
    turns: list[ChatMessage] = list(results)
    if role == "assistant":
        message: ChatMessage = {"role": "assistant", "content": texts}
        if calls:
            message["tool_calls"] = calls
        if thoughts:
            message["reasoning_content"] = "\n".join(thoughts)
        turns.append(message)
    elif texts or not results:
        turns.append({"role": "user", "content": texts})
    return turns


def _tools(body: CountTokensRequest) -> tuple[tuple[dict[str, Any], ...], ToolChoice, tuple[str, ...], bool]:
    """The request's custom tools in the engine's shape and how they may be called."""
    declared_tools: list[dict[str, Any]] = []
    for i, tool in enumerate(body.tools or []):
        where = f"tools.{i}"
        if tool.get("type", "custom") != "custom":
            raise ApiError(
                "invalid_request",
                f"{where}.type: server tools ({tool.get('type')!r}) are not supported by this "
                "server; declare custom tools (name, description, input_schema)",
                f"{where}.type",
            )
        for key in tool:
            if key not in TOOL_KEYS:
                raise ApiError(
                    "invalid_request", f"{where}.{key}: field is not supported by this server",
                    f"{where}.{key}",
                )
        if "input_schema" not in tool:
            raise ApiError("invalid_request", f"{where}.input_schema: Field required", f"{where}.input_schema")
        declared_tools.append(
            function_tool(tool.get("name"), tool.get("description"), tool.get("input_schema"), where)
        )
    tools = unique(declared_tools, "tools")
    choice = body.tool_choice or {"type": "auto"}
    kind = choice.get("type")
    parallel = choice.get("disable_parallel_tool_use") is not True
    if kind not in ("auto", "any", "tool", "none"):
        raise ApiError(
            "invalid_request", "tool_choice.type: must be auto, any, tool or none", "tool_choice.type"
        )
    if kind == "auto":
        return tools, "auto", (), parallel
    if not tools and kind != "none":
        raise ApiError("invalid_request", "tool_choice: needs tools", "tool_choice")
    if kind == "none":
        return tools, "none", (), parallel
    if kind == "tool":
        name = declared(choice.get("name"), tools, "tool_choice.name")
        return tools, "required", (name,), False  # the named tool, used once
    return tools, "required", (), parallel


def chat_of(body: CountTokensRequest) -> Chat:
    out: list[ChatMessage] = []
    system: list[TextPart] = []
    if body.system is not None:
        system += _as_parts(_text_blocks(body.system, "system"))
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
        if role == "system":  # Claude Code's turn-by-turn system text: one system prompt
            system += _as_parts(_text_blocks(m["content"], f"messages.{i}.content"))
            continue
        out += _turns(role, m["content"], f"messages.{i}.content")
    if any(p["text"] for p in system):  # an empty system prompt is no system prompt
        out.insert(0, {"role": "system", "content": system})
    # A final assistant turn is a prefill: the answer continues its text (and holds only what
    # follows it). As Anthropic's API, its text may not end with whitespace.
    last = body.messages[-1]
    prefill = last.get("role") == "assistant"
    if prefill:
        final = out[-1]
        parts = final["content"]
        tail = parts if isinstance(parts, str) else "".join(b["text"] for b in parts[-1:])
        if final.get("tool_calls"):
            raise ApiError(
                "invalid_request", "messages: a final assistant message cannot hold tool_use blocks "
                "(send their tool_result blocks in a user message)", "messages",
            )
        if tail != tail.rstrip():
            at = f"messages.{len(body.messages) - 1}.content"
            raise ApiError(
                "invalid_request", f"{at}: final assistant content cannot end with trailing whitespace", at
            )
    thinking = _thinking(body.thinking)
    tools, choice, allowed, parallel = _tools(body)
    _edits(body.context_management)
    return Chat(
        tuple(out), tools, choice, allowed, parallel, continue_final=prefill, thinking=thinking
    )


def _as_parts(content: str | list[TextPart]) -> list[TextPart]:
    return [{"type": "text", "text": content}] if isinstance(content, str) else list(content)


def _thinking(thinking: dict[str, Any] | None) -> bool:
    """Extended thinking as a thinking template's switch: on when enabled or adaptive, off when
    disabled or not asked for (Anthropic's default); a template without thinking answers the
    same either way."""
    if thinking is None:
        return False
    kind = thinking.get("type")
    if kind not in ("enabled", "disabled", "adaptive"):
        raise ApiError(
            "invalid_request", "thinking.type: must be enabled, disabled or adaptive", "thinking.type"
        )
    budget = thinking.get("budget_tokens")
    if kind == "enabled" and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 1024):
        raise ApiError(
            "invalid_request", "thinking.budget_tokens: must be an integer >= 1024",
            "thinking.budget_tokens",
        )
    display = thinking.get("display")
    if display not in (None, "summarized", "omitted"):
        raise ApiError(
            "invalid_request", "thinking.display: must be summarized or omitted", "thinking.display"
        )
    return kind != "disabled"


CLEARED = "[cleared to save context]"


def _edits(context: dict[str, Any] | None) -> list[dict[str, Any]]:
    """context_management's edits, checked: clear_thinking_20251015 and
    clear_tool_uses_20250919."""
    if context is None:
        return []
    for key in context:
        if key != "edits":
            raise ApiError("invalid_request", f"context_management.{key}: field is not supported",
                           f"context_management.{key}")
    raw: object = context.get("edits") or []
    if not isinstance(raw, list):
        raise ApiError("invalid_request", "context_management.edits: must be a list",
                       "context_management.edits")
    edits: list[dict[str, Any]] = []
    for i, item in enumerate(cast(list[Any], raw)):
        at = f"context_management.edits.{i}"
        edit = cast(dict[str, Any], item) if isinstance(item, dict) else {}
        if edit.get("type") not in ("clear_thinking_20251015", "clear_tool_uses_20250919"):
            raise ApiError("invalid_request", f"{at}.type: {edit.get('type')!r} is not supported",
                           f"{at}.type")
        edits.append(edit)
    return edits


def _count_of(value: object, kind: str, default: int, where: str) -> int:
    """An edit's {"type": kind, "value": N} (N >= 0), or `default` when absent."""
    if value is None:
        return default
    entry = cast(dict[str, Any], value) if isinstance(value, dict) else {}
    n = entry.get("value")
    if entry.get("type") != kind or not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ApiError("invalid_request", f"{where}: must be {{'type': '{kind}', 'value': N}}",
                       where)
    return n


def _clear_thinking(messages: list[ChatMessage], edit: dict[str, Any], at: str) -> int:
    """Drop the reasoning of all assistant turns but the last `keep` (default 1; "all": none
    dropped); the number of turns cleared."""
    keep = edit.get("keep")
    if keep == "all":
        return 0
    value = _count_of(keep, "thinking_turns", 1, f"{at}.keep")
    thinking = [n for n, m in enumerate(messages) if m.get("reasoning_content")]
    cleared = thinking[: max(0, len(thinking) - value)]
    for n in cleared:
        messages[n] = cast(ChatMessage, {
            k: v for k, v in messages[n].items() if k != "reasoning_content"
        })
    return len(cleared)


def _clear_tool_uses(messages: list[ChatMessage], edit: dict[str, Any], at: str) -> int:
    """Replace the results (and with clear_tool_inputs, the inputs) of all tool uses but the
    last `keep` (default 3), except excluded tools'; the number of tool uses cleared."""
    keep = _count_of(edit.get("keep"), "tool_uses", 3, f"{at}.keep")
    exclude = set(cast(list[str], edit.get("exclude_tools") or []))
    inputs = edit.get("clear_tool_inputs", False)
    uses = [
        (n, j, call) for n, m in enumerate(messages) for j, call in enumerate(m.get("tool_calls", []))
        if call["function"]["name"] not in exclude
    ]
    cleared = uses[: max(0, len(uses) - keep)]
    ids = {call["id"] for _, _, call in cleared}
    for n, j, call in cleared:
        name = call["function"]["name"]
        if inputs is True or (isinstance(inputs, list) and name in cast(list[str], inputs)):
            calls = [dict(c) for c in messages[n].get("tool_calls", [])]
            calls[j] = {**call, "function": {"name": name, "arguments": "{}"}}
            messages[n] = cast(ChatMessage, {**messages[n], "tool_calls": calls})
    for n, m in enumerate(messages):
        if m["role"] == "tool" and m.get("tool_call_id") in ids:
            messages[n] = cast(ChatMessage, {**m, "content": CLEARED})
    return len(cleared)


async def _managed(
    state: ServerState, model_id: str, chat: Chat, context: dict[str, Any] | None
) -> tuple[Chat, list[dict[str, Any]] | None]:
    """The chat after context_management's edits, and the edits applied (None without any): a
    clear_tool_uses edit applies once the prompt has more tokens than its trigger (default
    100,000)."""
    edits = _edits(context)
    if not edits:
        return chat, None
    applied: list[dict[str, Any]] = []
    for i, edit in enumerate(edits):
        at = f"context_management.edits.{i}"
        messages = list(chat.messages)
        before = await _count(state, model_id, chat)
        if edit["type"] == "clear_thinking_20251015":
            turns = _clear_thinking(messages, edit, at)
            done: dict[str, Any] = {"type": edit["type"], "cleared_thinking_turns": turns}
        else:
            trigger = _count_of(edit.get("trigger"), "input_tokens", 100_000, f"{at}.trigger")
            uses = _clear_tool_uses(messages, edit, at) if before > trigger else 0
            done = {"type": edit["type"], "cleared_tool_uses": uses}
        chat = replace(chat, messages=tuple(messages))
        done["cleared_input_tokens"] = before - await _count(state, model_id, chat)
        applied.append(done)
    return chat, applied


def output_of(body: CountTokensRequest, options: Options) -> Options:
    """`options` constrained by output_config.format (or the structured outputs beta's
    output_format), effort accepted; refused by name where they are not valid."""
    config = body.output_config or {}
    for key in config:
        if key not in OUTPUT_CONFIG_KEYS:
            raise ApiError(
                "invalid_request", f"output_config.{key}: field is not supported by this server",
                f"output_config.{key}",
            )
    if config.get("effort") not in (None, *EFFORTS):
        raise ApiError(
            "invalid_request", f"output_config.effort: must be one of {', '.join(EFFORTS)}",
            "output_config.effort",
        )
    fmt, where = config.get("format"), "output_config.format"
    if body.output_format is not None:
        if fmt is not None:
            raise ApiError(
                "invalid_request",
                "output_format: send output_config.format or output_format, not both",
                "output_format",
            )
        fmt, where = body.output_format, "output_format"
    if fmt is None:
        return options
    entry = cast(dict[str, Any], fmt) if isinstance(fmt, dict) else {}
    if entry.get("type") != "json_schema":
        raise ApiError("invalid_request", f"{where}.type: must be 'json_schema'", f"{where}.type")
    for key in entry:
        if key not in ("type", "schema"):
            raise ApiError(
                "invalid_request", f"{where}.{key}: field is not supported by this server",
                f"{where}.{key}",
            )
    if "schema" not in entry:
        raise ApiError("invalid_request", f"{where}.schema: Field required", f"{where}.schema")
    options.set("constraint", json_schema(entry["schema"], f"{where}.schema"), f"{where}.schema")
    return options


def options_of(body: MessagesRequest) -> Options:
    options = Options(LIMITS)
    options.set("max_tokens", body.max_tokens)
    if body.thinking and body.thinking.get("type") == "enabled":
        options.set("reasoning_budget", body.thinking.get("budget_tokens"), "thinking.budget_tokens")
    options.set("temperature", body.temperature)
    options.set("top_p", body.top_p)
    options.set("top_k", body.top_k)
    options.set("kv_bits", body.kv_bits)
    options.set("stop", body.stop_sequences, "stop_sequences")
    return output_of(body, options)


# -- engine -> response --------------------------------------------------------------------------
def stop_of(last: Piece) -> tuple[StopReason, str | None]:
    if last.stop_sequence is not None:
        return "stop_sequence", last.stop_sequence
    if last.finish_reason == "length":
        return "max_tokens", None
    if last.finish_reason == "tool_calls":
        return "tool_use", None
    return "end_turn", None


def _usage(usage: Usage) -> dict[str, int]:
    """Anthropic's usage: `input_tokens` are the prompt tokens not read from the cache (the
    whole prompt is input_tokens + cache_creation_input_tokens + cache_read_input_tokens);
    writing the prefix cache costs nothing, so no token counts as a cache creation."""
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "output_tokens": usage.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": usage.cached_tokens,
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


class Blocks:
    """A streamed answer's content blocks: text, then each tool call (its input as JSON
    deltas), each opened when its first part comes and closed when the next opens."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None

    def _start(self, block: dict[str, Any]) -> list[str]:
        events = self.close()
        self.index += 1
        self.open = str(block["type"])
        events.append(sse({"type": "content_block_start", "index": self.index,
                           "content_block": block}, "content_block_start"))
        return events

    def close(self, final: bool = False) -> list[str]:
        """Close the open block; `final` with none ever opened: an empty text block."""
        if self.open is None and final and self.index < 0:
            return [*self._start({"type": "text", "text": ""}), *self.close()]
        if self.open is None:
            return []
        events: list[str] = []
        if self.open == "thinking":
            delta = {"type": "signature_delta", "signature": SIGNATURE}
            events.append(sse({"type": "content_block_delta", "index": self.index,
                               "delta": delta}, "content_block_delta"))
        self.open = None
        stop = {"type": "content_block_stop", "index": self.index}
        return [*events, sse(stop, "content_block_stop")]

    def thinking(self, text: str) -> list[str]:
        events = (
            self._start({"type": "thinking", "thinking": "", "signature": ""})
            if self.open != "thinking" else []
        )
        if not text:
            return events
        delta = {"type": "thinking_delta", "thinking": text}
        return [*events, sse({"type": "content_block_delta", "index": self.index, "delta": delta},
                             "content_block_delta")]

    def text(self, text: str) -> list[str]:
        events = self._start({"type": "text", "text": ""}) if self.open != "text" else []
        delta = {"type": "text_delta", "text": text}
        return [*events, sse({"type": "content_block_delta", "index": self.index, "delta": delta},
                             "content_block_delta")]

    def call(self, delta: ToolCallDelta) -> list[str]:
        events: list[str] = []
        if delta.name is not None:
            events = self._start({"type": "tool_use", "id": new_id("toolu_"), "name": delta.name,
                                  "input": {}})
        if delta.arguments:
            json_delta = {"type": "input_json_delta", "partial_json": delta.arguments}
            events.append(sse({"type": "content_block_delta", "index": self.index,
                               "delta": json_delta}, "content_block_delta"))
        return events


async def _count(state: ServerState, model_id: str, chat: Chat) -> int:
    return await state.with_model(model_id, lambda model: len(model.encode(chat)))


@router.post("/messages", response_model=None, responses=STREAMED)
async def messages(request: Request, body: MessagesRequest) -> JSONResponse | StreamingResponse:
    refuse_unknown(body, MESSAGES.ignored())
    state = state_of(request)
    model_id = state.manager.check_id(body.model)
    chat, applied = await _managed(state, model_id, chat_of(body), body.context_management)
    generation = options_of(body).generation(model_id, chat, "messages")
    mid = new_id("msg_")
    headers = {"request-id": new_id("req_")}
    hidden = (body.thinking or {}).get("display") == "omitted"
    managed = {} if applied is None else {"context_management": {"applied_edits": applied}}
    if not body.stream:
        answer = await generation.run(request)
        stop, stop_sequence = stop_of(answer.last)
        content: list[dict[str, Any]] = []
        if answer.reasoning:
            shown = "" if hidden else answer.reasoning
            content.append({"type": "thinking", "thinking": shown, "signature": SIGNATURE})
        if answer.text or not answer.tool_calls:
            content.append({"type": "text", "text": answer.text})
        content += [
            {"type": "tool_use", "id": new_id("toolu_"), "name": call.name,
             "input": arguments_object(call.arguments)}
            for call in answer.tool_calls
        ]
        return JSONResponse(
            managed | _message(
                mid,
                model_id,
                content,
                stop,
                stop_sequence,
                _usage(answer.usage),
            ),
            headers=headers,
        )

    stream = await generation.stream(request)
    first = stream.first
    if first is None:
        raise ApiError("internal", "generation produced no output")
    # The prompt's usage as the engine counted it (cached tokens included), known before the
    # answer's last piece; counted here only if the engine's count is not at hand.
    prompt = first.usage or stream.prompt_usage or Usage(await _count(state, model_id, chat), 0)
    start = Usage(prompt.prompt_tokens, 0, prompt.cached_tokens)

    async def events() -> AsyncIterator[str]:
        yield sse(
            {
                "type": "message_start",
                "message": _message(mid, model_id, [], None, None, _usage(start)),
            },
            "message_start",
        )
        yield sse({"type": "ping"}, "ping")
        blocks = Blocks()
        try:
            async for piece in stream:
                if piece.channel == "reasoning":
                    for event in blocks.thinking("" if hidden else piece.text):
                        yield event
                elif piece.text:
                    for event in blocks.text(piece.text):
                        yield event
                for delta in piece.tool_calls:
                    for event in blocks.call(delta):
                        yield event
                if piece.finish_reason is not None:
                    assert piece.usage is not None
                    stop, stop_sequence = stop_of(piece)
                    for event in blocks.close(final=True):
                        yield event
                    yield sse(
                        {
                            "type": "message_delta",
                            **managed,
                            "delta": {"stop_reason": stop, "stop_sequence": stop_sequence},
                            "usage": _usage(piece.usage),
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
    refuse_unknown(body, COUNT_TOKENS.ignored())
    state = state_of(request)
    model_id = state.manager.check_id(body.model)
    output_of(body, Options(LIMITS)).checked()  # checked as a message's would be; not counted
    chat, _ = await _managed(state, model_id, chat_of(body), body.context_management)
    return {"input_tokens": await _count(state, model_id, chat)}


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
