"""Gemini dialect, under /api/gemini/v1beta.

Routes: GET /models, GET /models/{model}, POST /models/{model}:generateContent,
POST /models/{model}:streamGenerateContent (SSE with ?alt=sse, else a streamed JSON array) and
POST /models/{model}:countTokens. A model id may hold a slash (a hub repo id such as
"acme/tiny"): the path up to the method's ':' is the model.

Field names are lowerCamelCase on the wire; snake_case spellings (which Google's JSON parser
also accepts) are read as their camelCase twins. A null field counts as absent."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, TypeVar, cast

from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.convertors import Convertor, register_url_convertor

from mlx_omnia import (
    Bounds,
    Chat,
    ChatMessage,
    Constraint,
    Model,
    TextPart,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    Usage,
)
from mlx_omnia.server.dialects.common import SSE_EVENT, model_ids, sse, token_text
from mlx_omnia.server.dialects.errors import error_body
from mlx_omnia.server.dialects.fields import GENERATE
from mlx_omnia.server.dialects.generation import (
    Generation,
    Options,
    Stream,
    documented,
    json_schema,
    merged,
    run_all,
    stream_all,
)
from mlx_omnia.server.dialects.tools import arguments_object, declared, function_tool, unique
from mlx_omnia.server.errors import ApiError
from mlx_omnia.server.state import ServerState, state_of


class _ModelName(Convertor[str]):
    """A model in a path: it may hold '/' (a hub id), never ':' (which starts a method)."""

    regex = "[^:]+"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


class _MethodPath(_ModelName):
    """A model and a method after its ':', for the answer to a method that does not exist."""

    regex = "[^:]*:.*"


register_url_convertor("gemini_model", _ModelName())
register_url_convertor("gemini_method", _MethodPath())
# The OpenAPI schema's word for a model in a path.
MODEL_NAME: dict[str, Any] = {"pattern": f"^{_ModelName.regex}$"}
router = APIRouter()

METHODS = ("generateContent", "streamGenerateContent", "countTokens")

# What each field is (fields.py says why): the request's own fields, those ignored because
# they cannot change the output, and those of generationConfig, parts, function declarations
# and toolConfig the parsing below takes.
FIELDS = GENERATE.names("honoured")
HARMLESS = GENERATE.names("ignored")
HARMLESS_CONFIG = GENERATE.names("ignored", under="generationConfig")
PART_KEYS = GENERATE.names("honoured", "ignored", under="contents[].parts[]")
# Part fields that carry (or describe) non-text content: refused with a message saying so.
MEDIA_PARTS = GENERATE.names("refused", under="contents[].parts[]")
DECLARATION_KEYS = GENERATE.names(
    "honoured", "ignored", under="tools[].functionDeclarations[]"
)
TOOL_CONFIG_KEYS = GENERATE.names("honoured", "ignored", under="toolConfig")
CALLING_KEYS = GENERATE.names("honoured", "ignored", under="toolConfig.functionCallingConfig")
ToolChoice = Literal["auto", "none", "required"]
# Gemini's own bounds, tighter than the engine's.
LIMITS = {"max_tokens": Bounds(ge=1), "stop": Bounds(max_items=5, nonempty=True)}
# generationConfig's fields that are GenerationOptions fields: numbers, integers.
NUMBERS = {
    "temperature": "temperature",
    "topP": "top_p",
    "presencePenalty": "presence_penalty",
    "frequencyPenalty": "frequency_penalty",
}
INTEGERS = {"topK": "top_k", "maxOutputTokens": "max_tokens", "seed": "seed", "kvBits": "kv_bits"}
# An integer written as a string (Google's JSON parser takes int64 so); ASCII digits only.
INT_STRING = "-?[0-9]+"
MAX_CANDIDATES = 8  # candidateCount, as Gemini's API allows
# responseMimeType: text, JSON (any, or under a schema), one of an enum schema's values.
MIME_TYPES = ("", "text/plain", "application/json", "text/x.enum")
# JSON mode without a schema: an object or an array (a bare number or string is valid JSON,
# but no one asks JSON mode for one, and a small model could stop after it).
JSON_VALUE: dict[str, Any] = {"anyOf": [{"type": "object"}, {"type": "array"}]}
DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 1000

FINISH: dict[str, str] = {"stop": "STOP", "length": "MAX_TOKENS", "tool_calls": "STOP"}

T = TypeVar("T")


# -- request parsing ---------------------------------------------------------------------------


def _bad(message: str, field: str) -> ApiError:
    return ApiError("invalid_request", message, field)


def _camel(key: str) -> str:
    if "_" not in key.strip("_"):
        return key
    head, *rest = key.split("_")
    return head + "".join(p[:1].upper() + p[1:] for p in rest)


def _obj(value: object, where: str) -> dict[str, Any]:
    """A JSON object with camelCase keys, null members dropped."""
    if not isinstance(value, dict):
        raise _bad(f"{where} must be an object", where)
    raw = cast(dict[Any, Any], value)
    return {_camel(str(k)): v for k, v in raw.items() if v is not None}


def _list(value: object, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise _bad(f"{where} must be a list", where)
    return cast(list[Any], value)


def _int(value: object, where: str) -> int:
    # JSON numbers such as 16.0 are fine; Google's parser also accepts int64 as a string.
    if isinstance(value, bool):
        raise _bad(f"{where} must be an integer", where)
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and re.fullmatch(INT_STRING, value):
        return int(value)
    raise _bad(f"{where} must be an integer", where)


def _float(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _bad(f"{where} must be a number", where)
    return float(value)


def _str(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise _bad(f"{where} must be a string", where)
    return value


def _unknown(name: str, where: str = "") -> ApiError:
    field = f"{where}.{name}" if where else name
    return _bad(f"field {field!r} is not supported by this server", field)


def _texts(content: object, where: str) -> tuple[str | None, list[str]]:
    """The role and the text parts of one Content (a system instruction's)."""
    role, parts = _parts(content, where)
    for j, part in enumerate(parts):
        if not isinstance(part, str):
            at = f"{where}.parts[{j}]"
            raise _bad(f"{at} must have a text field (only text parts are supported)", at)
    return role, cast(list[str], parts)


Part = str | tuple[Literal["functionCall", "functionResponse"], dict[str, Any]]


def _parts(content: object, where: str) -> tuple[str | None, list[Part]]:
    """The role and the parts of one Content: texts, function calls and responses; thoughts
    of earlier turns are dropped (templates drop them too)."""
    c = _obj(content, where)
    for key in c:
        if key not in ("role", "parts"):
            raise _unknown(key, where)
    role = _str(c["role"], f"{where}.role") if "role" in c else None
    parts = _list(c.get("parts", []), f"{where}.parts")
    if not parts:
        raise _bad(f"{where}.parts must hold at least one part", f"{where}.parts")
    out: list[Part] = []
    for j, raw in enumerate(parts):
        at = f"{where}.parts[{j}]"
        part = _obj(raw, at)
        kinds = [k for k in part if k in ("text", "functionCall", "functionResponse")]
        for key in part:
            if key in MEDIA_PARTS:
                raise _bad(
                    f"{at}.{key}: only text and function parts are supported by this model",
                    f"{at}.{key}",
                )
            if key not in PART_KEYS:
                raise _unknown(key, at)
        if len(kinds) != 1:
            raise _bad(f"{at} must have one of text, functionCall or functionResponse", at)
        if part.get("thought") is True:
            continue
        if kinds[0] == "text":
            out.append(_str(part["text"], f"{at}.text"))
            continue
        value = _obj(part[kinds[0]], f"{at}.{kinds[0]}")
        _str(value.get("name"), f"{at}.{kinds[0]}.name")
        out.append((cast(Literal["functionCall", "functionResponse"], kinds[0]), value))
    return role, out


def _turns(role: str | None, parts: list[Part], where: str) -> list[ChatMessage]:
    """One Content as the engine's turns: a model's calls as an assistant's tool_calls, a
    user's function responses as tool turns (before its text)."""
    texts = [p for p in parts if isinstance(p, str)]
    calls: list[dict[str, Any]] = []
    results: list[ChatMessage] = []
    for j, part in enumerate(parts):
        if isinstance(part, str):
            continue
        kind, value = part
        at = f"{where}.parts[{j}].{kind}"
        if kind == "functionCall" and role == "model":
            args = _obj(value.get("args", {}), f"{at}.args") if "args" in value else {}
            calls.append({"id": str(value.get("id", "")), "type": "function", "function": {
                "name": value["name"], "arguments": json.dumps(args, ensure_ascii=False)}})
        elif kind == "functionResponse" and role in (None, "", "user", "function", "tool"):
            response = _obj(value.get("response", {}), f"{at}.response")
            results.append({"role": "tool", "tool_call_id": str(value.get("id", "")),
                            "name": value["name"], "content": json.dumps(response, ensure_ascii=False)})
        else:
            raise _bad(f"{at}: a {kind} part cannot be in a {role or 'user'} turn", at)
    if role == "model":
        message = ChatMessage(role="assistant", content=_content_of(texts))
        if calls:
            message["tool_calls"] = calls
        return [message]
    turns = list(results)
    if texts or not results:
        turns.append(ChatMessage(role="user", content=_content_of(texts)))
    return turns


def _content_of(texts: list[str]) -> str | list[TextPart]:
    if len(texts) <= 1:
        return texts[0] if texts else ""
    return [{"type": "text", "text": t} for t in texts]


def _system(value: object) -> ChatMessage:
    where = "systemInstruction"
    if isinstance(value, str):  # lenient: a bare string
        return ChatMessage(role="system", content=value)
    role, texts = _texts(value, where)
    if role not in (None, "", "user", "system"):
        raise _bad(f"{where}.role {role!r} is not valid", f"{where}.role")
    return ChatMessage(role="system", content=_content_of(texts))


def chat_of(body: dict[str, Any]) -> Chat:
    contents = _list(body.get("contents", []), "contents")
    if not contents:
        raise _bad("contents must not be empty", "contents")
    messages: list[ChatMessage] = []
    if "systemInstruction" in body:
        messages.append(_system(body["systemInstruction"]))
    for i, content in enumerate(contents):
        where = f"contents[{i}]"
        role, parts = _parts(content, where)
        if role not in (None, "", "user", "model", "function", "tool"):
            raise _bad(
                f"{where}.role {role!r} is not valid (use 'user' or 'model')", f"{where}.role"
            )
        messages += _turns(role, parts, where)
    tools = _tools(body.get("tools", []))
    choice, allowed = _tool_config(body.get("toolConfig", {}), tools)
    return Chat(tuple(messages), tools, choice, allowed)


def _tools(value: object) -> tuple[dict[str, Any], ...]:
    """Every functionDeclaration of `tools` in the engine's shape; other tools refused."""
    out: list[dict[str, Any]] = []
    for i, raw in enumerate(_list(value, "tools")):
        where = f"tools[{i}]"
        tool = _obj(raw, where)
        for key, v in tool.items():
            if key != "functionDeclarations":
                raise _bad(
                    f"{where}.{key}: only functionDeclarations are supported by this server",
                    f"{where}.{key}",
                )
            for j, d in enumerate(_list(v, f"{where}.{key}")):
                at = f"{where}.functionDeclarations[{j}]"
                declaration = _obj(d, at)
                for name in declaration:
                    if name not in DECLARATION_KEYS:
                        raise _unknown(name, at)
                if "parameters" in declaration and "parametersJsonSchema" in declaration:
                    raise _bad(f"{at}: send parameters or parametersJsonSchema, not both", at)
                schema = declaration.get("parametersJsonSchema")
                if "parameters" in declaration:
                    schema = _json_schema(declaration["parameters"], f"{at}.parameters")
                out.append(function_tool(
                    declaration.get("name"), declaration.get("description"), schema, at
                ))
    return unique(out, "tools")


def _json_schema(value: object, where: str) -> dict[str, Any]:
    """A Gemini Schema (OpenAPI's subset: upper-case types, nullable, propertyOrdering) as JSON
    Schema: properties in propertyOrdering's order (the order an answer writes them in), no
    others."""
    schema = _obj(value, where)
    out: dict[str, Any] = {}
    for key, v in schema.items():
        at = f"{where}.{key}"
        if key == "type":
            out["type"] = _str(v, at).lower()
        elif key in ("properties", "$defs", "defs"):
            out["$defs" if key != "properties" else key] = {
                str(k): _json_schema(s, f"{at}.{k}") for k, s in _obj(v, at).items()
            }
        elif key == "items" or (key == "additionalProperties" and isinstance(v, dict)):
            out[key] = _json_schema(cast(object, v), at)
        elif key == "anyOf":
            out[key] = [_json_schema(s, f"{at}[{n}]") for n, s in enumerate(_list(v, at))]
        elif key in ("minItems", "maxItems", "minLength", "maxLength", "minProperties",
                     "maxProperties"):
            out[key] = _int(v, at)
        elif key == "ref":
            out["$ref"] = v
        elif key in ("nullable", "propertyOrdering", "title", "example") or (
            key == "format" and v == "enum"  # Gemini's mark of a string enum: `enum` says it
        ):
            continue
        else:
            out[key] = v
    if schema.get("nullable") is True:
        if isinstance(out.get("type"), str):
            out["type"] = [out["type"], "null"]
        if isinstance(out.get("enum"), list):
            out["enum"] = [*cast(list[object], out["enum"]), None]
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False  # a Gemini object holds the properties it declares
    if "propertyOrdering" in schema and isinstance(out.get("properties"), dict):
        out["properties"] = _ordered(
            cast(dict[str, Any], out["properties"]), schema["propertyOrdering"], where
        )
    return out


def _ordered(properties: dict[str, Any], order: object, where: str) -> dict[str, Any]:
    """`properties` in the order propertyOrdering names them (any it leaves out after)."""
    at = f"{where}.propertyOrdering"
    names = [_str(n, f"{at}[{i}]") for i, n in enumerate(_list(order, at))]
    for i, name in enumerate(names):
        if name not in properties:
            raise _bad(f"{at}[{i}] names {name!r}, which is not in properties", f"{at}[{i}]")
    return {**{n: properties[n] for n in names}, **properties}


def _tool_config(value: object, tools: tuple[dict[str, Any], ...]) -> tuple[ToolChoice, tuple[str, ...]]:
    """toolConfig.functionCallingConfig: AUTO (or VALIDATED), ANY (with allowed names), NONE."""
    where = "toolConfig"
    config = _obj(value, where)
    for key in config:
        if key not in TOOL_CONFIG_KEYS:
            raise _unknown(key, where)
    calling = _obj(config.get("functionCallingConfig", {}), f"{where}.functionCallingConfig")
    at = f"{where}.functionCallingConfig"
    for key in calling:
        if key not in CALLING_KEYS:
            raise _unknown(key, at)
    mode = _str(calling.get("mode", "AUTO"), f"{at}.mode")
    names = tuple(
        declared(n, tools, f"{at}.allowedFunctionNames[{i}]")
        for i, n in enumerate(_list(calling.get("allowedFunctionNames", []), f"{at}.allowedFunctionNames"))
    )
    if mode in ("AUTO", "VALIDATED", "MODE_UNSPECIFIED"):
        if names:
            raise _bad(f"{at}.allowedFunctionNames is only valid with mode ANY", f"{at}.allowedFunctionNames")
        return "auto", ()
    if mode == "NONE":
        return "none", ()
    if mode == "ANY":
        if not tools:
            raise _bad(f"{at}.mode ANY needs functionDeclarations in tools", f"{at}.mode")
        return "required", names
    raise _bad(f"{at}.mode must be AUTO, ANY, NONE or VALIDATED", f"{at}.mode")


@dataclass(frozen=True)
class Thinking:
    """A thinkingConfig in engine terms: the template's switch (None: its default), the effort
    a level names, a budget of reasoning tokens, and whether thoughts come back as parts."""

    thinking: bool | None = None
    effort: str | None = None
    budget: int | None = None
    include: bool = False


def _thinking(value: object, where: str) -> Thinking:
    """thinkingBudget 0 turns thinking off, -1 leaves it unbounded, N > 0 bounds it to N tokens;
    a thinkingLevel turns it on (and reaches templates that read an effort)."""
    cfg = _obj(value, where)
    out = Thinking()
    for key, v in cfg.items():
        if key == "thinkingBudget":
            budget = _int(v, f"{where}.thinkingBudget")
            if budget < -1:
                raise _bad(f"{where}.thinkingBudget must be -1, 0 or more", f"{where}.thinkingBudget")
            out = replace(out, thinking=budget != 0, budget=budget if budget > 0 else None)
        elif key == "includeThoughts":
            if not isinstance(v, bool):
                raise _bad(f"{where}.includeThoughts must be a boolean", f"{where}.includeThoughts")
            out = replace(out, include=v)
        elif key == "thinkingLevel":
            level = _str(v, f"{where}.thinkingLevel").lower()
            if level not in ("minimal", "low", "medium", "high", "thinking_level_unspecified"):
                raise _bad(f"{where}.thinkingLevel must be MINIMAL, LOW, MEDIUM or HIGH",
                           f"{where}.thinkingLevel")
            if level != "thinking_level_unspecified":
                out = replace(out, thinking=True if out.thinking is None else out.thinking,
                              effort=level)
        else:
            raise _unknown(key, where)
    return out


def options_of(value: object) -> tuple[Options, int, Thinking]:
    """The generation options of a generationConfig, its candidateCount and thinkingConfig."""
    where = "generationConfig"
    cfg = _obj(value, where)
    options = Options(LIMITS)
    count = 1
    thinking = Thinking()
    want_logprobs, top = False, None
    for key, v in cfg.items():
        at = f"{where}.{key}"
        if key in NUMBERS:
            options.set(NUMBERS[key], _float(v, at), at)
        elif key in INTEGERS:
            options.set(INTEGERS[key], _int(v, at), at)
        elif key == "stopSequences":
            options.set("stop", [_str(s, f"{at}[{i}]") for i, s in enumerate(_list(v, at))], at)
        elif key == "candidateCount":
            count = _int(v, at)
            if not 1 <= count <= MAX_CANDIDATES:
                raise _bad(f"{at} must be between 1 and {MAX_CANDIDATES}", at)
        elif key == "responseMimeType":
            if _str(v, at) not in MIME_TYPES:
                raise _bad(f"{at}: must be one of {', '.join(t for t in MIME_TYPES if t)}", at)
        elif key == "responseModalities":
            modes = [_str(m, f"{at}[{i}]").upper() for i, m in enumerate(_list(v, at))]
            if any(m != "TEXT" for m in modes):
                raise _bad(f"{at}: only the TEXT modality is supported", at)
        elif key == "responseLogprobs":
            if not isinstance(v, bool):
                raise _bad(f"{at} must be a boolean", at)
            want_logprobs = v
        elif key == "logprobs":
            top = _int(v, at)
        elif key in ("enableEnhancedCivicAnswers", "audioTimestamp"):
            if v is not False:
                raise _bad(f"{at} is not supported by this server", at)
        elif key == "thinkingConfig":
            thinking = _thinking(v, at)
            options.set("reasoning_budget", thinking.budget, f"{at}.thinkingBudget")
        elif key not in HARMLESS_CONFIG and key not in ("responseSchema", "responseJsonSchema"):
            # speechConfig, imageConfig, ...
            raise _unknown(key, where)
    if top is not None and not want_logprobs:
        at = f"{where}.logprobs"
        raise _bad(f"{at} is only valid when responseLogprobs is true", at)
    if want_logprobs:
        options.set("logprobs", top or 0, f"{where}.logprobs")
    _response_format(cfg, options)
    return options, count, thinking


def _response_format(cfg: dict[str, Any], options: Options) -> None:
    """responseMimeType with responseSchema (Gemini's Schema) or responseJsonSchema (JSON
    Schema, as sent) as a constraint: application/json without a schema is any JSON object or
    array (what JSON mode is asked for), with one JSON valid under it; text/x.enum is one of a
    string enum schema's values, as plain text. A schema needs one of these types, as Gemini
    says."""
    where = "generationConfig"
    mime = cfg.get("responseMimeType", "")
    keys = [k for k in ("responseSchema", "responseJsonSchema") if k in cfg]
    if len(keys) > 1:
        raise _bad(f"{where}: send responseSchema or responseJsonSchema, not both", f"{where}.{keys[1]}")
    at = f"{where}.{keys[0]}" if keys else f"{where}.responseMimeType"
    schema: object = None
    if keys == ["responseSchema"]:
        schema = _json_schema(cfg["responseSchema"], at)
    elif keys:
        schema = cfg["responseJsonSchema"]
    if mime in ("", "text/plain"):
        if schema is not None:
            raise _bad(f"{at} needs responseMimeType 'application/json' or 'text/x.enum'", at)
        return
    if mime == "application/json":
        options.set("constraint", json_schema(JSON_VALUE if schema is None else schema, at), at)
        return
    pattern = "|".join(_regex_literal(value) for value in _enum(schema, at))
    options.set("constraint", Constraint.regex(pattern), at)


def _enum(schema: object, where: str) -> list[str]:
    """The values of a string enum schema (what text/x.enum answers with one of)."""
    values = cast(dict[str, object], schema).get("enum") if isinstance(schema, dict) else None
    if isinstance(values, list):
        items = cast(list[object], values)
        strings = [v for v in items if isinstance(v, str)]
        if strings and len(strings) == len(items):
            return strings
    raise _bad(f"{where}: responseMimeType 'text/x.enum' needs a schema with a string enum", where)


def _regex_literal(text: str) -> str:
    """`text` matched literally in a Rust regex: ASCII punctuation escaped (which that syntax
    allows, but for '<' and '>', which it reads as word boundaries), control characters as hex."""
    out: list[str] = []
    for c in text:
        if c.isalnum() or c in " _<>" or not c.isascii():
            out.append(c)
        elif c.isprintable():
            out.append("\\" + c)
        else:
            out.append(f"\\x{{{ord(c):x}}}")
    return "".join(out)


@dataclass(frozen=True)
class Parsed:
    chat: Chat
    options: Options
    candidates: int = 1
    thoughts: bool = False  # reasoning comes back as thought parts


def parse_generate(body: dict[str, Any], where: str = "") -> Parsed:
    """A GenerateContentRequest: every field honoured or refused by name."""
    for key in body:
        if key not in FIELDS | HARMLESS:
            raise _unknown(key, where)
    try:
        options, candidates, thinking = options_of(body.get("generationConfig", {}))
        chat = replace(chat_of(body), thinking=thinking.thinking, reasoning_effort=thinking.effort)
        options.checked()
    except ApiError as e:
        if where and e.param:
            e.message, e.param = f"in {where}: {e.message}", f"{where}.{e.param}"
        raise
    return Parsed(chat, options, candidates, thinking.include)


async def _json_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ApiError("invalid_request", "the request body is not valid JSON") from None
    if not isinstance(data, dict):
        raise ApiError("invalid_request", "the request body must be a JSON object")
    return _obj(cast(object, data), "body")


# -- models ------------------------------------------------------------------------------------


def _model_id(state: ServerState, name: str) -> str:
    name = name.removeprefix("models/")
    if not name:
        raise ApiError("not_found", "no model named in the path", "model")
    return state.manager.check_id(name)


async def _with_model(state: ServerState, model_id: str, fn: Callable[[Model], T]) -> T:
    """Run `fn` on the model (loading it on the engine thread if needed) off the event loop."""
    return await state.with_model(model_id, fn)


def _model_entry(model_id: str, model: Model | None) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "name": f"models/{model_id}",
        "baseModelId": model_id,
        "version": "1",
        "displayName": model_id,
        "description": f"{model_id}, served by mlx-omnia",
        "supportedGenerationMethods": list(METHODS),
    }
    if model is not None:
        limit = model.signature.context_length
        d = model.defaults
        entry.update({
            "inputTokenLimit": limit,
            "outputTokenLimit": limit,  # maxOutputTokens above it is refused
            "temperature": d.temperature if d.do_sample else 0.0,
            "maxTemperature": 2.0,
            "topP": d.top_p if d.do_sample else 1.0,
            "topK": d.top_k if d.do_sample else 0,
        })
    return entry


