"""Calls written as JSON objects: Qwen's `<tool_call>` (Hermes), Llama 3's bare JSON with
"parameters", Mistral's `[TOOL_CALLS]` array, and the generic form for templates without tools
(the tools described in a system turn, calls asked as `<tool_call>{...}</tool_call>`)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from mlx_omnia.engine.text.tools.calls import (
    JSON_LAYOUT,
    Messages,
    ToolCallDelta,
    ToolCallParser,
    ToolFormat,
    described_tools,
    hf_message,
    message_text,
    parameters_of,
    partial_suffix,
    skip_space,
    string_end,
    value_end,
)


@dataclass(frozen=True, repr=False)
class JsonFormat(ToolFormat):
    """Calls as JSON objects naming the tool (`"name"`) with arguments under one of
    `argument_keys`, wrapped in `begin`/`end` (`end` empty: the object's own end closes the
    call); `array`: one marker opens a JSON array of calls (Mistral's). `bare`: a call may also
    open the answer with no marker at all (Llama 3's JSON; a forced call is written so)."""

    name: str
    begin: str
    end: str = ""
    argument_keys: tuple[str, ...] = ("arguments",)
    array: bool = False
    bare: bool = False
    native: bool = True  # the template renders tools itself; False: the generic system turn

    markers: tuple[str, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        object.__setattr__(self, "markers", (self.begin, self.end) if self.end else (self.begin,))

    def parser(self, tools: Sequence[Mapping[str, Any]] = ()) -> JsonCallParser:
        return JsonCallParser(self)

    def _lark(
        self, functions: Sequence[Mapping[str, Any]], parallel: bool, mark: Callable[[str], str]
    ) -> str:
        key = self.argument_keys[0]
        schema = {
            "x-guidance": JSON_LAYOUT,
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": f["name"]}, key: parameters_of(f)},
                    "required": ["name", key],
                    "additionalProperties": False,
                }
                for f in functions
            ]
        }
        call = "%json " + json.dumps(schema)
        if self.bare:  # one call, as the template writes it (Llama 3's refuses two)
            return f"start: {call}\n"
        begin = mark(self.begin)
        if self.array:
            array = {"x-guidance": JSON_LAYOUT, "type": "array", "items": schema, "minItems": 1}
            if not parallel:
                array["maxItems"] = 1
            return f"start: {begin} %json {json.dumps(array)}\n"
        # A line break may follow the opening marker and precede the closing one (Qwen3's
        # template writes `<tool_call>\n{...}\n</tool_call>`, what its models are used to).
        one = f"{begin} NL? call NL? {mark(self.end)}" if self.end else f"{begin} call"
        many = 'one (WS one)*' if parallel else "one"
        # A bounded gap: between calls a model may only go on to the next call or end, never
        # idle on blank lines until max_tokens.
        return f"start: {many}\none: {one}\ncall: {call}\nWS: /[ \\n]{{1,2}}/\nNL: \"\\n\"\n"

    def render(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]
    ) -> tuple[Messages, Messages]:
        """For the generic form, the tools go in a system turn, calls are written into the
        assistant's text and results become user turns."""
        if self.native:
            return super().render(messages, tools)
        return _generic_messages([hf_message(m) for m in messages], tools, self), []


HERMES = JsonFormat("hermes", "<tool_call>", "</tool_call>")
LLAMA3_JSON = JsonFormat(
    "llama3_json", "<|python_tag|>", argument_keys=("parameters", "arguments"), bare=True
)
MISTRAL = JsonFormat("mistral", "[TOOL_CALLS]", array=True)
GENERIC = JsonFormat("generic", "<tool_call>", "</tool_call>", native=False)


GENERIC_SYSTEM = (
    "You can call these tools (JSON Schema of each one's arguments):\n{tools}\n\n"
    "To call a tool, answer with one line per call, exactly:\n"
    '<tool_call>{{"name": "<tool name>", "arguments": {{<arguments as JSON>}}}}</tool_call>\n'
    "Results come back in <tool_response> blocks."
)


