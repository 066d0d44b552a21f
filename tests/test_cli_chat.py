"""`omnia chat` driven through a pseudo-terminal (pexpect) against a live server: streaming,
/system, /reset, multi-line input, Ctrl-C mid-answer, /exit and Ctrl-D.

History and system messages are checked through the prompt sizes the server reports in
/admin/status (last_answer.prompt_tokens): what the REPL sent, not what the small model said."""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pexpect
import pytest

from mlx_omnia.server.settings import Settings
from tests.server_harness import LiveServer, free_port, live_server

PROMPT = ">>> "
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with live_server(Settings()) as s:
        yield s


def spawn(server: LiveServer, tmp_path: Path, *args: str, ready: bool = True) -> pexpect.spawn:
    """`omnia chat` on a pseudo-terminal; `ready`: waited for until it shows its prompt."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNIA_")}
    env.update(
        TERM="xterm-256color",
        HOME=str(tmp_path),
        XDG_STATE_HOME=str(tmp_path / "state"),
        OMNIA_DEFAULT_URL=f"http://127.0.0.1:{free_port()}",
    )
    child = pexpect.spawn(
        sys.executable,
        ["-m", "mlx_omnia.cli.main", "chat", "--url", server.url, *args],
        env=env,
        encoding="utf-8",
        dimensions=(30, 100),
        timeout=60,
    )
    if ready:
        child.expect_exact(PROMPT)
    return child


def type_long(child: pexpect.spawn, text: str, piece: int = 512) -> None:
    """Type a long line in pieces, reading the echo between them, then Enter: a pty's buffers
    are small, and a writer that never reads waits forever on a child blocked on its echo (seen
    with 54 KB in one write on a busy machine)."""
    for start in range(0, len(text), piece):
        child.send(text[start : start + piece])
        try:
            while True:
                child.read_nonblocking(65536, timeout=0.05)
        except pexpect.TIMEOUT:
            pass
    child.send("\r")


def answered(child: pexpect.spawn) -> None:
    """Wait for the end of an answer (its stats line) and the next prompt."""
    child.expect(r"\d+ tokens, [\d.]+ tok/s")
    child.expect_exact(PROMPT)


def last_prompt_tokens(server: LiveServer) -> int:
    return int(httpx.get(f"{server.url}/admin/status").json()["last_answer"]["prompt_tokens"])


def test_chat_session(server: LiveServer, tmp_path: Path) -> None:
    child = spawn(server, tmp_path, "--temperature", "0", "--max-tokens", "200")
    try:
        child.sendline("/help")
        child.expect_exact("Multi-line input")
        child.expect_exact(PROMPT)

        # A streamed answer, rendered.
        child.sendline(QUESTION)
        child.expect_exact("Paris")
        answered(child)
        first = last_prompt_tokens(server)

        # History: the second question carries the first exchange.
        child.sendline(QUESTION)
        answered(child)
        assert last_prompt_tokens(server) > first + 10

        # /reset forgets it.
        child.sendline("/reset")
        child.expect_exact("conversation reset")
        child.sendline(QUESTION)
        child.expect_exact("Paris")
        answered(child)
        assert last_prompt_tokens(server) == first

        # /system replaces the system message (and resets).
        child.sendline("/system " + "You are a meticulous geography teacher. " * 8)
        child.expect_exact("system message set")
        child.sendline(QUESTION)
        answered(child)
        with_system = last_prompt_tokens(server)
        assert with_system > first + 20
        child.sendline("/system")
        child.expect_exact("system message removed")

        # Multi-line input: a trailing backslash continues, and a fenced block.
        child.sendline("What is the capital\\")
        child.expect_exact("... ")
        child.sendline("of France?")
        child.expect_exact("Paris")
        answered(child)
        continued = last_prompt_tokens(server)
        child.sendline("/reset")
        child.expect_exact("conversation reset")
        child.sendline('"""')
        child.sendline("What is the capital")
        child.sendline('of France?"""')
        child.expect_exact("Paris")
        answered(child)
        assert last_prompt_tokens(server) == continued  # the same two lines, sent alike

        # Ctrl-C mid-answer: back to the prompt, the server stops generating.
        child.sendline("/reset")
        child.expect_exact("conversation reset")
        child.sendline("Write a long story about a cat who travels the world.")
        child.expect_exact("the world.\r\n")  # the echo of the question
        child.expect(r"[A-Za-z]{3,}")  # the answer has started
        time.sleep(0.5)
        child.sendintr()
        child.expect_exact("[interrupted]")
        child.expect_exact(PROMPT)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            status = httpx.get(f"{server.url}/admin/status").json()
            if status["queue_depth"] == 0 and not any(r["busy"] for r in status["resident"]):
                break
            time.sleep(0.1)
        else:
            pytest.fail("the server kept generating after Ctrl-C")

        # ...and the next question is answered.
        child.sendline("What is 2 + 2?")
        answered(child)

        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


