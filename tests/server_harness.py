"""A real omnia-server on a free loopback port, in a background thread of the test process."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx
import uvicorn

from mlx_omnia.server.app import create_app
from mlx_omnia.server.manager import ModelManager
from mlx_omnia.server.settings import Settings


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
