"""OpenAI responses: POST /responses, and the stored ones (GET and DELETE /responses/{id})."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any, Literal, cast

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field, StrictBool, StrictFloat, StrictInt, StrictStr

from mlx_omnia import Chat, ChatMessage, Piece, TokenLogprob
from mlx_omnia.server.dialects.common import STREAMED, new_id, now, sse, text_part
from mlx_omnia.server.dialects.common import Request as Body
from mlx_omnia.server.dialects.fields import RESPONSES
from mlx_omnia.server.dialects.generation import Answer, Options, documented
from mlx_omnia.server.dialects.openai.chat import Tools
from mlx_omnia.server.dialects.openai.shared import (
    LIMITS,
    accepted,
    as_dict,
    format_schema,
    logprob_entry,
    output_format,
    parts_of,
    refuse_part,
    role_of,
    thinking_of,
)
from mlx_omnia.server.dialects.tools import CallIds, declared, function_tool, unique
from mlx_omnia.server.errors import ApiError
from mlx_omnia.server.state import ServerState, state_of
from mlx_omnia.server.stored import StoredResponse

router = APIRouter()

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


_PARTS: dict[str, Any] = {
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
}


def _item(kind: str, required: tuple[str, ...], **properties: Any) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"type": {"const": kind}, **properties},
        "required": ["type", *required],
    }


# An input item: a message; an earlier answer's function_call, reasoning, and the
# function_call_output that answers a call.
INPUT_ITEM: dict[str, Any] = {"anyOf": [
    {
        "type": "object",
        "properties": {
            "type": {"const": "message"},
            "role": {"enum": ["system", "developer", "user", "assistant"]},
            "content": _PARTS,
        },
        "required": ["role", "content"],
    },
    _item("function_call", ("call_id", "name", "arguments"), call_id={"type": "string"},
          name={"type": "string"}, arguments={"type": "string"}),
    _item("function_call_output", ("call_id", "output"), call_id={"type": "string"},
          output=_PARTS),
    _item("reasoning", (), content={"anyOf": [
        {"type": "array"}, {"type": "null"}
    ]}),
]}


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
        description="Text, or input items: messages (input_text parts; output_text or refusal "
        "parts in an assistant's), function_call, function_call_output and reasoning items.",
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
    kv_bits: StrictInt | None = Field(None, json_schema_extra=documented("kv_bits"))
    stream: StrictBool | None = False
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    store: StrictBool | None = None
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


def _output_text(output: object, where: str) -> str:
    """A function_call_output's output: a string, or input_text parts."""
    if isinstance(output, str):
        return output
    return _item_text(output, "user", where)


