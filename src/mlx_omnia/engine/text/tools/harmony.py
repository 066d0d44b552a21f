"""gpt-oss's harmony format: an answer is a run of messages, each a header (channel, maybe a
recipient) then `<|message|>` and a body. A message to `functions.NAME` is a call whose body is
the arguments' JSON; an analysis message is reasoning (Thought events); the others (final) are
text.
The generation prompt ends with `<|start|>assistant`, so the answer opens inside the first
header:

    <|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary
    to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

from mlx_omnia.engine.text.tools.calls import (
    JSON_LAYOUT,
    Messages,
    Thought,
    ToolCallParser,
    ToolFormat,
    parameters_of,
)

START, CHANNEL, CONSTRAIN, MESSAGE = "<|start|>", "<|channel|>", "<|constrain|>", "<|message|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
# How the first header of an answer may begin (right after `<|start|>assistant`).
_HEADER_OPENINGS = (CHANNEL, " to=", "to=", CONSTRAIN, MESSAGE)
_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")


class HarmonyFormat(ToolFormat):
    name = "harmony"
    markers = (START, CHANNEL, CONSTRAIN, MESSAGE, END, CALL, RETURN)
    structured = True

    def parser(self, tools: Sequence[Mapping[str, Any]] = ()) -> HarmonyParser:
        return HarmonyParser()

    def _lark(
        self, functions: Sequence[Mapping[str, Any]], parallel: bool, mark: Callable[[str], str]
    ) -> str:
        """One call, as gpt-oss writes it; `<|call|>`, which closes it, is one of gpt-oss's end
        tokens, so a turn holds one call whatever `parallel` says."""
        rules: list[str] = []
        for n, f in enumerate(functions):
            schema = {"x-guidance": JSON_LAYOUT, **parameters_of(f)}
            header = json.dumps(f" to=functions.{f['name']} ")
            rules.append(
                f"call{n}: {mark(CHANNEL)} \"commentary\" {header} "
                f"{mark(CONSTRAIN)} \"json\" {mark(MESSAGE)} "
                f"%json {json.dumps(schema)}"
            )
        alternatives = " | ".join(f"call{n}" for n in range(len(rules)))
        return f"start: {alternatives}\n" + "\n".join(rules) + "\n"

    def render(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]
    ) -> tuple[Messages, Messages]:
        """The template writes only the first call of an assistant turn and names each result
        after the last call: a turn of several calls becomes one turn per call, each followed
        by its result."""
        out, template_tools = super().render(messages, tools)
        return _one_call_a_turn(out), template_tools


def _one_call_a_turn(messages: Messages) -> Messages:
    out: Messages = []
    i = 0
    while i < len(messages):
        m = messages[i]
        calls = cast(list[dict[str, Any]], m.get("tool_calls") or [])
        if m.get("role") != "assistant" or len(calls) < 2:
            out.append(m)
            i += 1
            continue
        j = i + 1
        while j < len(messages) and messages[j].get("role") == "tool":
            j += 1
        results = messages[i + 1 : j]
        for n, call in enumerate(calls):
            out.append({**m, "content": m.get("content") if n == 0 else "", "tool_calls": [call]})
            own = [r for r in results if r.get("tool_call_id") == call.get("id")]
            if not own and len(results) == len(calls):
                own = [results[n]]  # results without ids: in the calls' order
            out.extend(own)
        out.extend(r for r in results if r not in out)
        i = j
    return out


HARMONY = HarmonyFormat()


class HarmonyParser(ToolCallParser):
    """Reads harmony messages: bodies addressed to a function stream as calls, final (and
    other) bodies go out as text, analysis bodies as reasoning (Thought, also gathered in
    `reasoning`); headers and markers go nowhere."""

    def __init__(self) -> None:
        super().__init__()
        self.reasoning = ""
        self._state = "opening"  # opening | header | body | between
        self._body = "text"  # what the body being read is: text | call | analysis
        self._args = ""
        self._sent = 0

    def _run(self, final: bool) -> None:
        while self._held:
            if self._state == "opening":
                held = self._held
                if any(held.startswith(o) for o in _HEADER_OPENINGS):
                    self._state = "header"
                elif not final and any(o.startswith(held) for o in _HEADER_OPENINGS):
                    return
                else:
                    self._state = "body"  # no header: plain text
                continue
            if self._state == "header":
                at = self._held.find(MESSAGE)
                if at < 0:
                    if final:
                        self._held = ""  # a header the answer's end cut: nothing to say
                    return
                header, self._held = self._held[:at], self._held[at + len(MESSAGE) :]
                self._open(header)
                continue
            if self._state == "body":
                markers = (END, CALL, RETURN, START)
                if self._body == "text":
                    found = self._text_until(markers, final)
                    marker = None if found is None else found[0]
                else:
                    text, marker = self._take_until(markers, final)
                    if self._body == "call":
                        self._read_args(text)
                    elif text:
                        self.reasoning += text
                        self._events.append(Thought(text))
                if marker is None:
                    return
                if self._body == "call":
                    self._close()
                self._state = "header" if marker == START else "between"
                continue
            found = self._text_until([START], final)  # between messages
            if found is None:
                return
            self._state = "header"

    def _open(self, header: str) -> None:
        recipient = _RECIPIENT.search(header)
        channel = _CHANNEL.search(header)
        self._state = "body"
        if recipient is not None:
            self._body = "call"
            self._name(recipient.group(1))
            self._args, self._sent = "", 0
        elif channel is not None and channel.group(1) == "analysis":
            self._body = "analysis"
        else:
            self._body = "text"

    def _read_args(self, text: str) -> None:
        self._args += text
        body = self._args.strip()
        start = len(self._args) - len(self._args.lstrip())
        upto = start + len(body)
        self._arguments(self._args[start + self._sent : upto])
        self._sent = max(self._sent, upto - start)

    def _close(self) -> None:
        if not self._args.strip():
            self._arguments("{}")
        self._body = "text"

    def _cut(self) -> None:
        if self._state == "body" and self._body == "call":
            self._close()
