"""Starting omnia-server in the background when nothing answers on the default loopback URL.

Files live in the platform's log directory (`log_dir()`), one set per port:
`omnia-server-PORT.log` (the server's output), `omnia-server-PORT.lock` (an flock held while one
CLI starts the server, so that concurrent invocations start it once) and `omnia-server-PORT.json`
(pid, url, log, start time: the record that the CLI started it, read by `omnia status`/`stop`)."""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Generator
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlsplit

from mlx_omnia.cli.client import Client, Unreachable, as_object

DEFAULT_URL = "http://127.0.0.1:8642"
START_TIMEOUT_S = 60.0
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def default_url() -> str:
    """The URL the CLI may start a server on (OMNIA_DEFAULT_URL overrides it, for tests)."""
    return (os.environ.get("OMNIA_DEFAULT_URL") or DEFAULT_URL).rstrip("/")


def log_dir() -> Path:
    """~/Library/Logs/mlx-omnia on macOS; $XDG_STATE_HOME/mlx-omnia (~/.local/state) elsewhere."""
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Logs" / "mlx-omnia"
    state = os.environ.get("XDG_STATE_HOME")
    base = Path(state) if state and Path(state).is_absolute() else Path.home() / ".local" / "state"
    return base / "mlx-omnia"


def _split(url: str) -> tuple[str, str, int]:
    parts = urlsplit(url)
    scheme = parts.scheme or "http"
    host = (parts.hostname or "").lower()
    port = parts.port or (443 if scheme == "https" else 80)
    return scheme, host, port


def is_default(url: str) -> bool:
    """Whether `url` is the default loopback URL, the only one the CLI starts a server for."""
    scheme, host, port = _split(url)
    d_scheme, d_host, d_port = _split(default_url())
    same_host = host == d_host or (host in LOOPBACK and d_host in LOOPBACK)
    return scheme == d_scheme == "http" and same_host and port == d_port and host in LOOPBACK


@dataclass
class Record:
    pid: int
    url: str
    log: str
    started_at: float


def _paths(url: str) -> tuple[Path, Path, Path]:
    port = _split(url)[2]
    d = log_dir()
    return (
        d / f"omnia-server-{port}.log",
        d / f"omnia-server-{port}.lock",
        d / f"omnia-server-{port}.json",
    )


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not yet reaped) is not alive
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def read_record(url: str) -> Record | None:
    """The record of a server the CLI started for `url`, if its process still runs."""
    record_file = _paths(url)[2]
    try:
        data = as_object(json.loads(record_file.read_text()))
        record = Record(
            int(data["pid"]), str(data["url"]), str(data["log"]), float(data["started_at"])
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not alive(record.pid):
        with contextlib.suppress(OSError):
            record_file.unlink()
        return None
    return record


def forget(url: str) -> None:
    with contextlib.suppress(OSError):
        _paths(url)[2].unlink()


@contextlib.contextmanager
def _locked(path: Path) -> Generator[None]:
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_server(client: Client, api_key: str | None, note: Callable[[str], None]) -> None:
    """Make sure a server answers at `client.url`: start one when it is the default URL."""
    if client.healthy():
        return
    if not is_default(client.url):
        raise Unreachable(
            f"cannot reach omnia-server at {client.url} (only the default URL {default_url()} "
            "is started automatically; start the server there or check --url/OMNIA_URL)"
        )
    if importlib.util.find_spec("fastapi") is None or importlib.util.find_spec("uvicorn") is None:
        raise Unreachable(
            f"no omnia-server answers at {client.url} and it cannot be started here: the server "
            "extra is not installed (pip install 'mlx-omnia[server]')"
        )
    log, lock, record_file = _paths(client.url)
    log.parent.mkdir(parents=True, exist_ok=True)
    with _locked(lock):
        if client.healthy():  # another invocation started it while we waited for the lock
            return
        _, host, port = _split(client.url)
        note(f"starting omnia-server… (log: {log})")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if api_key:
            env["OMNIA_API_KEY"] = api_key
        with log.open("ab") as out:
            out.write(f"\n--- omnia started omnia-server at {time.ctime()} ---\n".encode())
            out.flush()
            process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "mlx_omnia.server.main",
                    "--host",
                    host,
                    "--port",
                    str(port),
                ],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                close_fds=True,
            )
        record = Record(process.pid, client.url, str(log), time.time())
        record_file.write_text(json.dumps(asdict(record)))
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if process.poll() is not None:
                forget(client.url)
                raise Unreachable(
                    f"omnia-server exited at start (code {process.returncode}); see {log}"
                )
            if client.healthy():
                return
            time.sleep(0.2)
        raise Unreachable(
            f"omnia-server (pid {process.pid}) did not answer within {START_TIMEOUT_S:.0f} s; "
            f"see {log}"
        )


def stop(record: Record, timeout: float = 15.0) -> bool:
    """Stop a server the CLI started: SIGTERM, then SIGKILL after `timeout`. True once gone."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(record.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(record.pid):
            forget(record.url)
            return True
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(record.pid, signal.SIGKILL)
    time.sleep(0.5)
    gone = not alive(record.pid)
    if gone:
        forget(record.url)
    return gone
