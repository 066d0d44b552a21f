"""DeepSeek-V3/R1's calls: after the answer's text, a block of calls, each the tool's type and
name then its arguments' JSON in a fence:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

The template renders calls and results but never reads `tools`: they are described in a system
turn written here. V3.1's form (`<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}`) is read too.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from mlx_omnia.engine.text.tools.calls import (
    JSON_LAYOUT,
    Messages,
    ToolCallParser,
    ToolFormat,
    described_tools,
    hf_message,
    parameters_of,
    partial_suffix,
    value_end,
)

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"

SYSTEM = (
    "You can call these tools (JSON Schema of each one's arguments):\n{tools}\n\n"
    "To call tools, end your answer with:\n"
    f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}<tool name>\n```json\n<arguments as JSON>\n```"
    f"{CALL_END}{CALLS_END}\n"
    f"with one {CALL_BEGIN}...{CALL_END} per call, on lines of their own."
)


class DeepSeekFormat(ToolFormat):
    name = "deepseek"
    calls_begin = CALLS_BEGIN
    markers = (CALLS_BEGIN, CALL_BEGIN, SEP, CALL_END, CALLS_END)

    def parser(self, tools: Sequence[Mapping[str, Any]] = ()) -> DeepSeekParser:
        return DeepSeekParser()

    def _lark(
        self, functions: Sequence[Mapping[str, Any]], parallel: bool, mark: Callable[[str], str]
    ) -> str:
        rules: list[str] = []
        for n, f in enumerate(functions):
            schema = {"x-guidance": JSON_LAYOUT, **parameters_of(f)}
            rules.append(
                f"call{n}: {mark(CALL_BEGIN)} \"function\" {mark(SEP)} "
                f"{json.dumps(str(f['name']) + chr(10) + '```json' + chr(10))} "
                f"%json {json.dumps(schema)} \"\\n```\" {mark(CALL_END)}"
            )
        many = 'call ("\\n" call)*' if parallel else "call"
        alternatives = " | ".join(f"call{n}" for n in range(len(rules)))
        return (
            f"start: {mark(CALLS_BEGIN)} {many} {mark(CALLS_END)}\ncall: {alternatives}\n"
            + "\n".join(rules) + "\n"
        )

    def render(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]
    ) -> tuple[Messages, Messages]:
        """The tools described in a system turn; calls' arguments as JSON text (the template
        concatenates them)."""
        out = [hf_message(m, arguments_as_text=True) for m in messages]
        if not tools:
            return out, []
        system = SYSTEM.format(tools=described_tools(tools))
        if out and out[0].get("role") == "system":
            return [{**out[0], "content": f"{out[0].get('content') or ''}\n\n{system}"}, *out[1:]], []
        return [{"role": "system", "content": system}, *out], []


DEEPSEEK = DeepSeekFormat()


class DeepSeekParser(ToolCallParser):
    """Reads the block of calls after the answer's text; the arguments stream as they grow."""

    def __init__(self) -> None:
        super().__init__()
        self._state = "text"  # text | calls | head | name | args
        self._head = ""  # what came before <｜tool▁sep｜>: the type ("function"), or V3.1's name
        self._args = ""
        self._sent = 0

    def _run(self, final: bool) -> None:
        while self._held:
            state = self._state
            if state == "text":
                if self._text_until([CALLS_BEGIN], final) is None:
                    return
                self._state = "calls"
            elif state == "calls":
                held = self._held.lstrip()
                for marker, then in ((CALL_BEGIN, "head"), (CALLS_END, "text")):
                    if held.startswith(marker):
                        self._held, self._state = held[len(marker) :], then
                        break
                else:
                    if not final and (not held or partial_suffix(held, CALL_BEGIN) == len(held)
                                      or partial_suffix(held, CALLS_END) == len(held)):
                        return
                    self._state = "text"  # not a call after all: the rest is text
            elif state == "head":
                head, marker = self._take_until([SEP], final)
                self._head += head
                if marker is None:
                    return
                self._state = "name"
            elif state == "name":
                found = self._take_whole(["\n", "{", CALL_END])
                if found is None:
                    return  # the name's line is not whole yet
                name, marker = found
                if marker == "{":
                    self._held = "{" + self._held
                name = name.strip() or self._head.strip()  # V3.1: the name before the sep
                self._name(name)
                self._head, self._args, self._sent = "", "", 0
                self._state = "args"
                if marker == CALL_END:
                    self._close()
            else:
                text, marker = self._take_until([CALL_END], final)
                self._read_args(text)
                if marker is None:
                    return
                self._close()

    def _read_args(self, text: str) -> None:
        self._args += text
        start = self._args.find("{")
        if start < 0:
            return
        end = value_end(self._args, start)
        upto = len(self._args) if end is None else end
        self._arguments(self._args[start + self._sent : upto])
        self._sent = upto - start

    def _close(self) -> None:
        if "{" not in self._args:  # no object: the fenced text as it is, or none
            body = self._args.strip().removeprefix("```json").removesuffix("```").strip()
            self._arguments(body or "{}")
        self._state = "calls"

    def _cut(self) -> None:
        if self._state == "args":
            self._read_args(self._held)
            self._held = ""
        elif self._state in ("head", "name"):
            self._held = ""  # a call the answer's end cut before its name: nothing to say
