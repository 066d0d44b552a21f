"""Tools as every dialect declares them, in the engine's shape: checked function declarations,
and the ids a dialect gives the calls it returns."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any, cast

from mlx_omnia.server.dialects.common import new_id
from mlx_omnia.server.errors import ApiError

# The names the vendors allow (OpenAI and Anthropic: 1-64 of these; Gemini: up to 128 with dots
# and colons, refused beyond 64 here as a template may have to write them).
NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


def function_tool(
    name: object, description: object, parameters: object, where: str
) -> dict[str, Any]:
    """One function tool in the engine's (OpenAI chat's) shape, checked: a valid name, an
    optional description, parameters that are a JSON Schema object (an empty one takes none)."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ApiError(
            "invalid_request",
            f"{where}.name must be 1-64 letters, digits, '_', '-', '.' or ':'",
            f"{where}.name",
        )
    if description is not None and not isinstance(description, str):
        raise ApiError("invalid_request", f"{where}.description must be a string", f"{where}.description")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, Mapping):
        raise ApiError(
            "invalid_request", f"{where}.parameters must be a JSON Schema object", f"{where}.parameters"
        )
    schema = cast(Mapping[str, Any], parameters)
    if schema.get("type", "object") != "object":
        raise ApiError(
            "invalid_request",
            f"{where}.parameters must describe an object (type 'object')",
            f"{where}.parameters",
        )
    function: dict[str, Any] = {"name": name, "parameters": dict(schema)}
    if description:
        function["description"] = description
    return {"type": "function", "function": function}


def unique(tools: list[dict[str, Any]], where: str) -> tuple[dict[str, Any], ...]:
    """The tools, refused if two share a name (a call could not say which it meant)."""
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        name = cast(str, tool["function"]["name"])
        if name in seen:
            raise ApiError("invalid_request", f"{where}[{i}]: a second tool named {name!r}", where)
        seen.add(name)
    return tuple(tools)


def declared(name: object, tools: tuple[dict[str, Any], ...], where: str) -> str:
    """`name`, which must be a declared tool's (what a named tool_choice may force)."""
    names = [t["function"]["name"] for t in tools]
    if not isinstance(name, str) or name not in names:
        raise ApiError("invalid_request", f"{where} names no declared tool ({name!r})", where)
    return name


def arguments_object(arguments: str) -> dict[str, Any]:
    """A call's arguments as an object (Anthropic's tool_use input, Gemini's functionCall args):
    the object the model wrote, or {} for text that is no JSON object (an answer cut short)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return cast(dict[str, Any], value) if isinstance(value, dict) else {}


class CallIds:
    """The id of each call of an answer (`prefix` + random), the same on every chunk of it."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._ids: dict[tuple[int, int], str] = {}

    def __call__(self, choice: int, index: int) -> str:
        key = (choice, index)
        if key not in self._ids:
            self._ids[key] = new_id(self.prefix)
        return self._ids[key]
