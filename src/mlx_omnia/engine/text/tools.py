"""Tool calls: how a checkpoint's chat template asks for them, and reading them back.

A chat with tools is rendered through the template, which describes the tools its own way; the
model answers in the template's call format, which a `ToolFormat` knows: the markers around a
call, the JSON inside, and a grammar that forces a call when the request says one must come.
Templates that know no tools get the generic form: the tools described in a system turn and the
calls asked as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import jinja2
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mlx_omnia.engine.errors import ChatTemplateError

ToolChoice = Literal["auto", "none", "required"]
# How a forced call's JSON is laid out: on one line, as templates write calls.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class ToolCall:
    """A call the model made: the tool's name and its arguments, the JSON text of an object as
    the model wrote it."""

    name: str
    arguments: str

    @staticmethod
    def joined(deltas: Sequence[ToolCallDelta]) -> tuple[ToolCall, ...]:
        """The whole calls that streamed deltas make, in order."""
        return merge_calls(deltas)


@dataclass(frozen=True)
class ToolCallDelta:
    """Part of a streamed call: `name` on the call's first delta (None after), then more of the
    arguments' JSON text. Deltas of one call share its `index` (0, 1, ... in the answer)."""

    index: int
    name: str | None
    arguments: str


def merge_calls(deltas: Sequence[ToolCallDelta]) -> tuple[ToolCall, ...]:
    """The whole calls streamed deltas make."""
    names: dict[int, str] = {}
    args: dict[int, list[str]] = {}
    for d in deltas:
        if d.name is not None:
            names[d.index] = d.name
        args.setdefault(d.index, []).append(d.arguments)
    return tuple(ToolCall(names.get(i, ""), "".join(args[i])) for i in sorted(args))


# -- formats ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolFormat:
    """A family of call formats: text before `begin` is the answer, then calls, each a JSON
    object naming the tool (`"name"`) with its arguments under one of `argument_keys`, wrapped
    in `begin`/`end` (`end` empty: the object's own end closes the call); `array`: one marker
    opens a JSON array of calls (Mistral's). `bare`: a call may also open the answer with no
    marker at all (Llama 3's JSON)."""

    name: str
    begin: str
    end: str = ""
    argument_keys: tuple[str, ...] = ("arguments",)
    array: bool = False
    bare: bool = False
    native: bool = True  # the template renders tools itself; False: the generic system turn

    def parser(self) -> ToolCallParser:
        return ToolCallParser(self)

    def grammar(
        self,
        tools: Sequence[Mapping[str, Any]],
        allowed: Sequence[str] = (),
        parallel: bool = True,
        special_id: Mapping[str, int] | None = None,
    ) -> str:
        """A Lark grammar (llguidance's dialect) whose every sentence is one call (or, with
        `parallel`, one or more) of a declared tool, `allowed` ones only when given, with
        arguments valid under the tool's JSON schema. `special_id`: the token id of a marker
        that is one special token (written `<[id]>`, the only way to name it in a grammar)."""
        specs = [_function(t) for t in tools]
        names = set(allowed)
        chosen = [s for s in specs if not names or s["name"] in names]
        if not chosen:
            raise ChatTemplateError("tool_choice names no declared tool")
        key = self.argument_keys[0]
        schema = {
            "x-guidance": JSON_LAYOUT,
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": s["name"]}, key: _parameters(s)},
                    "required": ["name", key],
                    "additionalProperties": False,
                }
                for s in chosen
            ]
        }
        call = "%json " + json.dumps(schema)
        begin = _literal(self.begin, special_id)
        if self.array:
            array = {"x-guidance": JSON_LAYOUT, "type": "array", "items": schema, "minItems": 1}
            if not parallel:
                array["maxItems"] = 1
            return f"start: {begin} %json {json.dumps(array)}\n"
        one = f"{begin} call {_literal(self.end, special_id)}" if self.end else f"{begin} call"
        many = 'one (WS one)*' if parallel else "one"
        return f"start: {many}\none: {one}\ncall: {call}\nWS: /[ \\n]+/\n"

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]],
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The messages and tools to hand the template: assistant calls with their arguments
        as objects (as templates expect); for the generic form, the tools in a system turn,
        calls written into the assistant's text and results as user turns."""
        out = [_hf_message(m) for m in messages]
        if self.native:
            return out, [dict(t) for t in tools]
        return _generic_messages(out, tools, self), []


HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>")
LLAMA3_JSON = ToolFormat(
    "llama3_json", "<|python_tag|>", argument_keys=("parameters", "arguments"), bare=True
)
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS]", array=True)
GENERIC = ToolFormat("generic", "<tool_call>", "</tool_call>", native=False)


def tool_format(template_source: str | None) -> ToolFormat:
    """The call format a chat template asks for, read from its text; the generic form for a
    template that never reads `tools` (it would drop them)."""
    if not template_source or "tools" not in _variables(template_source):
        return GENERIC
    if "[TOOL_CALLS]" in template_source:
        return MISTRAL
    if "<tool_call>" in template_source:
        return HERMES
    if "<|python_tag|>" in template_source or '"parameters"' in template_source:
        return LLAMA3_JSON
    return HERMES


def _variables(source: str) -> set[str]:
    try:
        return jinja2.meta.find_undeclared_variables(ImmutableSandboxedEnvironment().parse(source))
    except jinja2.TemplateSyntaxError:
        return set()


def _literal(text: str, special_id: Mapping[str, int] | None) -> str:
    if special_id and text in special_id:
        return f"<[{special_id[text]}]>"
    return json.dumps(text)


def _function(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    """The function a tool declares (OpenAI's `{"type": "function", "function": {...}}`)."""
    inner = tool.get("function", tool)
    if not isinstance(inner, Mapping) or not isinstance(cast(Mapping[str, Any], inner).get("name"), str):
        raise ChatTemplateError("each tool must be {'type': 'function', 'function': {'name': ...}}")
    return cast(Mapping[str, Any], inner)


def _parameters(function: Mapping[str, Any]) -> Mapping[str, Any]:
    params = function.get("parameters")
    if isinstance(params, Mapping) and params:
        return cast(Mapping[str, Any], params)
    return {"type": "object"}


def _hf_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A message with its tool calls' arguments as objects (a template writes them with
    `tojson`); arguments that are not a JSON object stay text."""
    out = dict(message)
    calls = out.get("tool_calls")
    if isinstance(calls, list) and calls:
        fixed: list[dict[str, Any]] = []
        for call in cast(list[Any], calls):
            entry = dict(cast(Mapping[str, Any], call))
            function = dict(cast(Mapping[str, Any], entry.get("function") or {}))
            args = function.get("arguments")
            if isinstance(args, str):
                try:
                    parsed = json.loads(args)
                except ValueError:
                    parsed = None
                if isinstance(parsed, dict):
                    function["arguments"] = parsed
            entry["function"] = function
            entry.setdefault("type", "function")
            fixed.append(entry)
        out["tool_calls"] = fixed
        if out.get("content") is None:
            out["content"] = ""
    return out


GENERIC_SYSTEM = (
    "You can call these tools (JSON Schema of each one's arguments):\n{tools}\n\n"
    "To call a tool, answer with one line per call, exactly:\n"
    '<tool_call>{{"name": "<tool name>", "arguments": {{<arguments as JSON>}}}}</tool_call>\n'
    "Results come back in <tool_response> blocks."
)


def _generic_messages(
    messages: list[dict[str, Any]], tools: Sequence[Mapping[str, Any]], fmt: ToolFormat
) -> list[dict[str, Any]]:
    described = "\n".join(
        json.dumps({k: v for k, v in _function(t).items() if k in ("name", "description", "parameters")},
                   ensure_ascii=False)
        for t in tools
    )
    system = GENERIC_SYSTEM.format(tools=described) if tools else ""
    out: list[dict[str, Any]] = []
    for m in messages:
        role = m.get("role")
        if role == "system" and system and not out:
            out.append({**m, "content": f"{_text(m)}\n\n{system}"})
            system = ""
            continue
        if system:
            out.append({"role": "system", "content": system})
            system = ""
        if role == "tool":
            body = f"<tool_response>\n{_text(m)}\n</tool_response>"
            if out and out[-1].get("role") == "user" and out[-1].get("_results"):
                out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n{body}"}
            else:
                out.append({"role": "user", "content": body, "_results": True})
            continue
        if role == "assistant" and m.get("tool_calls"):
            lines = [_text(m)] if _text(m) else []
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


def _text(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            str(cast(Mapping[str, Any], p).get("text", ""))
            for p in cast(list[Any], content)
            if isinstance(p, Mapping)
        )
    return ""


# -- parsing ---------------------------------------------------------------------------------

Event = str | ToolCallDelta  # answer text, or part of a call


@dataclass
class _Call:
    """A call being read: its text so far and what of it went out."""

    text: str = ""
    name: str | None = None
    sent: int = 0  # characters of the arguments' text already streamed
    string_args: bool = False  # arguments written as a JSON string: sent whole at the end


@dataclass
class ToolCallParser:
    """Splits a streamed answer into text and tool-call deltas, in the format's markup.

    Text that may begin a marker is held until it can be told apart. A call streams once its
    name is read: the arguments' JSON text as it grows. Markup that turns out not to be a call
    (no name, no object) goes out as text; a call cut off by the end of the answer keeps what
    it had."""

    format: ToolFormat
    calls: int = 0
    _held: str = ""
    _call: _Call | None = None
    _await_array: bool = False
    _in_array: bool = False
    _space: str = ""  # space after a call, dropped unless more text follows
    _answered: bool = False  # some non-space text went out (a bare call must open the answer)
    _events: list[Event] = field(default_factory=lambda: list[Event]())

    def feed(self, text: str) -> list[Event]:
        self._held += text
        self._run(final=False)
        out, self._events = self._events, []
        return out

    def finish(self) -> list[Event]:
        self._run(final=True)
        if self._call is not None:
            self._close_call(cut=True)
        if self._held:
            self._emit_text(self._held)
            self._held = ""
        out, self._events = self._events, []
        return out

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

    def _emit_text(self, text: str) -> None:
        if not text:
            return
        if self.calls and not text.strip():
            self._space += text  # between calls or after the last: dropped unless text follows
            return
        text, self._space = self._space + text, ""
        if text.strip():
            self._answered = True
        if self._events and isinstance(self._events[-1], str):
            self._events[-1] += text
        else:
            self._events.append(text)


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


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
    i = _skip(text, 1)
    if i >= len(text):
        return scan
    if text[i] == "}":
        scan.end = i + 1
        return scan
    while i < len(text):
        if text[i] != '"':
            scan.broken = True
            return scan
        key_end = _string_end(text, i)
        if key_end is None:
            return scan
        try:
            key = json.loads(text[i:key_end])
        except ValueError:
            scan.broken = True
            return scan
        i = _skip(text, key_end)
        if i >= len(text):
            return scan
        if text[i] != ":":
            scan.broken = True
            return scan
        i = _skip(text, i + 1)
        if i >= len(text):
            return scan
        value_end = _value_end(text, i)
        if key in argument_keys and scan.args_start is None:
            scan.args_start = i
            scan.args_end = value_end
        if value_end is None:
            if key == "name" or text[i] not in '{["-0123456789tfn':
                scan.broken = text[i] not in '{["-0123456789tfn'
            return scan
        if key == "name":
            try:
                name = json.loads(text[i:value_end])
            except ValueError:
                name = None
            if isinstance(name, str) and scan.name is None:
                scan.name = name
        i = _skip(text, value_end)
        if i >= len(text):
            return scan
        if text[i] == "}":
            scan.end = i + 1
            return scan
        if text[i] != ",":
            scan.broken = True
            return scan
        i = _skip(text, i + 1)
    return scan


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    """The index after the JSON string that opens at `i`, or None if it is not closed yet."""
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return None


def _value_end(text: str, i: int) -> int | None:
    """The index after the JSON value that opens at `i`, or None if it is not complete yet (a
    number or literal is complete only when something follows it)."""
    c = text[i]
    if c == '"':
        return _string_end(text, i)
    if c in "{[":
        depth, j = 0, i
        while j < len(text):
            ch = text[j]
            if ch == '"':
                end = _string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(text) and text[j] not in ",}] \t\r\n":
        j += 1
    return j if j < len(text) else None