@router.get("/models")
async def list_models(
    request: Request,
    page_size: int | None = Query(None, alias="pageSize"),
    page_token: str | None = Query(None, alias="pageToken"),
) -> dict[str, Any]:
    state = state_of(request)
    resident = {r.id: r.model for r in state.manager.resident()}
    ids = model_ids(state)
    size = DEFAULT_PAGE_SIZE if not page_size or page_size <= 0 else min(page_size, MAX_PAGE_SIZE)
    start = 0
    if page_token:
        if not re.fullmatch("[0-9]+", page_token):
            raise _bad("pageToken is not valid", "pageToken")
        start = int(page_token)
    page = ids[start : start + size]
    out: dict[str, Any] = {"models": [_model_entry(i, resident.get(i)) for i in page]}
    if start + size < len(ids):
        out["nextPageToken"] = str(start + size)
    return out


# -- generation --------------------------------------------------------------------------------


def _usage_of(usages: Sequence[Usage], thoughts: int = 0) -> dict[str, Any]:
    """The usage of the candidates to one prompt (its tokens, and those the prefix cache
    supplied, counted once); `thoughts`: the generated tokens that were reasoning (Gemini counts
    them apart from the candidates')."""
    prompt, cached = usages[0].prompt_tokens, usages[0].cached_tokens
    candidates = sum(u.completion_tokens for u in usages)
    out: dict[str, Any] = {
        "promptTokenCount": prompt,
        "candidatesTokenCount": candidates - thoughts,
        "totalTokenCount": prompt + candidates,
        "promptTokensDetails": [{"modality": "TEXT", "tokenCount": prompt}],
    }
    if cached:  # as Gemini's implicit caching: part of promptTokenCount, absent when none
        out["cachedContentTokenCount"] = cached
        out["cacheTokensDetails"] = [{"modality": "TEXT", "tokenCount": cached}]
    if thoughts:
        out["thoughtsTokenCount"] = thoughts
    return out


