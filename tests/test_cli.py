"""The `omnia` CLI end to end: real subprocesses against a live server (in-process harness) and,
for auto-start, a daemon the CLI starts itself on a free port (OMNIA_DEFAULT_URL), with HOME and
XDG_STATE_HOME in tmp dirs and a hub-shaped loopback server for pulls. Nothing touches 8642."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlx_omnia.cli import daemon
from mlx_omnia.cli.chat import read_message
from mlx_omnia.cli.client import UsageError, parse_sse
from mlx_omnia.cli.commands import read_prompt
from mlx_omnia.install import install_stamp
from mlx_omnia.server.settings import Settings
from tests.hub_server import HubServer
from tests.server_harness import LiveServer, free_port, live_server

CLI = [sys.executable, "-m", "mlx_omnia.cli.main"]
QUESTION = "What is the capital of France?"
ANSWER = "The capital of France is Paris."
STORY = "Write a short story about a cat."


def base_env(tmp: Path, **extra: str) -> dict[str, str]:
    """The tester's environment without OMNIA_*, with state in `tmp` and a default URL no real
    server uses, so that a test can never start (or reach) a daemon on 8642."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNIA_")}
    env.update(
        HOME=str(tmp),
        XDG_STATE_HOME=str(tmp / "state"),
        OMNIA_DEFAULT_URL=f"http://127.0.0.1:{free_port()}",
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


def omnia(
    *args: str, env: dict[str, str], stdin: str | None = None, timeout: float = 90
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args],
        input=stdin if stdin is not None else "",
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with live_server(Settings()) as s:
        yield s


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return base_env(tmp_path)


# -- pure pieces -----------------------------------------------------------------------------------


def test_parse_sse() -> None:
    lines = [
        ": keep-alive",
        "",
        "event: running",
        'data: {"a":1}',
        "",
        "data: line one",
        "data:line two",
        "id: 7",
        "",
        "data: [DONE]",
    ]
    events = list(parse_sse(lines))
    assert [(e.event, e.data) for e in events] == [
        ("running", '{"a":1}'),
        (None, "line one\nline two"),
        (None, "[DONE]"),
    ]


def test_read_message_multiline() -> None:
    def reader(*lines: str) -> Any:
        it = iter(lines)
        return lambda prompt: next(it)

    assert read_message(reader("hello")) == ("hello", False)
    assert read_message(reader("one \\", "two\\", "three")) == ("one \ntwo\nthree", False)
    assert read_message(reader('"""', "a", "/b", '"""')) == ("a\n/b", True)
    assert read_message(reader('"""first', 'last"""')) == ("first\nlast", True)
    assert read_message(reader('"""/literal"""')) == ("/literal", True)


class _Stdin(io.StringIO):
    def __init__(self, text: str, tty: bool = False) -> None:
        super().__init__(text)
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_read_prompt_combines_argument_and_stdin() -> None:
    assert read_prompt("Summarize:", _Stdin("some text\n")) == "Summarize:\n\nsome text"
    assert read_prompt(None, _Stdin("only stdin")) == "only stdin"
    assert read_prompt("only arg", _Stdin("")) == "only arg"
    assert read_prompt("arg", _Stdin("ignored", tty=True)) == "arg"
    with pytest.raises(UsageError):
        read_prompt(None, _Stdin("  \n"))


def test_default_url_and_log_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("OMNIA_DEFAULT_URL", raising=False)
    assert daemon.default_url() == "http://127.0.0.1:8642"
    assert daemon.is_default("http://127.0.0.1:8642")
    assert daemon.is_default("http://localhost:8642/")
    assert not daemon.is_default("http://127.0.0.1:8643")
    assert not daemon.is_default("http://192.168.1.5:8642")
    assert not daemon.is_default("https://127.0.0.1:8642")
    monkeypatch.setenv("OMNIA_DEFAULT_URL", "http://127.0.0.1:9999")
    assert daemon.is_default("http://127.0.0.1:9999") and not daemon.is_default(
        "http://127.0.0.1:8642"
    )
    if sys.platform != "darwin":
        monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
        assert daemon.log_dir() == tmp_path / "mlx-omnia"
        monkeypatch.delenv("XDG_STATE_HOME")
        assert daemon.log_dir() == Path.home() / ".local" / "state" / "mlx-omnia"


def test_cli_never_imports_mlx() -> None:
    code = (
        "import sys, mlx_omnia.cli.main, mlx_omnia.cli.chat, mlx_omnia.cli.commands; "
        "bad = [m for m in sys.modules if m == 'mlx' or m.startswith(('mlx.', "
        "'mlx_omnia.engine', 'mlx_omnia.server'))]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)


# -- usage and reachability ------------------------------------------------------------------------


def test_help_documents_exit_codes(env: dict[str, str]) -> None:
    result = omnia("--help", env=env)
    assert result.returncode == 0
    for code in ("0 ", "1 ", "2 ", "3 ", "130"):
        assert f"\n  {code}" in result.stdout
    script = Path(sys.executable).parent / "omnia"
    if script.exists():  # the installed entry point
        assert subprocess.run([str(script), "--help"], capture_output=True, env=env).returncode == 0


def test_usage_errors(env: dict[str, str]) -> None:
    assert omnia(env=env).returncode == 2
    assert omnia("run", "--max-tokens", "many", "hi", env=env).returncode == 2
    result = omnia("run", env=env, stdin="")
    assert result.returncode == 2 and result.stdout == ""
    assert "prompt" in result.stderr


def test_unreachable_non_default_url_is_not_started(env: dict[str, str], tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    result = omnia("--url", url, "run", "hi", env=env)
    assert result.returncode == 3, result.stderr
    assert result.stdout == ""
    assert "cannot reach" in result.stderr and url in result.stderr
    assert omnia("models", "list", env={**env, "OMNIA_URL": url}).returncode == 3
    assert omnia("status", "--url", url, env=env).returncode == 3
    assert not (tmp_path / "state" / "mlx-omnia").exists()  # nothing was started


# -- against a live server -------------------------------------------------------------------------


def test_run_streams_only_the_answer_to_stdout(server: LiveServer, env: dict[str, str]) -> None:
    result = omnia(
        "run", "--url", server.url, "--temperature", "0", "--max-tokens", "24", QUESTION, env=env
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == ANSWER + "\n"
    assert "Paris" not in result.stderr

    # Streamed: the first text arrives well before the process ends.
    process = subprocess.Popen(
        [*CLI, "--url", server.url, "run", "--temperature", "0", "--max-tokens", "40", STORY],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    assert process.stdout is not None
    first = process.stdout.read(1)
    first_at = time.monotonic()
    rest, err = process.communicate(timeout=60)
    assert process.returncode == 0, err
    assert first and len(first + rest) > 40
    assert time.monotonic() - first_at > 1.0


def test_run_interrupted(server: LiveServer, env: dict[str, str]) -> None:
    """Ctrl-C: exit 130, and closing the stream stops the generation on the server."""
    process = subprocess.Popen(
        [*CLI, "--url", server.url, "run", "--temperature", "0", "--max-tokens", "300", STORY],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    assert process.stdout is not None
    assert process.stdout.read(1)  # the answer has started
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=30)
    assert process.returncode == 130, err
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        status = httpx.get(f"{server.url}/admin/status").json()
        if not any(r["busy"] for r in status["resident"]):
            break
        time.sleep(0.1)
    else:
        pytest.fail("the server kept generating after the client left")


def test_run_reads_stdin(server: LiveServer, env: dict[str, str]) -> None:
    result = omnia(
        "run", "--url", server.url, "--temperature", "0", "--max-tokens", "24",
        env=env, stdin=QUESTION + "\n",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ANSWER


def test_run_options_reach_the_server(server: LiveServer, env: dict[str, str]) -> None:
    args = ["run", "--url", server.url, "--system", "You answer briefly.", "--seed", "7"]
    result = omnia(*args, "--temperature", "0.7", "--max-tokens", "3", "Hello", env=env)
    assert result.returncode == 0, result.stderr
    assert "--max-tokens" in result.stderr  # the answer was cut at 3 tokens
    status = httpx.get(f"{server.url}/admin/status").json()
    assert status["last_answer"]["completion_tokens"] == 3


def test_run_missing_model(server: LiveServer, env: dict[str, str]) -> None:
    result = omnia("run", "--url", server.url, "-m", "acme/missing-model", "hi", env=env)
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.startswith("error:") and "acme/missing-model" in result.stderr


def test_models_list_load_unload_and_status(server: LiveServer, env: dict[str, str]) -> None:
    url = ["--url", server.url]
    assert omnia("models", "unload", "smollm2-135m-instruct", *url, env=env).returncode == 0

    listing = omnia("models", "list", "--json", *url, env=env)
    assert listing.returncode == 0, listing.stderr
    models = {m["id"]: m for m in json.loads(listing.stdout)["models"]}
    smol = models["smollm2-135m-instruct"]
    assert smol["default"] and not smol["resident"] and smol["size_on_disk"] > 0

    loaded = omnia("models", "load", "smollm2-135m-instruct", *url, env=env)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.startswith("loaded smollm2-135m-instruct")
    table = omnia("models", *url, env=env)  # `models` alone lists
    assert table.returncode == 0, table.stderr
    header, row = table.stdout.splitlines()[:2]
    assert header.split() == ["ID", "SOURCE", "ON", "DISK", "RESIDENT", "MEMORY", "DEFAULT"]
    assert row.split()[0] == "smollm2-135m-instruct" and "yes" in row.split() and "*" in row

    run = omnia("run", *url, "--temperature", "0", "--max-tokens", "24", QUESTION, env=env)
    assert run.returncode == 0
    status = omnia("status", *url, env=env)
    assert status.returncode == 0, status.stderr
    out = status.stdout
    assert f"url:           {server.url}" in out
    assert f"started outside omnia (pid {os.getpid()})" in out
    assert re.search(r"backend:\s+\w+", out)
    assert re.search(r"resident:\s+smollm2-135m-instruct \(", out)
    assert re.search(r"last answer:\s+smollm2-135m-instruct: \d+ tokens at [\d.]+ tok/s", out)
    as_json = json.loads(omnia("status", "--json", *url, env=env).stdout)
    assert as_json["auto_started"] is False and as_json["pid"] == os.getpid()

    assert "install:" not in out and as_json["stale_install"] is None
    assert as_json["install"]["stamp"] == install_stamp()

    unloaded = omnia("models", "unload", "smollm2-135m-instruct", *url, env=env)
    assert unloaded.returncode == 0 and unloaded.stdout.startswith("unloaded")
    assert not httpx.get(f"{server.url}/admin/status").json()["resident"]

    missing = omnia("models", "rm", "smollm2-135m-instruct", *url, env=env)
    assert missing.returncode == 1 and "embedded" in missing.stderr


def test_api_key(env: dict[str, str]) -> None:
    with live_server(Settings(api_key="sesame")) as s:
        denied = omnia("models", "list", "--url", s.url, env=env)
        assert denied.returncode == 1 and "--api-key" in denied.stderr
        assert (
            omnia("models", "list", "--url", s.url, "--api-key", "sesame", env=env).returncode == 0
        )
        keyed = {**env, "OMNIA_API_KEY": "sesame", "OMNIA_URL": s.url}
        assert omnia("--json", "models", env=keyed).returncode == 2  # --json belongs to models
        assert omnia("models", "--json", env=keyed).returncode == 0


# -- auto-start ------------------------------------------------------------------------------------


@pytest.fixture
def auto_env(tmp_path: Path, tiny_llama_dir: Path) -> Iterator[dict[str, str]]:
    """The environment of a user with no server running: the CLI starts one on a free port.
    The daemon inherits it, and downloads from a hub-shaped server on loopback."""
    hub = HubServer().start()
    hub.add_repo("acme/tiny-llama", tiny_llama_dir)
    env = base_env(
        tmp_path,
        HF_ENDPOINT=hub.url,
        HF_HOME=str(tmp_path / "hf"),
        HF_HUB_CACHE=str(tmp_path / "hf" / "hub"),
        HF_HUB_DISABLE_XET="1",
        HF_HUB_DISABLE_TELEMETRY="1",
    )
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HUGGINGFACE_HUB_CACHE"):
        env.pop(key, None)
    try:
        yield env
    finally:
        for record in (tmp_path / "state" / "mlx-omnia").glob("omnia-server-*.json"):
            with contextlib.suppress(ValueError, OSError):
                os.kill(int(json.loads(record.read_text())["pid"]), signal.SIGKILL)
        hub.stop()


def test_auto_start_once_status_pull_stop(auto_env: dict[str, str], tmp_path: Path) -> None:
    env = auto_env
    url = env["OMNIA_DEFAULT_URL"]
    state = tmp_path / "state" / "mlx-omnia"
    port = url.rsplit(":", 1)[1]

    # Two invocations at once: the lock lets exactly one of them start the daemon.
    runs = [
        subprocess.Popen(
            [*CLI, "run", "--temperature", "0", "--max-tokens", "24", QUESTION],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=90) for p in runs]
    for p, (out, err) in zip(runs, outputs, strict=True):
        assert p.returncode == 0, err
        assert out == ANSWER + "\n"
    notes = [err for _, err in outputs if "starting omnia-server" in err]
    assert len(notes) == 1, outputs
    log = state / f"omnia-server-{port}.log"
    assert log.read_text().count("omnia started omnia-server") == 1
    record = json.loads((state / f"omnia-server-{port}.json").read_text())
    pid = record["pid"]
    assert httpx.get(f"{url}/admin/status").json()["pid"] == pid

    status = omnia("status", env=env)
    assert status.returncode == 0, status.stderr
    assert f"auto-started by omnia (pid {pid}, log: {log})" in status.stdout
    assert re.search(r"last answer:\s+smollm2-135m-instruct: \d+ tokens at", status.stdout)
    if sys.platform.startswith("linux"):  # it started again with jemalloc (same pid, checked above)
        assert "allocator libjemalloc.so.2" in status.stdout, status.stdout

    # A later command finds it running: no second start.
    listing = omnia("models", "list", "--json", env=env)
    assert listing.returncode == 0 and "starting" not in listing.stderr

    pulled = omnia("pull", "acme/tiny-llama", env=env)
    assert pulled.returncode == 0, pulled.stderr
    assert pulled.stdout.startswith("pulled acme/tiny-llama into ")
    ids = [m["id"] for m in json.loads(omnia("models", "ls", "--json", env=env).stdout)["models"]]
    assert "acme/tiny-llama" in ids
    failed = omnia("pull", "acme/no-such-repo", env=env)
    assert failed.returncode == 1 and "pull failed" in failed.stderr
    removed = omnia("models", "rm", "acme/tiny-llama", env=env)
    assert removed.returncode == 0 and removed.stdout.startswith("deleted acme/tiny-llama")

    stopped = omnia("stop", env=env)
    assert stopped.returncode == 0, stopped.stderr
    assert f"stopped omnia-server (pid {pid})" in stopped.stdout
    assert not daemon.alive(pid)
    assert not (state / f"omnia-server-{port}.json").exists()
    assert omnia("status", env=env).returncode == 3


def test_status_says_when_the_server_predates_the_install(
    server: LiveServer, env: dict[str, str]
) -> None:
    """A server started before a reinstall (its stamp differs from the CLI's install) is named
    stale, with how to restart it; its web app keeps serving what it started with."""
    running = server.state.install
    server.state.install = {"version": "0.0.1", "stamp": "0123456789abcdef"}
    try:
        status = omnia("status", "--url", server.url, env=env)
        assert status.returncode == 0, status.stderr
        line = next(x for x in status.stdout.splitlines() if x.startswith("install:"))
        assert "older install of mlx-omnia" in line and "0.0.1; installed now:" in line
        assert line.endswith("restart it")  # started outside omnia
        as_json = json.loads(omnia("status", "--json", "--url", server.url, env=env).stdout)
        assert "older install" in as_json["stale_install"]
    finally:
        server.state.install = running


def test_sizes_are_decimal_in_options_and_output() -> None:
    from mlx_omnia.cli import fmt
    from mlx_omnia.server.main import parse_size

    assert [fmt.size(n) for n in (0, 999, 98_400_000, 17_700_000_000, 123_456_789, None)] == [
        "0 B", "999 B", "98.4 MB", "17.7 GB", "123 MB", "-"]
    assert parse_size("12G") == parse_size("12GB") == parse_size("12gb") == 12_000_000_000
    assert parse_size("12GiB") == parse_size("12Gi") == 12 * 2**30
    assert parse_size("8M") == 8_000_000 and parse_size("4096") == 4096
    with pytest.raises(ValueError):
        parse_size("12iB")



def test_status_says_what_the_machine_could_run_faster(
    server: LiveServer, env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server without the optimized BLAS says so, with the cost and the fix; one started
    before it was installed says to restart (this process loaded none, as if started before)."""
    import ctypes.util

    from mlx_omnia import allocator
    from mlx_omnia.engine import blas, runtime

    assert blas.note(on_cpu=False) is None
    monkeypatch.setattr(blas, "loaded", None)
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    missing = blas.note(on_cpu=True)
    assert missing is not None and "no optimized BLAS" in missing
    assert "~10x slower prefill" in missing and "apt-get install libopenblas0-pthread" in missing
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: f"lib{name}.so.0")
    monkeypatch.setattr(runtime, "_notes", None)  # looked up again now, not in 30 s
    status = omnia("status", "--url", server.url, env=env)
    assert status.returncode == 0, status.stderr
    notes = [line for line in status.stdout.splitlines() if line.startswith("note:")]
    assert any("an OpenBLAS is installed but this process started without it" in n
               and n.endswith("restart it") for n in notes), status.stdout
    monkeypatch.setattr(allocator, "loaded", lambda: None)
    jemalloc = allocator.note()
    assert jemalloc is not None and "jemalloc is installed but this process started" in jemalloc
