"""GLM-4.5's calls: the tool's name, then its arguments as key/value pairs, a string value
written as is and any other as JSON:

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

Read back, a value is JSON when it parses as JSON, else a string; a parameter whose schema says
"string" stays a string. The arguments stream a pair at a time, as JSON text.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

from mlx_omnia.engine.text.tools.calls import (
    JSON_LAYOUT,
    ToolCallParser,
    ToolFormat,
    function_of,
    parameters_of,
)

BEGIN, END = "<tool_call>", "</tool_call>"
KEY, KEY_END, VALUE, VALUE_END = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"


class GlmFormat(ToolFormat):
    name = "glm45"
    markers = (BEGIN, END, KEY, KEY_END, VALUE, VALUE_END)

    def parser(self, tools: Sequence[Mapping[str, Any]] = ()) -> GlmParser:
        strings: dict[str, set[str]] = {}
        for tool in tools:
            f = function_of(tool)
            properties = parameters_of(f).get("properties")
            if isinstance(properties, Mapping):
                props = cast(Mapping[str, Any], properties)
                strings[f["name"]] = {k for k, v in props.items() if _is_string(v)}
        return GlmParser(strings)

    def _lark(
        self, functions: Sequence[Mapping[str, Any]], parallel: bool, mark: Callable[[str], str]
    ) -> str:
        """Calls as the template writes them: each declared parameter in the schema's order
        (the optional ones may be left out), string values as text without `<` (up to
        maxLength)."""

        rules: list[str] = []
        names: list[str] = []
        for n, f in enumerate(functions):
            params = parameters_of(f)
            properties = cast(Mapping[str, Any], params.get("properties") or {})
            required = set(cast(list[str], params.get("required") or []))
            pairs: list[str] = []
            for k, (key, schema) in enumerate(properties.items()):
                rule = f"p{n}_{k}"
                rules.append(
                    f"{rule}: {mark(KEY)} {json.dumps(key)} {mark(KEY_END)} \"\\n\" {mark(VALUE)} "
                    f"{_value(cast(Mapping[str, Any], schema))} {mark(VALUE_END)} \"\\n\""
                )
                pairs.append(rule if key in required else f"{rule}?")
            body = " ".join(pairs)
            rules.append(
                f"call{n}: {mark(BEGIN)} {json.dumps(str(f['name']) + chr(10))} {body} {mark(END)}"
            )
            names.append(f"call{n}")
        many = 'call ("\\n" call)*' if parallel else "call"
        return f"start: {many}\ncall: {' | '.join(names)}\n" + "\n".join(rules) + "\n"


def _is_string(schema: Any) -> bool:
    return isinstance(schema, Mapping) and cast(Mapping[str, Any], schema).get("type") == "string"


def _value(schema: Mapping[str, Any]) -> str:
    """A value in the grammar: a string as text (one of its enum, if any), else JSON."""
    if not _is_string(schema):
        return f"%json {json.dumps({'x-guidance': JSON_LAYOUT, **schema})}"
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return "(" + " | ".join(json.dumps(str(e)) for e in cast(list[Any], enum)) + ")"
    most = schema.get("maxLength")
    return f"/[^<]{{0,{most}}}/" if isinstance(most, int) else "/[^<]*/"


GLM45 = GlmFormat()


class GlmParser(ToolCallParser):
    """Reads `<tool_call>` blocks of key/value pairs; `strings`: by tool, the parameters whose
    values stay strings."""

    def __init__(self, strings: Mapping[str, set[str]]) -> None:
        super().__init__()
        self._strings = strings
        self._state = "text"  # text | name | pairs | key | value
        self._tool = ""
        self._key = ""
        self._pairs = 0

    def _run(self, final: bool) -> None:
        while self._held:
            state = self._state
            if state == "text":
                if self._text_until([BEGIN], final) is None:
                    return
                self._state = "name"
            elif state == "name":
                found = self._take_whole(["\n", KEY, END])
                if found is None:
                    return  # the name's line is not whole yet
                name, marker = found
                if not name.strip():  # no name: not a call, the markup is text
                    self._emit_text(BEGIN + name + marker)
                    self._state = "text"
                    continue
                self._tool, self._pairs = name.strip(), 0
                self._name(self._tool)
                self._state = {KEY: "key", END: "text"}.get(marker, "pairs")
                if marker == END:
                    self._close()
            elif state == "pairs":
                _, marker = self._take_until([KEY, END], final)  # what else comes: dropped
                if marker is None:
                    return
                self._state = "key"
                if marker == END:
                    self._close()
            elif state == "key":
                found = self._take_whole([KEY_END])
                if found is None:
                    return
                self._key = found[0].strip()
                self._state = "value"
            else:
                found = self._take_whole([VALUE_END])
                if found is None:
                    return
                raw = found[0]
                raw = raw.split(VALUE, 1)[1] if VALUE in raw else raw
                self._pair(self._key, raw)
                self._state = "pairs"

    def _pair(self, key: str, raw: str) -> None:
        value: Any = raw
        if key not in self._strings.get(self._tool, set()):
            try:
                value = json.loads(raw)
            except ValueError:
                value = raw
        text = f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"
        self._arguments(("{" if not self._pairs else ", ") + text)
        self._pairs += 1

    def _close(self) -> None:
        self._arguments("}" if self._pairs else "{}")
        self._state = "text"

    def _cut(self) -> None:
        if self._state != "text":
            self._held = ""  # a name or pair the end cut goes; the pairs read whole stay
        if self._state in ("pairs", "key", "value"):
            self._close()
