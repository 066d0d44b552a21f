"""`omnia chat`: a streaming chat REPL over OpenAI chat completions."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console, ConsoleOptions, RenderableType, RenderResult
from rich.live import Live
from rich.markdown import Markdown
from rich.segment import Segment

from mlx_omnia.cli.client import (
    EXIT_ERROR,
    EXIT_OK,
    Answer,
    CliError,
    JsonObject,
    ServerError,
    as_list,
    as_object,
)
from mlx_omnia.cli.commands import Context, chat_body

PROMPT = ">>> "
CONTINUE = "... "
FENCE = '"""'

HELP = f"""\
Type a message and press Enter; the answer streams in and is rendered as Markdown.

Multi-line input:
  end a line with \\ to continue on the next line, or
  start with {FENCE} and end with a line that ends with {FENCE} (everything between is sent as is;
  use this too for a message that starts with "/").

Commands:
  /help           this help
  /reset          forget the conversation (keeps the system message and the model)
  /system TEXT    set the system message (and reset); /system alone removes it
  /model NAME     switch to another model on the server (keeps the conversation);
                  /model alone shows the current one
  /exit, /quit    leave (or Ctrl-D)

Ctrl-C during an answer stops it (the server stops generating) and keeps what was said;
Ctrl-C at the prompt clears the line."""


class _Tail:
    """The last `height` lines of a renderable: what fits on screen while an answer streams."""

    def __init__(self, renderable: RenderableType, height: int) -> None:
        self.renderable = renderable
        self.height = max(1, height)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        lines = console.render_lines(self.renderable, options, pad=False)
        for line in lines[-self.height :]:
            yield from line
            yield Segment.line()


@dataclass
class Session:
    ctx: Context
    model: str
    system: str | None
    max_tokens: int | None
    temperature: float | None
    seed: int | None
    console: Console
    history: list[JsonObject] = field(default_factory=list[JsonObject])

    def messages(self) -> list[JsonObject]:
        head: list[JsonObject] = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.history

    # -- commands ---------------------------------------------------------------------------------

    def command(self, line: str) -> bool:
        """Run a /command; False to leave."""
        name, _, rest = line.strip().partition(" ")
        rest = rest.strip()
        say = self.console.print
        if name in ("/exit", "/quit", "/bye"):
            return False
        if name in ("/help", "/?"):
            say(HELP, markup=False, highlight=False)
        elif name == "/reset":
            self.history.clear()
            say("conversation reset", style="dim")
        elif name == "/system":
            self.system = rest or None
            self.history.clear()
            say(
                "system message set; conversation reset" if rest else "system message removed",
                style="dim",
            )
        elif name == "/model":
            if not rest:
                say(f"model: {self.model}", style="dim", highlight=False)
            else:
                self.switch(rest)
        else:
            say(f"unknown command {name}; /help lists them", style="yellow", highlight=False)
        return True

    def switch(self, model: str) -> None:
        try:
            missing = not_served(self.ctx, model)
        except CliError as e:
            self.console.print(f"error: {e.message}", style="red", markup=False, highlight=False)
            return
        if missing:
            self.console.print(missing, style="yellow", markup=False, highlight=False)
            return
        self.model = model
        self.console.print(f"model: {model}", style="dim", highlight=False)

    # -- one exchange ------------------------------------------------------------------------------

    def ask(self, text: str) -> None:
        self.history.append({"role": "user", "content": text})
        body = chat_body(
            self.model,
            self.messages(),
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            seed=self.seed,
        )
        answer = Answer()
        started = time.monotonic()
        interrupted = False
        try:
            self._stream(body, answer)
        except KeyboardInterrupt:
            interrupted = True
        except CliError as e:
            self.history.pop()
            self._final(answer.text)
            message = e.message
            if isinstance(e, ServerError) and e.code == "context_length_exceeded":
                message += " (/reset starts a new conversation)"
            self.console.print(f"error: {message}", style="red", markup=False, highlight=False)
            return
        elapsed = time.monotonic() - started
        self._final(answer.text)
        if answer.text:
            self.history.append({"role": "assistant", "content": answer.text})
        else:
            self.history.pop()
        if interrupted:
            self.console.print("[interrupted]", style="yellow", markup=False)
            return
        stats = f"{answer.completion_tokens} tokens" if answer.completion_tokens else ""
        if answer.completion_tokens and elapsed > 0:
            stats += f", {answer.completion_tokens / elapsed:.1f} tok/s"
        if answer.finish_reason == "length":
            stats += " (stopped at the token limit)"
        if stats:
            self.console.print(stats, style="dim", highlight=False)

    def _stream(self, body: JsonObject, answer: Answer) -> None:
        pieces = self.ctx.client.chat(body, answer)
        ctrl_c = _CtrlC()
        with contextlib.closing(pieces), ctrl_c, _typing_ignored():
            if not self.console.is_terminal:
                for text in pieces:
                    with ctrl_c.held():
                        self.console.file.write(text)
                        self.console.file.flush()
                return
            height = max(3, self.console.size.height - 2)
            with Live(
                console=self.console, auto_refresh=False, transient=True, vertical_overflow="crop"
            ) as live:
                shown = 0.0
                for _ in pieces:
                    now = time.monotonic()
                    if now - shown >= 0.05:
                        with ctrl_c.held():  # never half a frame on screen
                            live.update(_Tail(Markdown(answer.text), height), refresh=True)
                        shown = now

    def _final(self, text: str) -> None:
        if not text:
            return
        if self.console.is_terminal:
            self.console.print(Markdown(text))
        else:
            self.console.file.write("\n")
        self.console.print()