def test_chat_ctrl_d_and_unknown_command(server: LiveServer, tmp_path: Path) -> None:
    child = spawn(server, tmp_path)
    try:
        child.sendline("/nope")
        child.expect_exact("unknown command /nope")
        child.expect_exact(PROMPT)
        child.sendline("/model acme/not-on-disk")
        child.expect_exact("not on the server's disk")
        child.expect_exact(PROMPT)
        child.sendline("/model")
        child.expect_exact("model: smollm2-135m-instruct")
        child.expect_exact(PROMPT)
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


def test_chat_with_a_model_the_server_lacks_stops_at_once(server: LiveServer, tmp_path: Path) -> None:
    """The model is checked when the chat starts, not at the first message."""
    child = spawn(server, tmp_path, "-m", "acme/nosuch", ready=False)
    child.expect_exact("error: acme/nosuch is not on the server's disk")
    child.expect_exact("omnia pull acme/nosuch")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 1 and PROMPT not in (child.before or "")


def test_chat_past_the_context_says_how_to_go_on(server: LiveServer, tmp_path: Path) -> None:
    child = spawn(server, tmp_path)
    try:
        type_long(child, "hello " * 9000)
        child.expect_exact("the most this model takes")
        child.expect_exact("(/reset starts a new conversation)")
        child.expect_exact(PROMPT)
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)


class Screen:
    """What the chat's terminal shows: its output fed to a VT100 emulator (pyte) with the
    scrolled-off lines kept, as a user would read it."""

    def __init__(self, child: pexpect.spawn, rows: int = 30, cols: int = 100) -> None:
        import pyte

        self.screen = pyte.HistoryScreen(cols, rows, history=10_000)
        self.stream = pyte.Stream(self.screen)
        self.child = child

    def expect(self, pattern: str) -> None:
        self.child.expect(pattern)
        self.stream.feed(self.child.before + self.child.after)

    def lines(self) -> list[str]:
        above = ["".join(c.data for c in row.values()) for row in self.screen.history.top]
        return [line.rstrip() for line in (*above, *self.screen.display)]


def test_ctrl_c_shows_the_partial_answer_once_and_type_ahead_is_dropped(
    server: LiveServer, tmp_path: Path
) -> None:
    # answers of at most 96 tokens: the follow-up's length depends on where the interrupt cut
    # the story (the history), and an unbounded one outlasted the 60 s wait under CI load
    child = spawn(server, tmp_path, "--max-tokens", "96")
    screen = Screen(child)
    try:
        child.sendline("Write a long story about a cat who travels the world.")
        screen.expect(r"the world\.\r\n")
        screen.expect(r"[A-Za-z]{3,} [A-Za-z]{3,}")  # the answer has started
        child.send("zzq typed ahead\r")  # typed while the answer streams
        time.sleep(0.5)
        child.sendintr()
        screen.expect(r"\[interrupted\]")
        screen.expect(re.escape(PROMPT))
        lines = [line for line in screen.lines() if line.strip()]
        at = next(i for i, line in enumerate(lines) if "the world." in line)
        answer = lines[at + 1 : lines.index("[interrupted]", at)]
        assert answer, lines
        assert lines.count(answer[0]) == 1, lines  # the partial answer once, not twice
        assert not any("zzq" in line for line in lines), lines  # not echoed into it
        child.sendline("What is 2 + 2?")
        screen.expect(r"\d+ tokens, [\d.]+ tok/s")
        screen.expect(re.escape(PROMPT))
        # the type-ahead was dropped, not sent as a message of its own
        assert not any("zzq" in line for line in screen.lines())
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