def _logprob(token_id: int, token_bytes: bytes, logprob: float) -> dict[str, Any]:
    return {"token": token_text(token_bytes), "tokenId": token_id, "logProbability": logprob}


def logprobs_result(entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """A candidate's logprobsResult: the chosen token of each step and the likeliest ones."""
    return {
        "topCandidates": [
            {"candidates": [_logprob(t.token_id, t.token_bytes, t.logprob) for t in e.top]}
            for e in entries
        ],
        "chosenCandidates": [_logprob(e.token_id, e.token_bytes, e.logprob) for e in entries],
        "logProbabilitySum": sum(e.logprob for e in entries),
    }


def _candidate(
    index: int, text: str, finish: str | None, logprobs: Sequence[TokenLogprob] | None = None,
    calls: Sequence[ToolCall] = (), thought: str = "",
) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"text": thought, "thought": True}] if thought else []
    parts += [{"text": text}] if text or not (calls or thought) else []
    parts += [{"functionCall": {"name": c.name, "args": arguments_object(c.arguments)}} for c in calls]
    candidate: dict[str, Any] = {"content": {"role": "model", "parts": parts}, "index": index}
    if finish is not None:
        candidate["finishReason"] = FINISH.get(finish, "OTHER")
    if logprobs is not None:
        candidate["logprobsResult"] = logprobs_result(logprobs)
        if logprobs:
            candidate["avgLogprobs"] = sum(e.logprob for e in logprobs) / len(logprobs)
    return candidate


