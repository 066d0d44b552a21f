"""Reasoning: the part of an answer a thinking template sets apart (`<think>...</think>` in
Qwen3, DeepSeek-R1, GLM-4.5 and others), streamed on its own channel."""

from __future__ import annotations

from dataclasses import dataclass

from mlx_omnia.engine.text.tools.calls import partial_suffix

Channel = str  # "reasoning" or "content"


@dataclass(frozen=True)
class ReasoningFormat:
    """A template's reasoning markers: the answer reasons between `begin` and `end`."""

    begin: str = "<think>"
    end: str = "</think>"

    def splitter(self, prompt: str) -> ReasoningSplitter:
        """A splitter for an answer to `prompt`: one whose generation prompt opens the block
        (DeepSeek-R1's ends with `<think>`) starts inside it."""
        inside = prompt.rstrip().endswith(self.begin)
        return ReasoningSplitter(self, inside=inside, _after_begin=inside)


THINK = ReasoningFormat()


def reasoning_format(template_source: str | None) -> ReasoningFormat | None:
    """The reasoning markers a chat template writes, or None for a template without them."""
    if template_source and THINK.begin in template_source and THINK.end in template_source:
        return THINK
    return None


@dataclass
class ReasoningSplitter:
    """Splits streamed answer text into (channel, text) runs: reasoning inside the markers,
    content after them. A marker split across pieces is held until it can be told apart; the
    blank lines after the end marker are the template's, not the answer's."""

    format: ReasoningFormat
    inside: bool = False
    done: bool = False  # the block has closed (one block an answer)
    _held: str = ""
    _started: bool = False  # some text has come (a block opens only at the answer's start)
    _after_begin: bool = False
    _after_end: bool = False

    def feed(self, text: str) -> list[tuple[Channel, str]]:
        self._held += text
        return self._run(final=False)

    def finish(self) -> list[tuple[Channel, str]]:
        return self._run(final=True)

    def _run(self, final: bool) -> list[tuple[Channel, str]]:
        out: list[tuple[Channel, str]] = []
        fmt = self.format
        while self._held:
            if self.done:
                text = self._held
                if self._after_end:
                    text = text.lstrip("\n")
                    if not text and not final:
                        self._held = ""
                        break
                    self._after_end = False
                self._held = ""
                if text:
                    out.append(("content", text))
                break
            if not self.inside:
                lead = self._held.lstrip()
                if not self._started and fmt.begin.startswith(lead) and not final and lead != fmt.begin:
                    break  # may still become the opening marker
                self._started = True
                if lead.startswith(fmt.begin):
                    self._held = lead[len(fmt.begin) :]
                    self.inside = self._after_begin = True
                    continue
                self.done = True  # no block at the start: all content
                continue
            if self._after_begin:  # the template's line break after the opening marker
                self._held = self._held.lstrip("\n")
                if not self._held:
                    break
                self._after_begin = False
            at = self._held.find(fmt.end)
            if at < 0:
                keep = 0
                if not final:  # a marker's start, and the line breaks that may come before it
                    keep = partial_suffix(self._held, fmt.end)
                    keep += len(self._held[: len(self._held) - keep]) - len(
                        self._held[: len(self._held) - keep].rstrip("\n")
                    )
                text = self._held[: len(self._held) - keep]
                self._held = self._held[len(self._held) - keep :]
                if text:
                    out.append(("reasoning", text))
                break
            text = self._held[:at].rstrip("\n")
            if text:
                out.append(("reasoning", text))
            self._held = self._held[at + len(fmt.end) :]
            self.inside, self.done, self._after_end = False, True, True
        return _joined(out)


def _joined(runs: list[tuple[Channel, str]]) -> list[tuple[Channel, str]]:
    out: list[tuple[Channel, str]] = []
    for channel, text in runs:
        if out and out[-1][0] == channel:
            out[-1] = (channel, out[-1][1] + text)
        else:
            out.append((channel, text))
    return out
