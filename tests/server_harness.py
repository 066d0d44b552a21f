"""A real omnia-server on a free loopback port, in a background thread of the test process or
in its own process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import uvicorn

from mlx_omnia.server.app import create_app
from mlx_omnia.server.manager import ModelManager
from mlx_omnia.server.settings import Settings

if TYPE_CHECKING:
    import anthropic
    import openai
    from google import genai


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LiveServer:
    def __init__(self, settings: Settings, manager: ModelManager | None = None) -> None:
        settings.port = settings.port if settings.port != 8642 else free_port()
        self.settings = settings
        self.app = create_app(settings, manager=manager)
        self.url = f"http://127.0.0.1:{settings.port}"
        config = uvicorn.Config(self.app, host="127.0.0.1", port=settings.port, log_level="warning")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    @property
    def state(self):  # type: ignore[no-untyped-def]
        return self.app.state.omnia

    def start(self) -> LiveServer:
        self._thread.start()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/admin/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.05)
        raise RuntimeError("server did not start")

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)


@contextmanager
def live_server(
    settings: Settings | None = None,
    manager: ModelManager | None = None,
    *,
    models: Sequence[Path] = (),
) -> Iterator[LiveServer]:
    """A started server; `models`: local checkpoints it serves under their directory names."""
    settings = settings or Settings()
    if models:
        manager = manager or ModelManager(settings)
        for path in models:
            manager.add_alias(path)
    server = LiveServer(settings, manager).start()
    try:
        yield server
    finally:
        server.stop()


@contextmanager
def server_process(
    args: Sequence[str], log: Path, env: Mapping[str, str] | None = None
) -> Iterator[str]:
    """omnia-server in its own process, started as users start it, on a free loopback port with
    `args`, its output in `log`; yields its URL once /admin/health answers."""
    port = free_port()
    cmd = [sys.executable, "-m", "mlx_omnia.server.main", "--port", str(port), *args]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"{url}/admin/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        else:
            raise RuntimeError(f"omnia-server did not start: {log.read_text()}")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# The official SDKs pointed at a live server (imported on use: google-genai takes a second).
def openai_client(server: LiveServer) -> openai.OpenAI:
    import openai

    return openai.OpenAI(base_url=f"{server.url}/api/openai/v1", api_key="unused", max_retries=0)


def anthropic_client(server: LiveServer) -> anthropic.Anthropic:
    import anthropic

    return anthropic.Anthropic(base_url=f"{server.url}/api/anthropic", api_key="unused",
                               max_retries=0)


def gemini_client(server: LiveServer) -> genai.Client:
    from google import genai
    from google.genai import types

    options = types.HttpOptions(base_url=f"{server.url}/api/gemini", api_version="v1beta")
    return genai.Client(api_key="unused", http_options=options)