def _response(
    candidates: list[dict[str, Any]], usage: dict[str, Any] | None, model_id: str, rid: str
) -> dict[str, Any]:
    out: dict[str, Any] = {"candidates": candidates}
    if usage is not None:
        out["usageMetadata"] = usage
    out["modelVersion"] = model_id
    out["responseId"] = rid
    return out


# -- the POST methods' OpenAPI documentation (what the parsing above takes; a null member counts
# as absent, an integer may come as a string, snake_case names are read as camelCase) ----------


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def _integer(option: str | None = None, **bounds: int) -> dict[str, Any]:
    numeric = {"type": "integer", **(documented(option, LIMITS) if option else {}), **bounds}
    return _nullable({"anyOf": [numeric, {"type": "string", "pattern": f"^{INT_STRING}$"}]})


def _number(option: str) -> dict[str, Any]:
    return _nullable({"type": "number", **documented(option, LIMITS)})


_CALL: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": _nullable({"type": "string"}),
        "name": {"type": "string"},
        "args": _nullable({"type": "object"}),
    },
    "required": ["name"],
}
_RESPONSE: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": _nullable({"type": "string"}),
        "name": {"type": "string"},
        "response": _nullable({"type": "object"}),
    },
    "required": ["name"],
}
_PART: dict[str, Any] = {
    "type": "object",
    "properties": {
        "text": {"type": "string"},
        "functionCall": _CALL,
        "functionResponse": _RESPONSE,
        "thought": _nullable({"type": "boolean"}),
        "thoughtSignature": _nullable({"type": "string"}),
    },
    "oneOf": [{"required": ["text"]}, {"required": ["functionCall"]},
              {"required": ["functionResponse"]}],
}
_CONTENT: dict[str, Any] = {
    "type": "object",
    "properties": {
        "role": _nullable({"enum": ["", "user", "model", "function", "tool"]}),
        "parts": {"type": "array", "items": _PART, "minItems": 1},
    },
    "required": ["parts"],
}
_SYSTEM: dict[str, Any] = {
    "anyOf": [
        {"type": "string"},
        {**_CONTENT, "properties": {
            **_CONTENT["properties"], "role": _nullable({"enum": ["", "user", "system"]})
        }},
        {"type": "null"},
    ]
}
_GENERATION_CONFIG: dict[str, Any] = {
    "type": "object",
    "properties": {
        **{key: _number(option) for key, option in NUMBERS.items()},
        **{key: _integer(option) for key, option in INTEGERS.items()},
        "stopSequences": _nullable(
            {"type": "array", "items": {"type": "string"}, **documented("stop", LIMITS)}
        ),
        "candidateCount": _integer(minimum=1, maximum=MAX_CANDIDATES),
        "responseMimeType": _nullable({"enum": list(MIME_TYPES)}),
        "responseSchema": _nullable({"type": "object"}),
        "responseJsonSchema": _nullable({"type": "object"}),
        "responseModalities": _nullable(
            {"type": "array", "items": {"type": "string", "pattern": "^[Tt][Ee][Xx][Tt]$"}}
        ),
        "responseLogprobs": _nullable({"type": "boolean"}),
        "logprobs": _integer("logprobs"),
        "enableEnhancedCivicAnswers": {"enum": [False, None]},
        "audioTimestamp": {"enum": [False, None]},
        "thinkingConfig": _nullable({
            "type": "object",
            "properties": {
                "thinkingBudget": _integer(),
                "includeThoughts": _nullable({"type": "boolean"}),
                "thinkingLevel": _nullable({"type": "string"}),
            },
        }),
    },
}
GENERATE_CONTENT_REQUEST: dict[str, Any] = {
    "type": "object",
    "properties": {
        "contents": {"type": "array", "items": _CONTENT, "minItems": 1},
        "systemInstruction": _SYSTEM,
        "generationConfig": _nullable(_GENERATION_CONFIG),
        "tools": _nullable({"type": "array", "items": {
            "type": "object",
            "properties": {"functionDeclarations": _nullable({"type": "array", "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "pattern": "^[A-Za-z0-9_.:-]{1,64}$"},
                    "description": _nullable({"type": "string"}),
                    "parameters": _nullable({"type": "object"}),
                    "parametersJsonSchema": _nullable({"type": "object"}),
                },
                "required": ["name"],
            }})},
            "additionalProperties": False,
        }}),
        "toolConfig": _nullable({"type": "object", "properties": {
            "functionCallingConfig": _nullable({"type": "object", "properties": {
                "mode": _nullable({"enum": ["AUTO", "ANY", "NONE", "VALIDATED"]}),
                "allowedFunctionNames": _nullable({"type": "array", "items": {"type": "string"}}),
            }}),
        }}),
        **{key: {} for key in sorted(HARMLESS)},
    },
    "required": ["contents"],
}
COUNT_TOKENS_REQUEST: dict[str, Any] = {
    "type": "object",
    "properties": {
        "contents": {"type": "array", "items": _CONTENT, "minItems": 1},
        "generateContentRequest": GENERATE_CONTENT_REQUEST,
    },
    "oneOf": [{"required": ["contents"]}, {"required": ["generateContentRequest"]}],
}