def input_messages(items: str | list[Any], where: str = "input") -> list[ChatMessage]:
    """Input items as the engine's messages: messages, function_call items (an assistant's tool
    calls, joined with the assistant text before them) and function_call_output items (tool
    turns); reasoning items of earlier turns are dropped (templates drop them too)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[ChatMessage] = []
    for i, raw in enumerate(items):
        at = f"{where}[{i}]"
        item = as_dict(raw)
        if item is None:
            raise ApiError("invalid_request", f"{at} must be an object", at)
        kind = item.get("type", "message")
        if kind == "message":
            role = role_of(RESPONSE_ROLES, item, at)
            text = _item_text(item.get("content"), role, f"{at}.content")
            last = messages[-1] if messages else None
            if role == "assistant" and last is not None and _thought_only(last):
                last["content"] = text  # the answer after its reasoning: one turn
            else:
                messages.append({"role": role, "content": text})
        elif kind == "function_call":
            name, args, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
            if not (isinstance(name, str) and isinstance(args, str) and isinstance(call_id, str)):
                raise ApiError(
                    "invalid_request", f"{at}: a function_call needs call_id, name and arguments "
                    "(strings)", at,
                )
            call = {"id": call_id, "type": "function",
                    "function": {"name": name, "arguments": args}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)  # after its text or reasoning
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise ApiError("invalid_request", f"{at}.call_id must be a string", f"{at}.call_id")
            messages.append({
                "role": "tool", "tool_call_id": call_id,
                "content": _output_text(item.get("output"), f"{at}.output"),
            })
        elif kind == "reasoning":  # an earlier answer's reasoning: its assistant turn's
            content: object = item.get("content")
            content = [] if content is None else content
            if not isinstance(content, list):
                raise ApiError("invalid_request", f"{at}.content must be a list", f"{at}.content")
            parts = [as_dict(p) or {} for p in cast(list[object], content)]
            texts = [str(p.get("text", "")) for p in parts if p.get("type") == "reasoning_text"]
            if texts:
                messages.append({"role": "assistant", "content": "",
                                 "reasoning_content": "\n".join(texts)})
        else:
            raise ApiError(
                "invalid_request",
                f"{at}: item type {kind!r} is not supported (message, function_call, "
                "function_call_output and reasoning items are)",
                f"{at}.type",
            )
    return messages


def _thought_only(message: ChatMessage) -> bool:
    return (message["role"] == "assistant" and bool(message.get("reasoning_content"))
            and not message["content"] and not message.get("tool_calls"))


def _tools(body: ResponsesRequest) -> Tools:
    """Function tools (a namespace's functions among them), tool_choice, parallel_tool_calls."""
    declared_tools: list[dict[str, Any]] = []

    def add(tool: dict[str, Any], where: str) -> None:
        kind = tool.get("type")
        if kind == "function":
            declared_tools.append(function_tool(
                tool.get("name"), tool.get("description"), tool.get("parameters"), where
            ))
        elif kind == "namespace":  # Codex's group of functions: each is a function tool
            for j, inner in enumerate(cast(list[Any], tool.get("tools") or [])):
                add(as_dict(inner) or {}, f"{where}.tools[{j}]")
        else:
            raise ApiError(
                "invalid_request",
                f"{where}: {kind!r} tools are not supported by this server (function tools are; "
                "hosted tools such as web_search run on OpenAI's servers)",
                f"{where}.type",
            )

    for i, raw in enumerate(body.tools or []):
        add(as_dict(raw) or {}, f"tools[{i}]")
    tools = unique(declared_tools, "tools")
    parallel = body.parallel_tool_calls is not False
    choice = body.tool_choice
    if choice is None or choice == "auto":
        return Tools(tools, "auto", (), parallel)
    if not tools and choice != "none":
        raise ApiError("invalid_request", "tool_choice needs tools", "tool_choice")
    if choice in ("none", "required"):
        return Tools(tools, choice, (), parallel)
    entry = as_dict(choice) or {}
    if entry.get("type") == "function":
        name = declared(entry.get("name"), tools, "tool_choice.name")
        return Tools(tools, "required", (name,), False)  # the named function, called once
    if entry.get("type") == "allowed_tools" and entry.get("mode") in ("auto", "required"):
        listed = entry.get("tools")
        if isinstance(listed, list) and listed:
            names = tuple(
                declared((as_dict(t) or {}).get("name"), tools, f"tool_choice.tools[{j}]")
                for j, t in enumerate(cast(list[Any], listed))
            )
            return Tools(tuple(t for t in tools if t["function"]["name"] in names),
                         entry["mode"], (), parallel)
    raise ApiError(
        "invalid_request",
        "tool_choice must be 'none', 'auto', 'required', a function or allowed_tools",
        "tool_choice",
    )


def _responses_chat(body: ResponsesRequest, earlier: Sequence[ChatMessage] = ()) -> Chat:
    """The conversation: the instructions, a stored response's conversation this one follows,
    then the input."""
    if not isinstance(body.input, str) and not body.input:
        raise ApiError("invalid_request", "input must not be empty", "input")
    messages: list[ChatMessage] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    messages += [*earlier, *input_messages(body.input)]
    tools = _tools(body)
    effort = (body.reasoning or {}).get("effort")
    return Chat(
        tuple(messages), tools.tools, tools.choice, tools.allowed, tools.parallel,
        thinking=thinking_of(effort, "reasoning.effort"),
        reasoning_effort=effort if isinstance(effort, str) else None,
    )


def _responses_options(body: ResponsesRequest) -> Options:
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
    _check_reasoning(body.reasoning)
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
    options.set("kv_bits", body.kv_bits)
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


def _check_reasoning(reasoning: dict[str, Any] | None) -> None:
    """reasoning.effort and .summary: accepted; a model without a thinking template answers
    the same whatever its effort, and has no reasoning to summarize."""
    for key, value in (reasoning or {}).items():
        if key == "effort" and value not in (None, "none", "minimal", "low", "medium", "high",
                                             "xhigh"):
            raise ApiError("invalid_request", f"reasoning.effort {value!r} is not valid",
                           "reasoning.effort")
        elif key in ("summary", "generate_summary") and value not in (None, "auto", "concise",
                                                                      "detailed"):
            raise ApiError("invalid_request", f"reasoning.{key} {value!r} is not valid",
                           f"reasoning.{key}")
        elif key not in ("effort", "summary", "generate_summary"):
            raise ApiError("invalid_request", f"reasoning.{key} is not supported",
                           f"reasoning.{key}")


def wants_logprobs(body: ResponsesRequest) -> bool:
    """Logprobs come with the output text when `include` asks for them or top_logprobs is set."""
    return LOGPROBS in (body.include or []) or body.top_logprobs is not None


class _ResponseShape:
    """Builds the Response object and its output items (a message with the text, a
    function_call item a tool call) as generation goes."""

    def __init__(self, body: ResponsesRequest, model_id: str, chat: Chat) -> None:
        self.body = body
        self.model_id = model_id
        self.chat = chat
        self.id = new_id("resp_")
        self.item_id = new_id("msg_")
        self.reasoning_id = new_id("rs_")
        self.reasoning_tokens = 0
        self.call_ids = CallIds("call_")
        self.item_ids = CallIds("fc_")
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

    def call(self, index: int, name: str, arguments: str, status: str) -> dict[str, Any]:
        return {
            "id": self.item_ids(0, index),
            "type": "function_call",
            "status": status,
            "call_id": self.call_ids(0, index),
            "name": name,
            "arguments": arguments,
        }

    def reasoning(self, text: str, status: str) -> dict[str, Any]:
        return {
            "id": self.reasoning_id, "type": "reasoning", "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}],
        }

    def output(self, answer: Answer) -> list[dict[str, Any]]:
        status = "incomplete" if answer.last.finish_reason == "length" else "completed"
        items: list[dict[str, Any]] = []
        if answer.reasoning:
            items.append(self.reasoning(answer.reasoning, "completed"))
        if answer.text or not answer.tool_calls:
            items.append(self.item(status, [self.part(answer.text, answer.logprobs)]))
        items += [self.call(i, c.name, c.arguments, "completed")
                  for i, c in enumerate(answer.tool_calls)]
        return items

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
                "input_tokens_details": {
                    "cached_tokens": u.cached_tokens, "cache_write_tokens": 0
                },
                "output_tokens": u.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                "total_tokens": u.prompt_tokens + u.completion_tokens,
            }
            if piece.finish_reason == "length":
                incomplete = {"reason": "max_output_tokens"}
            else:
                completed_at = now()
        choice: Any = self.chat.tool_choice
        if self.chat.allowed_tools:
            choice = {"type": "function", "name": self.chat.allowed_tools[0]}
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
            "parallel_tool_calls": self.chat.parallel_tool_calls,
            "previous_response_id": b.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": b.store is not False,
            "temperature": b.temperature,
            "text": {
                "format": (b.text or {}).get("format") or {"type": "text"}, "verbosity": "medium"
            },
            "tool_choice": choice,
            "tools": [
                {"type": "function", "name": t["function"]["name"],
                 "description": t["function"].get("description"),
                 "parameters": t["function"]["parameters"], "strict": False}
                for t in self.chat.tools
            ],
            "top_logprobs": b.top_logprobs,
            "top_p": b.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": getattr(b, "user", None),
            "metadata": getattr(b, "metadata", None) or {},
        }

    def keep(self, state: ServerState, response: dict[str, Any]) -> None:
        """Store the response (unless the request said store: false) with its conversation."""
        if self.body.store is False:
            return
        conversation = [m for m in self.chat.messages if not self._instructions(m)]
        conversation += input_messages(response["output"], "output")
        state.responses.put(StoredResponse(response, tuple(conversation)))

    def _instructions(self, message: ChatMessage) -> bool:
        return bool(self.body.instructions) and message is self.chat.messages[0]