class _CtrlC:
    """SIGINT while an answer streams: KeyboardInterrupt at once while waiting for the server,
    but after the frame being drawn (`held`), so the screen never keeps half a frame that the
    final answer then repeats."""

    def __init__(self) -> None:
        self._holding = False
        self._pending = False
        self._installed = False
        self._previous: Any = None

    def _handle(self, signum: int, frame: object) -> None:
        if self._holding:
            self._pending = True
        else:
            raise KeyboardInterrupt

    def __enter__(self) -> _CtrlC:
        if threading.current_thread() is threading.main_thread():  # signals go to it only
            self._previous = signal.signal(signal.SIGINT, self._handle)
            self._installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            previous = self._previous  # None: a handler set outside Python; Python's default then
            signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)
            self._installed = False

    @contextlib.contextmanager
    def held(self) -> Generator[None]:
        self._holding = True
        try:
            yield
        finally:
            self._holding = False
        if self._pending:
            self._pending = False
            raise KeyboardInterrupt


@contextlib.contextmanager
def _typing_ignored() -> Generator[None]:
    """While an answer streams, keys typed are not echoed into it and are dropped when it ends
    (they would otherwise be sent as the next message unseen); Ctrl-C still interrupts."""
    stdin = sys.stdin
    try:
        import termios

        fd = stdin.fileno()
        saved = termios.tcgetattr(fd) if stdin.isatty() else None
    except (ImportError, OSError, ValueError):
        yield
        return
    if saved is None:
        yield
        return
    quiet = list(saved)
    quiet[3] = saved[3] & ~termios.ECHO  # lflag: no echo, line mode and signals kept
    termios.tcsetattr(fd, termios.TCSANOW, quiet)
    try:
        yield
    finally:
        termios.tcflush(fd, termios.TCIFLUSH)
        termios.tcsetattr(fd, termios.TCSANOW, saved)


def read_message(read: Callable[[str], str]) -> tuple[str, bool]:
    """One message from the user: a line, lines joined by a trailing backslash, or a fenced
    block; and whether it was fenced (never a command). EOFError (Ctrl-D) and KeyboardInterrupt
    (Ctrl-C) propagate."""
    line = read(PROMPT)
    stripped = line.strip()
    if stripped.startswith(FENCE):
        first = stripped[len(FENCE) :]
        if first.endswith(FENCE):  # """one line"""
            return first[: -len(FENCE)], True
        lines = [first] if first else []
        while True:
            more = read(CONTINUE)
            if more.rstrip().endswith(FENCE):
                last = more.rstrip()[: -len(FENCE)]
                if last:
                    lines.append(last)
                return "\n".join(lines), True
            lines.append(more)
    parts: list[str] = []
    while line.endswith("\\"):
        parts.append(line[:-1])
        line = read(CONTINUE)
    parts.append(line)
    return "\n".join(parts), False


def not_served(ctx: Context, model: str) -> str | None:
    """Why the server cannot answer with `model` (not on its list), else None."""
    listing = ctx.client.get("/admin/models")
    ids = {str(as_object(m).get("id")) for m in as_list(listing.get("models"))}
    if model in ids or model.lower() in ids:
        return None
    return (f"{model} is not on the server's disk: omnia models list shows what is; "
            f"omnia pull {model} downloads a hub model")


def repl(ctx: Context, args: Any) -> int:
    with contextlib.suppress(ImportError):
        import readline  # line editing and history for input()

        del readline
    console = Console(highlight=False)
    ctx.ensure_server()
    model = args.model or ctx.client.default_model()
    missing = not_served(ctx, model) if args.model else None
    if missing:  # say so now, not after the first message
        ctx.err.print(f"error: {missing}", markup=False, highlight=False)
        return EXIT_ERROR
    session = Session(
        ctx,
        model,
        args.system,
        args.max_tokens,
        args.temperature,
        args.seed,
        console,
    )
    console.print(
        f"omnia chat: {model} at {ctx.url}. /help for commands, Ctrl-D or /exit to leave.",
        style="dim",
        markup=False,
    )
    while True:
        try:
            text, fenced = read_message(input)
        except EOFError:
            console.print()
            return EXIT_OK
        except KeyboardInterrupt:
            console.print()
            continue
        if not text.strip():
            continue
        if not fenced and text.lstrip().startswith("/") and "\n" not in text:
            if not session.command(text):
                return EXIT_OK
            continue
        session.ask(text)