def _generic_messages(
    messages: list[dict[str, Any]], tools: Sequence[Mapping[str, Any]], fmt: JsonFormat
) -> Messages:
    system = GENERIC_SYSTEM.format(tools=described_tools(tools)) if tools else ""
    out: list[dict[str, Any]] = []
    for m in messages:
        role = m.get("role")
        if role == "system" and system and not out:
            out.append({**m, "content": f"{message_text(m)}\n\n{system}"})
            system = ""
            continue
        if system:
            out.append({"role": "system", "content": system})
            system = ""
        if role == "tool":
            body = f"<tool_response>\n{message_text(m)}\n</tool_response>"
            if out and out[-1].get("role") == "user" and out[-1].get("_results"):
                out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n{body}"}
            else:
                out.append({"role": "user", "content": body, "_results": True})
            continue
        if role == "assistant" and m.get("tool_calls"):
            lines = [message_text(m)] if message_text(m) else []
            for call in cast(list[dict[str, Any]], m["tool_calls"]):
                f = cast(dict[str, Any], call.get("function", {}))
                args = f.get("arguments", {})
                body = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
                lines.append(
                    f'{fmt.begin}{{"name": {json.dumps(f.get("name", ""))}, "arguments": {body}}}{fmt.end}'
                )
            out.append({"role": "assistant", "content": "\n".join(lines)})
            continue
        out.append(m)
    if system:
        out.insert(0, {"role": "system", "content": system})
    return [{k: v for k, v in m.items() if k != "_results"} for m in out]


# -- parsing ---------------------------------------------------------------------------------

@dataclass
class _Call:
    """A call being read: its text so far and what of it went out."""

    text: str = ""
    name: str | None = None
    sent: int = 0  # characters of the arguments' text already streamed
    string_args: bool = False  # arguments written as a JSON string: sent whole at the end


class JsonCallParser(ToolCallParser):
    """Reads calls written as JSON objects. A call streams once its name is read: the
    arguments' JSON text as it grows. Markup that turns out not to be a call (no name, no
    object) goes out as text; a call cut off by the end of the answer keeps what it had."""

    def __init__(self, format: JsonFormat) -> None:
        super().__init__()
        self.format = format
        self._call: _Call | None = None
        self._await_array = False
        self._in_array = False

    def _cut(self) -> None:
        if self._call is not None:
            self._close_call(cut=True)

    # text, markers and calls
    def _run(self, final: bool) -> None:
        fmt = self.format
        while self._held:
            if self._call is not None:
                if not self._read_call(final):
                    return
                continue
            if self._await_array:
                stripped = self._held.lstrip()
                if not stripped and not final:
                    return
                self._await_array = False
                if stripped.startswith("["):
                    self._held = stripped[1:]
                    self._in_array = True
                else:
                    self._emit_text(fmt.begin)  # a marker with no array after it: text
                continue
            if self._in_array:
                stripped = self._held.lstrip(" \n,")
                if not stripped:
                    self._held = ""
                    return
                if stripped[0] == "{":
                    self._held = stripped
                    self._open()
                    continue
                self._in_array = False
                if stripped[0] == "]":
                    self._held = stripped[1:]
                continue
            at = self._held.find(fmt.begin)
            bare = fmt.bare and not self._answered and self.calls == 0
            if bare and self._held.lstrip().startswith("{"):
                self._open()
                continue
            if bare and not self._held.strip() and not final:
                return  # leading space: wait to see what comes
            if at < 0:
                keep = 0 if final else partial_suffix(self._held, fmt.begin)
                self._emit_text(self._held[: len(self._held) - keep])
                self._held = self._held[len(self._held) - keep :]
                return
            self._emit_text(self._held[:at])
            self._held = self._held[at + len(fmt.begin) :]
            if fmt.array:
                self._await_array = True
                continue
            self._open()

    def _open(self) -> None:
        self._call = _Call()
        self._space = ""  # space between calls

    def _read_call(self, final: bool) -> bool:
        """Read the held text into the open call; False when it needs more text."""
        call = self._call
        assert call is not None
        fmt = self.format
        call.text += self._held
        self._held = ""
        body = call.text.lstrip()
        if not body:
            return False
        if body[0] != "{":
            self._call = None
            self._emit_text(fmt.begin + call.text)
            return True
        scan = _scan_object(body, fmt.argument_keys)
        if call.name is None and scan.name is not None:
            call.name = scan.name
            self._events.append(ToolCallDelta(self.calls, call.name, ""))
        if call.name is not None and scan.args_start is not None and not call.string_args:
            if body[scan.args_start] == '"':
                call.string_args = True
            else:
                end = scan.args_end if scan.args_end is not None else len(body)
                more = body[scan.args_start + call.sent : end]
                if more:
                    call.sent += len(more)
                    self._events.append(ToolCallDelta(self.calls, None, more))
        if scan.end is None:
            if scan.broken:
                self._call = None
                self._emit_text((fmt.begin if not fmt.bare or self.calls else "") + call.text)
                return True
            return False
        rest = body[scan.end :]
        if fmt.end:
            stripped = rest.lstrip()
            if len(stripped) < len(fmt.end) and fmt.end.startswith(stripped) and not final:
                call.text = body  # the end marker may still come
                self._held = ""
                return False
            if stripped.startswith(fmt.end):
                rest = stripped[len(fmt.end) :]
        call.text = call.text[: len(call.text) - len(body)] + body[: scan.end]
        self._held = rest
        self._close_call(cut=False, scan=scan)
        return True

    def _close_call(self, cut: bool, scan: _Scan | None = None) -> None:
        call = self._call
        assert call is not None
        self._call = None
        body = call.text.lstrip()
        scan = scan or _scan_object(body, self.format.argument_keys)
        if call.name is None:
            if scan.name is None and cut and not scan.broken:
                return  # a call the answer's end cut before its name: nothing to say
            if scan.name is None:
                marker = "" if self.format.bare and not self.calls else self.format.begin
                self._emit_text(marker + call.text)
                return
            call.name = scan.name
            self._events.append(ToolCallDelta(self.calls, call.name, ""))
        if scan.args_start is not None:
            end = scan.args_end if scan.args_end is not None else len(body)
            raw = body[scan.args_start : end]
            if call.string_args:
                try:
                    decoded = json.loads(raw)
                except ValueError:
                    decoded = raw if cut else "{}"
                more = decoded if isinstance(decoded, str) else json.dumps(decoded)
                self._events.append(ToolCallDelta(self.calls, None, more))
            elif raw[call.sent :]:
                self._events.append(ToolCallDelta(self.calls, None, raw[call.sent :]))
        elif not cut:
            self._events.append(ToolCallDelta(self.calls, None, "{}"))
        self.calls += 1