def _earlier(state: ServerState, body: ResponsesRequest) -> tuple[ChatMessage, ...]:
    """The conversation of the stored response this request follows, if it names one."""
    if body.previous_response_id is None:
        return ()
    stored = state.responses.get(body.previous_response_id)
    if stored is None:
        raise ApiError(
            "invalid_request",
            f"previous_response_id: no stored response {body.previous_response_id!r} (this "
            "server keeps responses in memory, the last 1000, until it restarts)",
            "previous_response_id",
        )
    return stored.conversation


@router.post("/responses", response_model=None, responses=STREAMED)
async def responses(request: Request, body: ResponsesRequest) -> JSONResponse | StreamingResponse:
    model_id = accepted(request, body, body.model, RESPONSES)
    state = state_of(request)
    chat = _responses_chat(body, _earlier(state, body))
    generation = _responses_options(body).generation(model_id, chat, "input")
    shape = _ResponseShape(body, model_id, chat)
    if not body.stream:
        answer = await generation.run(request)
        status = "incomplete" if answer.last.finish_reason == "length" else "completed"
        shape.reasoning_tokens = answer.reasoning_tokens
        out = shape.response(status, shape.output(answer), answer.last)
        shape.keep(state, out)
        return JSONResponse(out)
    stream = await generation.stream(request)

    async def events() -> AsyncIterator[str]:
        seq = 0

        def event(kind: str, **fields: Any) -> str:
            nonlocal seq
            out = sse({"type": kind, "sequence_number": seq, **fields}, event=kind)
            seq += 1
            return out

        yield event("response.created", response=shape.response("in_progress", []))
        yield event("response.in_progress", response=shape.response("in_progress", []))
        output: list[dict[str, Any]] = []  # items done
        texts: list[str] = []
        logprobs: list[TokenLogprob] = []
        message: int | None = None  # the output index of the open message
        thought: int | None = None  # the output index of the open reasoning item
        thoughts: list[str] = []

        def close_thought() -> list[str]:
            nonlocal thought
            if thought is None:
                return []
            text = "".join(thoughts)
            item = shape.reasoning(text, "completed")
            output.append(item)
            at, thought = thought, None
            return [
                event("response.reasoning_text.done", item_id=shape.reasoning_id,
                      output_index=at, content_index=0, text=text),
                event("response.output_item.done", output_index=at, item=item),
            ]
        call: tuple[int, int, str, list[str]] | None = None  # output index, call index, name, args

        def close_message(status: str) -> list[str]:
            nonlocal message
            if message is None:
                return []
            at = {"item_id": shape.item_id, "output_index": message}
            text = "".join(texts)
            part = shape.part(text, logprobs)
            item = shape.item(status, [part])
            output.append(item)
            message = None
            return [
                event("response.output_text.done", **at, content_index=0, text=text,
                      logprobs=part["logprobs"]),
                event("response.content_part.done", **at, content_index=0, part=part),
                event("response.output_item.done", output_index=len(output) - 1, item=item),
            ]

        def close_call() -> list[str]:
            nonlocal call
            if call is None:
                return []
            index, n, name, args = call
            item = shape.call(n, name, "".join(args), "completed")
            output.append(item)
            call = None
            return [
                event("response.function_call_arguments.done", item_id=item["id"],
                      output_index=index, name=name, arguments=item["arguments"]),
                event("response.output_item.done", output_index=index, item=item),
            ]

        try:
            async for piece in stream:
                if piece.channel == "reasoning":
                    shape.reasoning_tokens += len(piece.token_ids)
                    if thought is None:
                        thought = len(output)
                        yield event("response.output_item.added", output_index=thought,
                                    item=shape.reasoning("", "in_progress"))
                    if piece.text:
                        thoughts.append(piece.text)
                        yield event("response.reasoning_text.delta", item_id=shape.reasoning_id,
                                    output_index=thought, content_index=0, delta=piece.text)
                elif piece.text or piece.logprobs:
                    if message is None:
                        for e in [*close_thought(), *close_call()]:
                            yield e
                        message = len(output)
                        yield event("response.output_item.added", output_index=message,
                                    item=shape.item("in_progress", []))
                        yield event("response.content_part.added", item_id=shape.item_id,
                                    output_index=message, content_index=0, part=shape.part(""))
                    texts.append(piece.text)
                    logprobs += piece.logprobs
                    yield event(
                        "response.output_text.delta", item_id=shape.item_id, output_index=message,
                        content_index=0, delta=piece.text,
                        logprobs=[logprob_entry(e) for e in piece.logprobs],
                    )
                for d in piece.tool_calls:
                    if d.name is not None:
                        for e in [*close_thought(), *close_message("completed"), *close_call()]:
                            yield e
                        call = (len(output), d.index, d.name, [])
                        yield event("response.output_item.added", output_index=call[0],
                                    item=shape.call(d.index, d.name, "", "in_progress"))
                    if call is not None and d.arguments:
                        call[3].append(d.arguments)
                        yield event("response.function_call_arguments.delta",
                                    item_id=shape.item_ids(0, call[1]), output_index=call[0],
                                    delta=d.arguments)
                if piece.finish_reason is None:
                    continue
                status = "incomplete" if piece.finish_reason == "length" else "completed"
                for e in close_thought():
                    yield e
                if len(output) == (1 if thoughts else 0) and message is None and call is None:
                    message = len(output)  # an empty answer: an empty message
                    yield event("response.output_item.added", output_index=message,
                                item=shape.item("in_progress", []))
                    yield event("response.content_part.added", item_id=shape.item_id,
                                output_index=message, content_index=0, part=shape.part(""))
                for e in [*close_message(status), *close_call()]:
                    yield e
                done = shape.response(status, output, piece)
                shape.keep(state, done)
                yield event(f"response.{status}", response=done)
        except Exception as e:
            err = stream.error(e)
            code = "model_not_found" if err.kind == "not_found" else err.kind
            yield event("error", code=code, message=err.message, param=err.param)
        finally:
            await stream.aclose()

    return StreamingResponse(events(), media_type="text/event-stream")


@router.get("/responses/{response_id}")
async def get_response(request: Request, response_id: str) -> dict[str, Any]:
    stored = state_of(request).responses.get(response_id)
    if stored is None:
        raise ApiError("not_found", f"no stored response {response_id!r}", "response_id")
    return stored.response


@router.delete("/responses/{response_id}")
async def delete_response(request: Request, response_id: str) -> dict[str, Any]:
    if not state_of(request).responses.delete(response_id):
        raise ApiError("not_found", f"no stored response {response_id!r}", "response_id")
    return {"id": response_id, "object": "response.deleted", "deleted": True}