def _body(schema: dict[str, Any]) -> dict[str, Any]:
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


_STREAMED: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "Answers as server-sent events (alt=sse) or as a JSON array (alt=json).",
        "content": {
            "text/event-stream": {"schema": SSE_EVENT},
            "application/json": {"schema": {"type": "array", "items": {"type": "object"}}},
        },
    }
}


@router.post(
    "/models/{model:gemini_model}:generateContent",
    response_model=None,
    openapi_extra=_body(GENERATE_CONTENT_REQUEST),
)
async def generate_content(
    request: Request, model: str = Path(json_schema_extra=MODEL_NAME)
) -> JSONResponse:
    model_id, parsed, generation = await _generation(request, model)
    wants = generation.options.logprobs is not None
    answers = await run_all(request, generation, parsed.candidates)
    candidates = [
        _candidate(i, a.text, a.last.finish_reason, a.logprobs if wants else None, a.tool_calls,
                   a.reasoning if parsed.thoughts else "")
        for i, a in enumerate(answers)
    ]
    usage = _usage_of([a.usage for a in answers], sum(a.reasoning_tokens for a in answers))
    return JSONResponse(_response(candidates, usage, model_id, uuid.uuid4().hex))


@router.post(
    "/models/{model:gemini_model}:streamGenerateContent",
    response_model=None,
    responses=_STREAMED,
    openapi_extra=_body(GENERATE_CONTENT_REQUEST),
)
async def stream_generate_content(
    request: Request,
    model: str = Path(json_schema_extra=MODEL_NAME),
    alt: str = Query("json", json_schema_extra={"enum": ["sse", "json"]}),
) -> StreamingResponse:
    model_id, parsed, generation = await _generation(request, model)
    if alt not in ("sse", "json"):
        raise _bad(f"alt={alt!r} is not supported (use 'sse' or 'json')", "alt")
    streams = await stream_all(request, generation, parsed.candidates)
    framing: Literal["sse", "json"] = "sse" if alt == "sse" else "json"
    wants = generation.options.logprobs is not None
    return StreamingResponse(
        _events(streams, model_id, uuid.uuid4().hex, framing, wants, parsed.thoughts),
        media_type="text/event-stream" if framing == "sse" else "application/json",
    )


