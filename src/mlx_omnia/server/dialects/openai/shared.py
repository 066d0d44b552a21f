"""What the OpenAI dialect's APIs share: the sampling fields of chat and legacy
completions and OpenAI's bounds on them, the request's model, their event streams, usage,
content parts."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from mlx_omnia import Bounds, Constraint, Piece, TokenLogprob, Usage
from mlx_omnia.server.dialects.common import Request as Body
from mlx_omnia.server.dialects.common import now, refuse_unknown, sse, token_text
from mlx_omnia.server.dialects.errors import error_body
from mlx_omnia.server.dialects.fields import Endpoint
from mlx_omnia.server.dialects.generation import (
    Options,
    Stream,
    documented,
    json_schema,
    merged,
)
from mlx_omnia.server.errors import ApiError
from mlx_omnia.server.state import state_of

R = TypeVar("R", bound=str)

# The most choices (n) a request may ask for, as OpenAI's API allows.
MAX_CHOICES = 128
# OpenAI's own bounds, tighter than the engine's (logprobs: chat's top_logprobs, alternatives a
# token).
LIMITS = {
    "max_tokens": Bounds(ge=1),
    "temperature": Bounds(le=2.0),
    "presence_penalty": Bounds(ge=-2.0, le=2.0),
    "frequency_penalty": Bounds(ge=-2.0, le=2.0),
    "logit_bias": Bounds(ge=-100.0, le=100.0),
    "stop": Bounds(max_items=4, nonempty=True),
    "logprobs": Bounds(le=20),
}


def accepted(request: Request, body: BaseModel, model: str | None, endpoint: Endpoint) -> str:
    """The canonical id of `model`, for a request whose unknown fields are all ones the
    `endpoint` ignores (they cannot change the output) or null; any other one is refused by
    name."""
    nulls = tuple(name for name, value in (body.model_extra or {}).items() if value is None)
    refuse_unknown(body, (*endpoint.ignored(), *nulls))
    return state_of(request).manager.check_id(model)


def role_of(roles: Mapping[str, R], message: Mapping[str, Any], where: str) -> R:
    role = roles.get(str(message.get("role")))
    if role is None:
        raise ApiError(
            "invalid_request", f"{where}.role {message.get('role')!r} is not valid", f"{where}.role"
        )
    return role


def refuse_tools(tools: list[Any] | None, tool_choice: object) -> None:
    if tools:
        raise ApiError("invalid_request", "tools are not supported yet", "tools")
    if tool_choice not in (None, "none", "auto"):
        raise ApiError(
            "invalid_request", "tool_choice needs tools, which are not supported yet", "tool_choice"
        )


class StreamOptions(BaseModel):
    include_usage: StrictBool | None = False
    include_obfuscation: StrictBool | None = None  # harmless: only pads stream events


class Sampling(Body):
    """Fields shared by chat and legacy completions (the schema documents the bounds that
    `sampling_options` checks; a model's own, such as its context length, only it knows)."""

    model: StrictStr
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: StrictInt | None = Field(None, json_schema_extra=documented("max_tokens", LIMITS))
    temperature: StrictFloat | None = Field(
        None, json_schema_extra=documented("temperature", LIMITS)
    )
    top_p: StrictFloat | None = Field(None, json_schema_extra=documented("top_p", LIMITS))
    stop: StrictStr | list[StrictStr] | None = Field(
        None, json_schema_extra=documented("stop", LIMITS, single=True)
    )
    seed: StrictInt | None = Field(None, json_schema_extra=documented("seed", LIMITS))
    presence_penalty: StrictFloat | None = Field(
        None, json_schema_extra=documented("presence_penalty", LIMITS)
    )
    frequency_penalty: StrictFloat | None = Field(
        None, json_schema_extra=documented("frequency_penalty", LIMITS)
    )
    logit_bias: dict[str, StrictFloat] | None = Field(
        None,
        json_schema_extra={
            **documented("logit_bias", LIMITS), "propertyNames": {"pattern": "^[0-9]+$"}
        },
    )
    n: StrictInt | None = Field(None, json_schema_extra={"minimum": 1, "maximum": MAX_CHOICES})
    kv_bits: StrictInt | None = Field(None, json_schema_extra=documented("kv_bits"))


def sampling_options(body: Sampling, limits: Mapping[str, Bounds]) -> Options:
    """The options of the fields chat and legacy completions share, under OpenAI's `limits`."""
    if body.n is not None and not 1 <= body.n <= MAX_CHOICES:
        raise ApiError("invalid_request", f"n must be between 1 and {MAX_CHOICES}", "n")
    if body.stream_options is not None and not body.stream:
        raise ApiError(
            "invalid_request",
            "stream_options is only allowed when stream is true",
            "stream_options",
        )
    bias: dict[int, float] = {}
    for key, value in (body.logit_bias or {}).items():
        if not (key.isascii() and key.isdigit()):
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
    options.set("kv_bits", body.kv_bits)
    return options


def logprob_entry(entry: TokenLogprob) -> dict[str, Any]:
    """One generated token's log-probability and the likeliest alternatives (chat's and the
    Responses API's shape: text, exact bytes, logprob)."""
    return {
        "token": token_text(entry.token_bytes),
        "logprob": entry.logprob,
        "bytes": list(entry.token_bytes),
        "top_logprobs": [
            {"token": token_text(t.token_bytes), "logprob": t.logprob, "bytes": list(t.token_bytes)}
            for t in entry.top
        ],
    }


def usage_of(*usages: Usage, reasoning_tokens: int = 0) -> dict[str, Any]:
    """The usage of one answer, or of n choices to one prompt (its tokens, and those the prefix
    cache supplied, counted once); `reasoning_tokens`: the completion tokens that were reasoning."""
    prompt = usages[0].prompt_tokens
    completion = sum(u.completion_tokens for u in usages)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": usages[0].cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": reasoning_tokens},
    }


EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def thinking_of(effort: object, where: str) -> bool | None:
    """A reasoning_effort as a thinking template's switch: "none" turns thinking off, any other
    effort on (and reaches templates that read it), no effort leaves the template's default."""
    if effort is None:
        return None
    if effort not in EFFORTS:
        raise ApiError(
            "invalid_request", f"{where} must be one of {', '.join(EFFORTS)}", where
        )
    return effort != "none"


@dataclass(frozen=True)
class Reply:
    """One answer's objects (the whole chat completion or completion, or each chunk): its id, the
    time it was created and the model, then the one choice."""

    id: str
    model: str
    created: int = field(default_factory=now)

    def __call__(self, object: str, **choice: Any) -> dict[str, Any]:
        return self.of(object, [choice])

    def of(self, object: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }


def events(
    streams: Sequence[Stream],
    chunk_of: Callable[[Piece, int, int], dict[str, Any]],
    finish: Callable[[int, str | None], dict[str, Any]],
    options: StreamOptions | None,
    opening: Callable[[int], dict[str, Any]] | None = None,
) -> StreamingResponse:
    """Server-sent events of chat or legacy completion chunks of n choices (one stream each):
    each choice's `opening`, then `chunk_of` each piece with text or log-probabilities (with its
    choice's index and the characters sent before it) as pieces come, each choice's `finish`
    chunk with its reason and, with options.include_usage, one with the usage of all; an error
    object if generation fails on the way; [DONE]."""
    include_usage = bool(options and options.include_usage)

    async def lines() -> AsyncIterator[str]:
        if opening is not None:
            for i in range(len(streams)):
                yield sse(opening(i))
        sent = [0] * len(streams)
        usages: list[Usage] = []
        reasoning = 0
        pieces = merged(streams)
        try:
            async for i, piece in pieces:
                if piece.channel == "reasoning":
                    reasoning += len(piece.token_ids)
                if piece.text or piece.logprobs or piece.tool_calls:
                    yield sse(chunk_of(piece, i, sent[i]))
                    sent[i] += len(piece.text) if piece.channel == "content" else 0
                if piece.finish_reason is None:
                    continue
                yield sse(finish(i, piece.finish_reason))
                if piece.usage is not None:
                    usages.append(piece.usage)
            if include_usage and usages:
                usage = usage_of(*usages, reasoning_tokens=reasoning)
                yield sse({**finish(0, None), "choices": [], "usage": usage})
        except Exception as e:
            yield sse(error_body("openai", streams[0].error(e)))
        finally:
            await pieces.aclose()
        yield sse("[DONE]")

    return StreamingResponse(lines(), media_type="text/event-stream")


def as_dict(value: object) -> dict[str, Any] | None:
    return cast("dict[str, Any]", value) if isinstance(value, dict) else None


def parts_of(content: object, where: str) -> list[dict[str, Any] | None]:
    if not isinstance(content, list):
        raise ApiError(
            "invalid_request", f"{where} must be a string or a list of content parts", where
        )
    return [as_dict(part) for part in cast("list[object]", content)]


