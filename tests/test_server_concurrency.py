"""Concurrency on a real server on loopback: parallel clients, a full queue in each dialect's shape,
a client leaving mid-stream, and failures isolated from other requests."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from mlx_omnia.server.manager import ModelManager
from mlx_omnia.server.settings import Settings
from tests.fixtures.tiny import write_tiny_llama
from tests.server_harness import LiveServer, live_server

LONG = 6000  # tokens: many seconds of decoding for the tiny model
NO_EOS = {"2": -100}  # the tiny model's eos id, banned so that generations run their length


@pytest.fixture(scope="module")
def long_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(
        tmp_path_factory.mktemp("conc") / "tiny-long", max_position_embeddings=8192
    )


@pytest.fixture(scope="module")
def broken_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("conc") / "tiny-broken"
    path.mkdir()
    (path / "config.json").write_text('{"model_type": "llama"')  # truncated JSON
    return path


def server_with(settings: Settings, *paths: Path) -> live_server:  # type: ignore[valid-type]
    manager = ModelManager(settings)
    for path in paths:
        manager.add_alias(path)
    return live_server(settings, manager)


def oai(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/api/openai/v1", api_key="none", max_retries=0)


def completion_tokens(server: LiveServer, model: str) -> float:
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith(f'omnia_completion_tokens_total{{model="{model}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


class LongStream:
    """A streaming chat that decodes for a long time, read on a thread until `close`."""

    def __init__(self, server: LiveServer, model: str = "tiny-long") -> None:
        self.client = httpx.Client(timeout=60)
        self.chunks = 0
        self.started = threading.Event()
        self._stop = threading.Event()
        body = {
            "model": model,
            "stream": True,
            "max_tokens": LONG,
            "temperature": 0,
            "logit_bias": NO_EOS,
            "messages": [{"role": "user", "content": "go on"}],
        }
        self._cm = self.client.stream(
            "POST", f"{server.url}/api/openai/v1/chat/completions", json=body
        )
        self.response = self._cm.__enter__()
        assert self.response.status_code == 200
        self.finished = False
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        assert self.started.wait(20)

    def _read(self) -> None:
        try:
            for line in self.response.iter_lines():
                if line.startswith("data: "):
                    self.chunks += 1
                    if self.chunks >= 3:
                        self.started.set()
                    if line == "data: [DONE]":
                        self.finished = True
                if self._stop.is_set():
                    return
        except httpx.HTTPError:
            pass

    def close(self) -> None:
        self._stop.set()
        self.response.close()
        self.client.close()
        self._thread.join(timeout=10)


@pytest.fixture
def long_server(long_model: Path, broken_model: Path) -> Iterator[LiveServer]:
    # one generation at a time: a second request waits in the queue of one slot
    with server_with(Settings(max_queue=1, max_concurrent=1), long_model, broken_model) as server:
        yield server


def test_four_concurrent_clients_complete_correctly(long_model: Path) -> None:
    with server_with(Settings(), long_model) as server:
        client = oai(server)

        def ask(i: int) -> tuple[str, int]:
            r = client.chat.completions.create(
                model="tiny-long",
                messages=[{"role": "user", "content": f"prompt {i % 2}"}],
                max_tokens=24 + i,
                temperature=0,
                logit_bias=NO_EOS,
            )
            assert r.usage is not None and r.choices[0].finish_reason == "length"
            return r.choices[0].message.content or "", r.usage.completion_tokens

        alone = [ask(i) for i in range(4)]
        with ThreadPoolExecutor(4) as pool:
            together = list(pool.map(ask, range(4)))
        assert together == alone  # greedy: concurrency changes nothing
        assert [n for _, n in together] == [24, 25, 26, 27]


def test_full_queue_answers_429_in_each_dialect(long_server: LiveServer) -> None:
    server = long_server
    running = LongStream(server)
    queued: list[httpx.Response] = []
    waiter = threading.Thread(
        target=lambda: queued.append(
            httpx.post(
                f"{server.url}/api/openai/v1/chat/completions",
                timeout=60,
                json={
                    "model": "tiny-long",
                    "max_tokens": 2,
                    "messages": [{"role": "user", "content": "hi"}],
                },
            )
        ),
        daemon=True,
    )
    waiter.start()
    try:
        deadline = time.monotonic() + 10
        while server.state.scheduler.depth < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.state.scheduler.depth == 1  # max_queue=1: the queue is now full

        with pytest.raises(openai.RateLimitError) as info:
            oai(server).chat.completions.create(
                model="tiny-long", messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
        body = info.value.body
        assert (
            isinstance(body, dict)
            and body["type"] == "rate_limit_error"
            and "queue is full" in body["message"]
        )

        r = httpx.post(
            f"{server.url}/api/anthropic/v1/messages",
            json={
                "model": "tiny-long",
                "max_tokens": 2,
                "messages": [{"role": "user", "content": "hi"}],
            },
        )
        assert r.status_code == 429, r.text
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "rate_limit_error"

        r = httpx.post(
            f"{server.url}/api/gemini/v1beta/models/tiny-long:generateContent",
            json={
                "contents": [{"role": "user", "parts": [{"text": "hi"}]}],
                "generationConfig": {"maxOutputTokens": 2},
            },
        )
        assert r.status_code == 429, r.text
        assert (
            r.json()["error"]["status"] == "RESOURCE_EXHAUSTED" and r.json()["error"]["code"] == 429
        )
    finally:
        running.close()
    waiter.join(timeout=30)
    assert (
        queued and queued[0].status_code == 200
    )  # the queued one is served once the stream is gone


def test_choices_past_the_queue_are_refused_and_none_left_behind(long_server: LiveServer) -> None:
    """n=3 with one queue slot: the second choice finds the queue full, so the request answers
    429 and the first, already queued, is withdrawn (it would run for nobody)."""
    server = long_server
    running = LongStream(server)
    try:
        for stream in (False, True):
            r = httpx.post(
                f"{server.url}/api/openai/v1/chat/completions",
                timeout=60,
                json={
                    "model": "tiny-long", "n": 3, "max_tokens": 8, "stream": stream,
                    "messages": [{"role": "user", "content": "hi"}],
                },
            )
            assert r.status_code == 429, r.text
            deadline = time.monotonic() + 5
            while server.state.scheduler.depth and time.monotonic() < deadline:
                time.sleep(0.01)
            assert server.state.scheduler.depth == 0
    finally:
        running.close()


def test_client_leaving_mid_stream_stops_its_generation(long_server: LiveServer) -> None:
    server = long_server
    stream = LongStream(server)
    stream.close()
    deadline = time.monotonic() + 10
    while server.state.scheduler.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not server.state.scheduler.running
    stopped_at = completion_tokens(server, "tiny-long")
    time.sleep(0.3)
    assert completion_tokens(server, "tiny-long") == stopped_at  # nothing more is generated
    assert 2 <= stopped_at < LONG / 2  # the stream had read a role chunk and two tokens
    assert not stream.finished

    r = oai(server).chat.completions.create(
        model="tiny-long",
        messages=[{"role": "user", "content": "next"}],
        max_tokens=4,
        temperature=0,
    )
    assert r.usage is not None and r.usage.completion_tokens >= 1
    # served without the abandoned generation going on: only the new answer's tokens were
    # added (counted, not timed, so a busy machine cannot fail it)
    assert completion_tokens(server, "tiny-long") == stopped_at + r.usage.completion_tokens


def test_a_failing_request_does_not_disturb_a_running_one(long_server: LiveServer) -> None:
    server = long_server
    body = {
        "model": "tiny-long",
        "stream": True,
        "max_tokens": 300,
        "temperature": 0,
        "logit_bias": NO_EOS,
        "messages": [{"role": "user", "content": "go on"}],
    }
    results: dict[str, object] = {}

    def run_long() -> None:
        text, finish = [], None
        with httpx.stream(
            "POST", f"{server.url}/api/openai/v1/chat/completions", json=body, timeout=60
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    import json

                    choice = json.loads(line[6:])["choices"][0]
                    text.append(choice["delta"].get("content") or "")
                    finish = choice["finish_reason"] or finish
        results["long"] = ("".join(text), finish)

    thread = threading.Thread(target=run_long, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.state.scheduler.running and time.monotonic() < deadline:
        time.sleep(0.005)
    # A model that cannot load fails alone, and so does a request with bad input.
    with pytest.raises(openai.BadRequestError) as info:
        oai(server).chat.completions.create(
            model="tiny-broken", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert "cannot be loaded" in str(info.value)
    with pytest.raises(openai.BadRequestError):
        oai(server).chat.completions.create(
            model="tiny-long", messages=[{"role": "user", "content": "hi"}], max_tokens=-1
        )
    thread.join(timeout=60)
    text, finish = results["long"]  # type: ignore[misc]
    assert finish == "length"
    alone = oai(server).chat.completions.create(
        model="tiny-long",
        messages=[{"role": "user", "content": "go on"}],
        max_tokens=300,
        temperature=0,
        logit_bias=NO_EOS,
    )
    assert text == alone.choices[0].message.content


def test_streams_decode_together_and_one_leaving_leaves_the_others(long_model: Path) -> None:
    """Three long streams run in one batch (none waits in the queue); a client that leaves drops
    out of the batch at the next step while the other two keep streaming, and a short request
    joins the running batch and is answered while they go on."""
    with server_with(Settings(max_concurrent=4), long_model) as server:
        streams = [LongStream(server) for _ in range(3)]
        try:
            deadline = time.monotonic() + 20
            while len(server.state.scheduler.running) < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert len(server.state.scheduler.running) == 3
            assert server.state.scheduler.depth == 0
            streams[1].close()
            deadline = time.monotonic() + 10
            while len(server.state.scheduler.running) > 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert len(server.state.scheduler.running) == 2
            before = [s.chunks for s in (streams[0], streams[2])]
            r = oai(server).chat.completions.create(
                model="tiny-long", messages=[{"role": "user", "content": "short"}], max_tokens=5,
                temperature=0, logit_bias=NO_EOS,
            )
            assert r.usage is not None and r.usage.completion_tokens == 5
            deadline = time.monotonic() + 10
            while (min(streams[0].chunks - before[0], streams[2].chunks - before[1]) < 5
                   and time.monotonic() < deadline):
                time.sleep(0.01)
            assert streams[0].chunks > before[0] + 4 and streams[2].chunks > before[1] + 4
            assert not (streams[0].finished or streams[2].finished)
        finally:
            for s in streams:
                s.close()


def test_max_concurrent_bounds_a_models_batch(long_model: Path) -> None:
    with server_with(Settings(max_concurrent=2), long_model) as server:
        streams = [LongStream(server) for _ in range(2)]
        waiter: list[httpx.Response] = []
        thread = threading.Thread(target=lambda: waiter.append(httpx.post(
            f"{server.url}/api/openai/v1/chat/completions", timeout=60,
            json={"model": "tiny-long", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
        )), daemon=True)
        thread.start()
        try:
            deadline = time.monotonic() + 10
            while server.state.scheduler.depth < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert server.state.scheduler.depth == 1 and len(server.state.scheduler.running) == 2
            streams[0].close()  # a place in the batch frees: the waiting request joins
            thread.join(timeout=30)
            assert waiter and waiter[0].status_code == 200
        finally:
            for s in streams:
                s.close()
