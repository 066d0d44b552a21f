"""What every call format shares: the calls read back, a format's interface, and the parser's
text side (answer text goes out as soon as it cannot begin a marker)."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

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


@dataclass(frozen=True)
class Thought:
    """Reasoning a format marks in its own markup (gpt-oss's analysis channel)."""

    text: str


Event = str | ToolCallDelta | Thought  # answer text, part of a call, or reasoning
Messages = list[dict[str, Any]]


class ToolFormat(ABC):
    """How one family of templates asks for calls: the markup the model writes (`markers`:
    kept when decoding, named by token id in grammars), a parser reading it back, a grammar
    forcing it, and the messages and tools the template is handed."""

    name: str
    markers: tuple[str, ...]
    # Its markup structures every answer, calls or not (harmony's channels): the parser reads
    # answers to chats without tools too.
    structured: bool = False

    @abstractmethod
    def parser(self, tools: Sequence[Mapping[str, Any]] = ()) -> ToolCallParser:
        """A fresh parser for one answer; `tools` (the request's) may tell how to read values."""

    def grammar(
        self,
        tools: Sequence[Mapping[str, Any]],
        allowed: Sequence[str] = (),
        parallel: bool = True,
        special_id: Mapping[str, int] | None = None,
    ) -> str:
        """A Lark grammar (llguidance's dialect) whose every sentence is one call (or, with
        `parallel` where the format allows it, one or more) of a declared tool, `allowed` ones
        only when given, with arguments valid under the tool's JSON schema. `special_id`: the
        token id of each marker that is one special token (written `<[id]>`, the only way to
        name it in a grammar)."""
        return self._lark(
            chosen_functions(tools, allowed), parallel, lambda text: literal(text, special_id)
        )

    @abstractmethod
    def _lark(
        self, functions: Sequence[Mapping[str, Any]], parallel: bool, mark: Callable[[str], str]
    ) -> str:
        """The grammar of calls of `functions`; `mark(text)` writes a marker in it."""

    def render(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]
    ) -> tuple[Messages, Messages]:
        """The messages and tools to hand the template: assistant calls with their arguments
        as objects (as most templates expect, writing them with `tojson`)."""
        return [hf_message(m) for m in messages], [dict(t) for t in tools]

    def __repr__(self) -> str:
        return f"<ToolFormat {self.name}>"


def chosen_functions(
    tools: Sequence[Mapping[str, Any]], allowed: Sequence[str]
) -> list[Mapping[str, Any]]:
    """The functions a forced call may name: the declared ones, `allowed` ones only if given."""
    names = set(allowed)
    chosen = [f for f in (function_of(t) for t in tools) if not names or f["name"] in names]
    if not chosen:
        raise ChatTemplateError("tool_choice names no declared tool")
    return chosen