async def _generation(request: Request, model: str) -> tuple[str, Parsed, Generation]:
    """The model's id, the parsed GenerateContentRequest and its generation."""
    model_id = _model_id(state_of(request), model)
    parsed = parse_generate(await _json_body(request))
    return model_id, parsed, parsed.options.generation(model_id, parsed.chat, "contents")


@router.post(
    "/models/{model:gemini_model}:countTokens",
    response_model=None,
    openapi_extra=_body(COUNT_TOKENS_REQUEST),
)
async def count_tokens(
    request: Request, model: str = Path(json_schema_extra=MODEL_NAME)
) -> JSONResponse:
    state = state_of(request)
    body = await _json_body(request)
    return await _count_tokens(state, _model_id(state, model), body)


@router.get("/models/{name:gemini_model}")
async def get_model(
    request: Request, name: str = Path(json_schema_extra=MODEL_NAME)
) -> dict[str, Any]:
    state = state_of(request)
    model_id = _model_id(state, name)
    return await _with_model(state, model_id, lambda m: _model_entry(model_id, m))


@router.post("/models/{rest:gemini_method}", include_in_schema=False)
async def unknown_method(rest: str) -> None:
    model, _, method = rest.rpartition(":")
    if method in METHODS:
        raise ApiError("not_found", f"no model {model!r}: a model's name is not empty, has no ':'")
    raise ApiError("not_found", f"unknown method {method!r}: use one of {', '.join(METHODS)}")