def refuse_part(part: dict[str, Any] | None, where: str, allowed: str) -> ApiError:
    kind = part.get("type") if part is not None else None
    return ApiError(
        "invalid_request",
        f"{where}: content part {kind!r} is not supported by this model ({allowed} only)",
        where,
    )


# A json_schema format's name, as OpenAI allows it.
SCHEMA_NAME = "^[a-zA-Z0-9_-]{1,64}$"
# The keys of a json_schema format (nested in chat's response_format.json_schema, flat beside
# `type` in Responses' text.format). `strict` true or false, the schema is enforced all the
# same: decoding is masked by the grammar, so strict mode is the only mode. `description` says
# what the format is for; the schema, which is enforced, says what it is.
SCHEMA_KEYS = ("name", "schema", "strict", "description")


def format_schema(flat: bool) -> dict[str, Any]:
    """The OpenAPI documentation of what `output_format` takes (or null): text, json_object or
    json_schema, its keys nested under `json_schema` (chat) or `flat` beside `type` (Responses,
    where the schema is required)."""

    def kind(type: str, required: tuple[str, ...] = (), **more: Any) -> dict[str, Any]:
        return {
            "type": "object",
            "properties": {"type": {"const": type}, **more},
            "required": ["type", *required],
            "additionalProperties": False,
        }

    keys: dict[str, Any] = {
        "name": {"type": "string", "pattern": SCHEMA_NAME},
        "schema": {"type": "object"} if flat else {"anyOf": [{"type": "object"}, {"type": "null"}]},
        "strict": {"anyOf": [{"type": "boolean"}, {"type": "null"}]},
        "description": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    }
    if flat:
        json_kind = kind("json_schema", ("name", "schema"), **keys)
    else:
        nested = {
            "type": "object", "properties": keys, "required": ["name"],
            "additionalProperties": False,
        }
        json_kind = kind("json_schema", ("json_schema",), json_schema=nested)
    return {"anyOf": [kind("text"), kind("json_object"), json_kind, {"type": "null"}]}


def output_format(fmt: object, where: str, options: Options, *, flat: bool) -> None:
    """Constrain `options` to an OpenAI output format (chat's response_format, Responses'
    text.format): text, json_object (any JSON object) or json_schema (JSON valid under its
    schema; its keys nested under `json_schema` or `flat` beside `type`); refused by name."""
    entry = as_dict(fmt)
    kind = entry.get("type") if entry is not None else None
    if entry is None or kind not in ("text", "json_object", "json_schema"):
        raise ApiError(
            "invalid_request",
            f"{where}.type must be 'text', 'json_object' or 'json_schema'",
            f"{where}.type",
        )
    if kind != "json_schema":
        _only(entry, ("type",), where)
        if kind == "json_object":
            options.set("constraint", Constraint.json_schema(), where)
        return
    at = where if flat else f"{where}.json_schema"
    spec = entry if flat else as_dict(entry.get("json_schema"))
    if not flat:
        _only(entry, ("type", "json_schema"), where)
    if spec is None:
        raise ApiError("invalid_request", f"{at} must be an object", at)
    _only(spec, ("type", *SCHEMA_KEYS) if flat else SCHEMA_KEYS, at)
    name = spec.get("name")
    if not isinstance(name, str) or not re.fullmatch(SCHEMA_NAME, name):
        raise ApiError(
            "invalid_request",
            f"{at}.name must be 1-64 letters, digits, '_' or '-'",
            f"{at}.name",
        )
    for key, kinds, noun in (("strict", bool, "a boolean"), ("description", str, "a string")):
        if spec.get(key) is not None and not isinstance(spec[key], kinds):
            raise ApiError("invalid_request", f"{at}.{key} must be {noun}", f"{at}.{key}")
    schema = spec.get("schema")
    if schema is None and flat:
        raise ApiError("invalid_request", f"{at}.schema is required", f"{at}.schema")
    if schema is None:  # chat's may be left out: then any JSON object, as json_object mode
        schema = {"type": "object"}
    options.set("constraint", json_schema(schema, f"{at}.schema"), f"{at}.schema")


def _only(entry: Mapping[str, Any], keys: tuple[str, ...], where: str) -> None:
    for key in entry:
        if key not in keys:
            raise ApiError(
                "invalid_request", f"{where}.{key} is not supported by this server", f"{where}.{key}"
            )