def function_of(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    """The function a tool declares (OpenAI's `{"type": "function", "function": {...}}`)."""
    inner = tool.get("function", tool)
    if not isinstance(inner, Mapping) or not isinstance(cast(Mapping[str, Any], inner).get("name"), str):
        raise ChatTemplateError("each tool must be {'type': 'function', 'function': {'name': ...}}")
    return cast(Mapping[str, Any], inner)


def parameters_of(function: Mapping[str, Any]) -> Mapping[str, Any]:
    """The JSON schema of a function's arguments (any object when it declares none)."""
    params = function.get("parameters")
    if isinstance(params, Mapping) and params:
        return cast(Mapping[str, Any], params)
    return {"type": "object"}


def literal(text: str, special_id: Mapping[str, int] | None) -> str:
    """`text` in a Lark grammar: its token when it is one special token, else a string."""
    if special_id and text in special_id:
        return f"<[{special_id[text]}]>"
    return json.dumps(text)


def hf_message(message: Mapping[str, Any], *, arguments_as_text: bool = False) -> dict[str, Any]:
    """A message as templates read it: tool calls' arguments as objects (`arguments_as_text`:
    as JSON text, for templates that concatenate them); arguments that are no JSON object stay
    text; an empty `tool_calls` is dropped (templates test its presence, not its length)."""
    out = dict(message)
    calls = out.get("tool_calls")
    if not calls:
        out.pop("tool_calls", None)
        return out
    fixed: list[dict[str, Any]] = []
    for call in cast(list[Any], calls):
        entry = dict(cast(Mapping[str, Any], call))
        function = dict(cast(Mapping[str, Any], entry.get("function") or {}))
        args = function.get("arguments")
        if arguments_as_text and not isinstance(args, str):
            function["arguments"] = json.dumps(args if args is not None else {}, ensure_ascii=False)
        elif isinstance(args, str) and not arguments_as_text:
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


def message_text(message: Mapping[str, Any]) -> str:
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


def described_tools(tools: Sequence[Mapping[str, Any]]) -> str:
    """One JSON line per tool (name, description, parameters), for a system turn."""
    keep = ("name", "description", "parameters")
    return "\n".join(
        json.dumps({k: v for k, v in function_of(t).items() if k in keep}, ensure_ascii=False)
        for t in tools
    )


def with_system(messages: Messages, text: str) -> Messages:
    """`messages` with `text` added to the first system turn (a new one first if none)."""
    if not text:
        return messages
    if messages and messages[0].get("role") == "system":
        first = messages[0]
        joined = f"{message_text(first)}\n\n{text}" if message_text(first) else text
        return [{**first, "content": joined}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


# -- parsing ---------------------------------------------------------------------------------


class ToolCallParser(ABC):
    """Splits a streamed answer into text and tool-call deltas, in one format's markup.

    Text that may begin a marker is held until it can be told apart. Space between or after
    calls goes out only if more text follows. A format's parser reads `_held` in `_run` and
    closes what the answer's end cut in `_cut`."""

    def __init__(self) -> None:
        self.calls = 0  # calls begun (named) so far
        self._held = ""
        self._events: list[Event] = []
        self._space = ""
        self._answered = False  # some non-space text went out

    def feed(self, text: str) -> list[Event]:
        self._held += text
        self._run(final=False)
        out, self._events = self._events, []
        return out

    def finish(self) -> list[Event]:
        self._run(final=True)
        self._cut()
        if self._held:
            self._emit_text(self._held)
            self._held = ""
        out, self._events = self._events, []
        return out

    @abstractmethod
    def _run(self, final: bool) -> None:
        """Read as much of `_held` as can be told apart (all of it when `final`)."""

    @abstractmethod
    def _cut(self) -> None:
        """Close a call the answer's end cut (it keeps what it had)."""

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

    def _name(self, name: str) -> None:
        """Begin the next call."""
        self._space = ""
        self._events.append(ToolCallDelta(self.calls, name, ""))
        self.calls += 1

    def _arguments(self, text: str) -> None:
        """More of the current call's arguments."""
        if text:
            self._events.append(ToolCallDelta(self.calls - 1, None, text))

    def _text_until(self, markers: Sequence[str], final: bool) -> tuple[str, str] | None:
        """Emit held text up to the first of `markers` and return (marker, text before it),
        consuming both; None when no marker is there yet (what may begin one stays held)."""
        text, marker = self._take_until(markers, final)
        self._emit_text(text)
        return None if marker is None else (marker, text)

    def _take_whole(self, markers: Sequence[str]) -> tuple[str, str] | None:
        """Take held text up to the first of `markers` (consumed too) as (text, marker); None,
        taking nothing, while no marker is there."""
        text, marker = self._take_until(markers, final=True)
        if marker is None:
            self._held = text
            return None
        return text, marker

    def _take_until(self, markers: Sequence[str], final: bool) -> tuple[str, str | None]:
        """Take held text up to the first of `markers` (consumed too): (text, marker), or
        (what surely precedes any marker, None) when none is there yet."""
        found = [(at, m) for m in markers if (at := self._held.find(m)) >= 0]
        if found:
            at, marker = min(found, key=lambda f: (f[0], -len(f[1])))
            text = self._held[:at]
            self._held = self._held[at + len(marker) :]
            return text, marker
        keep = 0 if final else max(partial_suffix(self._held, m) for m in markers)
        text = self._held[: len(self._held) - keep]
        self._held = self._held[len(self._held) - keep :]
        return text, None


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def string_end(text: str, i: int) -> int | None:
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


def value_end(text: str, i: int) -> int | None:
    """The index after the JSON value that opens at `i`, or None if it is not complete yet (a
    number or literal is complete only when something follows it)."""
    c = text[i]
    if c == '"':
        return string_end(text, i)
    if c in "{[":
        depth, j = 0, i
        while j < len(text):
            ch = text[j]
            if ch == '"':
                end = string_end(text, j)
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