@dataclass
class _Scan:
    """What a call object's text says so far: its name, where the arguments' value starts and
    ends, where the object ends (None: not yet), or that it is no JSON object (`broken`)."""

    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None
    end: int | None = None
    broken: bool = False


def _scan_object(text: str, argument_keys: Sequence[str]) -> _Scan:
    """Walk the top level of the JSON object at the start of `text`, as far as it goes."""
    scan = _Scan()
    i = skip_space(text, 1)
    if i >= len(text):
        return scan
    if text[i] == "}":
        scan.end = i + 1
        return scan
    while i < len(text):
        if text[i] != '"':
            scan.broken = True
            return scan
        key_end = string_end(text, i)
        if key_end is None:
            return scan
        try:
            key = json.loads(text[i:key_end])
        except ValueError:
            scan.broken = True
            return scan
        i = skip_space(text, key_end)
        if i >= len(text):
            return scan
        if text[i] != ":":
            scan.broken = True
            return scan
        i = skip_space(text, i + 1)
        if i >= len(text):
            return scan
        end = value_end(text, i)
        if key in argument_keys and scan.args_start is None:
            scan.args_start = i
            scan.args_end = end
        if end is None:
            if key == "name" or text[i] not in '{["-0123456789tfn':
                scan.broken = text[i] not in '{["-0123456789tfn'
            return scan
        if key == "name":
            try:
                name = json.loads(text[i:end])
            except ValueError:
                name = None
            if isinstance(name, str) and scan.name is None:
                scan.name = name
        i = skip_space(text, end)
        if i >= len(text):
            return scan
        if text[i] == "}":
            scan.end = i + 1
            return scan
        if text[i] != ",":
            scan.broken = True
            return scan
        i = skip_space(text, i + 1)
    return scan