async def _events(
    streams: Sequence[Stream], model_id: str, rid: str, framing: Literal["sse", "json"],
    logprobs: bool = False, thoughts: bool = False,
) -> AsyncIterator[str]:
    """Each candidate's pieces as they come, one candidate a chunk (reasoning as thought parts
    when asked for); the usage of all on the chunk that finishes the last one."""
    count = 0
    usages: list[Usage] = []
    reasoning = 0

    def frame(data: dict[str, Any]) -> str:
        nonlocal count
        count += 1
        if framing == "sse":
            return sse(data)
        head = "[" if count == 1 else ",\r\n"
        return head + json.dumps(data, separators=(",", ":"))

    pieces = merged(streams)
    calls: list[list[ToolCallDelta]] = [[] for _ in streams]  # a call goes out whole, at the end
    try:
        async for i, piece in pieces:
            probs = piece.logprobs if logprobs else None
            calls[i] += piece.tool_calls
            thought = piece.channel == "reasoning"
            reasoning += len(piece.token_ids) if thought else 0
            text, shown = ("", piece.text if thoughts else "") if thought else (piece.text, "")
            if piece.finish_reason is not None:
                if piece.usage is not None:
                    usages.append(piece.usage)
                usage = _usage_of(usages, reasoning) if len(usages) == len(streams) else None
                whole = ToolCall.joined(calls[i])
                candidate = _candidate(i, text, piece.finish_reason, probs, whole, shown)
                yield frame(_response([candidate], usage, model_id, rid))
            elif text or shown:
                candidate = _candidate(i, text, None, probs, thought=shown)
                yield frame(_response([candidate], None, model_id, rid))
    except Exception as e:  # never leave a client hanging on a broken stream
        yield frame(error_body("gemini", streams[0].error(e)))
    finally:
        await pieces.aclose()
    if framing == "json":
        yield "[]" if count == 0 else "]"


async def _count_tokens(state: ServerState, model_id: str, body: dict[str, Any]) -> JSONResponse:
    for key in body:
        if key not in ("contents", "generateContentRequest"):
            raise _unknown(key)
    if "generateContentRequest" in body:
        if "contents" in body:
            raise _bad(
                "contents and generateContentRequest are mutually exclusive: send one",
                "generateContentRequest",
            )
        chat = parse_generate(
            _obj(body["generateContentRequest"], "generateContentRequest"), "generateContentRequest"
        ).chat
    else:
        chat = chat_of(body)
    n = await _with_model(state, model_id, lambda m: len(m.encode(chat)))
    return JSONResponse({
        "totalTokens": n,
        "promptTokensDetails": [{"modality": "TEXT", "tokenCount": n}],
    })
