"""Hostile and careless clients on a real server on loopback (issue 28): clients that leave,
oversized bodies, model ids, a big prompt beside health checks, keys in the log, huge
max_tokens, methods a route lacks, Retry-After and characters cut by max_tokens."""

from __future__ import annotations

import json
import logging
import select
import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from google import genai
from google.genai import types

from mlx_omnia.server.settings import Settings
from tests.fixtures.tiny import write_tiny_llama
from tests.server_harness import LiveServer, live_server

LONG = 60000  # tokens: far more than the tests wait for (the tiny model decodes ~1000/s)
NO_EOS = {"2": -100}  # the tiny model's eos id, banned so that generations run their length
DEADLINE = 30.0  # seconds: generous, this machine is shared


def wait_for(condition: Callable[[], bool], what: str, timeout: float = DEADLINE) -> None:
    """Poll `condition` until it holds; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def long_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(
        tmp_path_factory.mktemp("hard") / "tiny-long", max_position_embeddings=65536
    )


@pytest.fixture
def server(long_model: Path) -> Iterator[LiveServer]:
    # one generation at a time: the others wait in the queue, whose behaviour these tests pin
    with live_server(Settings(max_concurrent=1), models=[long_model]) as live:
        yield live


def completion_tokens(server: LiveServer) -> float:
    for line in httpx.get(f"{server.url}/metrics", timeout=DEADLINE).text.splitlines():
        if line.startswith('omnia_completion_tokens_total{model="tiny-long"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def send_raw(server: LiveServer, path: str, body: dict[str, object]) -> socket.socket:
    """POST `body` on a socket of its own and leave the answer unread (a client that may leave)."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.settings.port), timeout=DEADLINE)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


def long_requests(stream: bool) -> list[tuple[str, dict[str, object]]]:
    """One long generation in each dialect's API."""
    chat = [{"role": "user", "content": "go on"}]
    gemini = "/api/gemini/v1beta/models/tiny-long:" + (
        "streamGenerateContent?alt=sse" if stream else "generateContent"
    )
    return [
        (
            "/api/openai/v1/chat/completions",
            {"model": "tiny-long", "stream": stream, "max_tokens": LONG, "temperature": 0,
             "logit_bias": NO_EOS, "messages": chat},
        ),
        (
            "/api/anthropic/v1/messages",
            {"model": "tiny-long", "stream": stream, "max_tokens": LONG, "temperature": 0,
             "messages": chat},
        ),
        (
            gemini,
            {"contents": [{"role": "user", "parts": [{"text": "go on"}]}],
             "generationConfig": {"maxOutputTokens": LONG, "temperature": 0}},
        ),
    ]


def test_queued_requests_whose_clients_left_are_never_generated(server: LiveServer) -> None:
    path, body = long_requests(stream=True)[0]
    running = send_raw(server, path, body)
    wait_for(lambda: completion_tokens(server) > 0, "the running stream to decode")
    first = server.state.scheduler.running
    queued = [send_raw(server, p, b) for s in (False, True) for p, b in long_requests(s)]
    wait_for(lambda: server.state.scheduler.depth == len(queued), "six queued requests")
    for sock in queued:
        sock.close()
    wait_for(lambda: server.state.scheduler.depth == 0, "the abandoned requests to leave")
    assert server.state.scheduler.running == first  # they left the queue, not ran
    running.close()
    wait_for(lambda: not server.state.scheduler.running, "the server to be idle")
    stopped_at = completion_tokens(server)
    assert 0 < stopped_at < LONG / 2  # only the running stream's tokens
    r = httpx.get(f"{server.url}/admin/status", timeout=DEADLINE).json()
    assert r["queue_depth"] == 0
    # Nothing queued is left to run: the counter stays where the running stream stopped.
    answer = httpx.post(
        f"{server.url}/api/openai/v1/chat/completions",
        timeout=DEADLINE,
        json={"model": "tiny-long", "max_tokens": 3, "temperature": 0, "logit_bias": NO_EOS,
              "messages": [{"role": "user", "content": "next"}]},
    )
    assert answer.status_code == 200
    assert completion_tokens(server) == stopped_at + 3


@pytest.mark.parametrize("dialect", ["openai", "anthropic", "gemini"])
def test_a_non_streaming_client_that_leaves_stops_its_generation(
    server: LiveServer, dialect: str
) -> None:
    index = ["openai", "anthropic", "gemini"].index(dialect)
    path, body = long_requests(stream=False)[index]
    sock = send_raw(server, path, body)
    wait_for(lambda: completion_tokens(server) > 0, "the generation to decode")
    sock.close()
    wait_for(lambda: not server.state.scheduler.running, "the generation to stop")
    assert completion_tokens(server) < LONG / 2


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and body of one HTTP/1.1 response with a Content-Length."""
    data = b""
    deadline = time.monotonic() + DEADLINE
    while b"\r\n\r\n" not in data and time.monotonic() < deadline:
        more = sock.recv(65536)
        if not more:
            break
        data += more
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:])}
    while len(body) < int(headers.get("content-length", "0")) and time.monotonic() < deadline:
        more = sock.recv(65536)
        if not more:
            break
        body += more
    return int(lines[0].split()[1]), headers, body


LIMIT = 64 * 1024
ERROR_OF: dict[str, Callable[[dict[str, object]], object]] = {
    "/api/openai/v1/chat/completions": lambda b: b["error"]["type"],  # type: ignore[index]
    "/api/anthropic/v1/messages": lambda b: b["error"]["type"],  # type: ignore[index]
    "/api/gemini/v1beta/models/tiny-long:generateContent": lambda b: b["error"]["status"],  # type: ignore[index]
}
TOO_LARGE = {
    "/api/openai/v1/chat/completions": "invalid_request_error",
    "/api/anthropic/v1/messages": "request_too_large",
    "/api/gemini/v1beta/models/tiny-long:generateContent": "INVALID_ARGUMENT",
}


@pytest.fixture
def small_body_server(long_model: Path) -> Iterator[LiveServer]:
    with live_server(Settings(max_body_bytes=LIMIT), models=[long_model]) as live:
        yield live


@pytest.mark.parametrize("path", list(TOO_LARGE))
def test_a_chunked_body_over_max_body_is_refused_before_it_is_read(
    small_body_server: LiveServer, path: str
) -> None:
    server = small_body_server
    sock = socket.create_connection(("127.0.0.1", server.settings.port), timeout=DEADLINE)
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        "Transfer-Encoding: chunked\r\n\r\n".encode()
    )
    chunk = b"x" * 16384
    total = 32 * 1024 * 1024  # what the client would send: 512 times the limit
    sent = 0
    with sock:
        while sent < total:
            readable, _, _ = select.select([sock], [], [], 0)
            if readable:  # the server answered early
                break
            try:
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            except OSError:  # it closed the connection: read its answer
                break
            sent += len(chunk)
        status, headers, body = read_response(sock)
    assert status == 413
    assert headers.get("connection") == "close"
    assert ERROR_OF[path](json.loads(body)) == TOO_LARGE[path]
    assert sent < total  # refused on the way, not after reading it all


def test_a_chunked_body_under_max_body_is_served(small_body_server: LiveServer) -> None:
    body = json.dumps({"model": "tiny-long", "max_tokens": 2,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    r = httpx.post(
        f"{small_body_server.url}/api/openai/v1/chat/completions",
        content=iter([body[:10], body[10:]]),  # an iterator: sent chunked
        headers={"content-type": "application/json"},
        timeout=DEADLINE,
    )
    assert r.status_code == 200, r.text
    assert r.request.headers.get("transfer-encoding") == "chunked"


def chat_body(model: str) -> dict[str, object]:
    return {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


def test_a_bare_model_id_never_loads_a_directory_under_the_cwd(
    server: LiveServer, long_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Checkpoints that load fine, under the server's working directory.
    victim = write_tiny_llama(tmp_path / "victimdir")
    write_tiny_llama(tmp_path / "owner" / "victim")
    assert victim.is_dir()
    monkeypatch.chdir(tmp_path)
    url = f"{server.url}/api/openai/v1/chat/completions"
    answers = {
        name: httpx.post(url, json=chat_body(name), timeout=DEADLINE)
        for name in ("victimdir", "owner/victim", "absentdir", "owner/absent")
    }
    for name, r in answers.items():
        assert r.status_code == 404, (name, r.text)
        error = r.json()["error"]
        assert error["code"] == "model_not_found"
        # The same answer whether a folder of that name exists or not.
        assert error["message"].replace(name, "X") == answers["absentdir"].json()["error"][
            "message"
        ].replace("absentdir", "X")
    assert not any(r.id in ("victimdir", "owner/victim") for r in server.state.manager.resident())
    served = httpx.post(url, json=chat_body("tiny-long"), timeout=DEADLINE)
    assert served.status_code == 200  # what it lists is served


@pytest.fixture(scope="module")
def malformed_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = write_tiny_llama(tmp_path_factory.mktemp("hard") / "tiny-malformed")
    config = json.loads((path / "config.json").read_text())
    del config["num_attention_heads"]
    (path / "config.json").write_text(json.dumps(config))
    return path


MALFORMED_REQUESTS: list[tuple[str, str, dict[str, object] | None, str]] = [
    ("POST", "/api/openai/v1/chat/completions", chat_body("tiny-malformed"), "openai"),
    ("POST", "/api/anthropic/v1/messages", chat_body("tiny-malformed"), "anthropic"),
    ("POST", "/api/anthropic/v1/messages/count_tokens",
     {"model": "tiny-malformed", "messages": [{"role": "user", "content": "hi"}]}, "anthropic"),
    ("POST", "/api/gemini/v1beta/models/tiny-malformed:generateContent",
     {"contents": [{"parts": [{"text": "hi"}]}]}, "gemini"),
    ("POST", "/api/gemini/v1beta/models/tiny-malformed:countTokens",
     {"contents": [{"parts": [{"text": "hi"}]}]}, "gemini"),
    ("GET", "/api/gemini/v1beta/models/tiny-malformed", None, "gemini"),
]


@pytest.mark.parametrize(("method", "path", "body", "dialect"), MALFORMED_REQUESTS)
def test_a_malformed_checkpoint_is_a_clean_4xx_on_a_kept_alive_connection(
    malformed_model: Path, method: str, path: str, body: dict[str, object] | None, dialect: str
) -> None:
    with live_server(Settings(), models=[malformed_model]) as server:
        sock = socket.create_connection(("127.0.0.1", server.settings.port), timeout=DEADLINE)
        with sock:
            for _ in range(2):  # the same connection answers twice
                data = json.dumps(body).encode() if body is not None else b""
                sock.sendall(
                    f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                    f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
                    .encode() + data
                )
                status, headers, raw = read_response(sock)
                assert status == 400, raw
                assert headers.get("connection") != "close"
                error = json.loads(raw)
                if dialect == "anthropic":
                    assert error["type"] == "error"
                    assert error["error"]["type"] == "invalid_request_error"
                    message = error["error"]["message"]
                elif dialect == "gemini":
                    assert error["error"]["status"] == "INVALID_ARGUMENT"
                    message = error["error"]["message"]
                else:
                    assert error["error"]["type"] == "invalid_request_error"
                    message = error["error"]["message"]
                assert "cannot be loaded" in message


SHORT_CONTEXT = 48  # tokens: the tiny model's whole context, so a clamped answer ends quickly


@pytest.fixture(scope="module")
def short_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    path = write_tiny_llama(
        tmp_path_factory.mktemp("hard") / "tiny-short", max_position_embeddings=SHORT_CONTEXT
    )
    with live_server(Settings(), models=[path]) as live:
        yield live


def ask_tokens(server: LiveServer, dialect: str, field: str, max_tokens: int) -> httpx.Response:
    """One greedy request in `dialect` whose answer may run `max_tokens` (sent as `field`)."""
    chat = [{"role": "user", "content": "go on"}]
    if dialect == "gemini":
        path = "/api/gemini/v1beta/models/tiny-short:generateContent"
        body: dict[str, object] = {
            "contents": [{"role": "user", "parts": [{"text": "go on"}]}],
            "generationConfig": {field: max_tokens, "temperature": 0},
        }
    elif dialect == "anthropic":
        path = "/api/anthropic/v1/messages"
        body = {"model": "tiny-short", field: max_tokens, "temperature": 0, "messages": chat}
    elif dialect == "responses":
        path = "/api/openai/v1/responses"
        body = {"model": "tiny-short", field: max_tokens, "temperature": 0, "input": "go on"}
    elif dialect == "completions":
        path = "/api/openai/v1/completions"
        body = {"model": "tiny-short", field: max_tokens, "temperature": 0, "prompt": "go on",
                "logit_bias": NO_EOS}
    else:
        path = "/api/openai/v1/chat/completions"
        body = {"model": "tiny-short", field: max_tokens, "temperature": 0, "messages": chat,
                "logit_bias": NO_EOS}
    return httpx.post(f"{server.url}{path}", json=body, timeout=DEADLINE)


MAX_TOKEN_FIELDS = [
    ("openai", "max_tokens"), ("openai", "max_completion_tokens"), ("completions", "max_tokens"),
    ("responses", "max_output_tokens"), ("anthropic", "max_tokens"), ("gemini", "maxOutputTokens"),
]


@pytest.mark.parametrize("huge", [10**12, 2**70, SHORT_CONTEXT + 1])
@pytest.mark.parametrize(("dialect", "field"), MAX_TOKEN_FIELDS)
def test_max_tokens_beyond_the_context_is_refused_in_the_dialects_shape(
    short_server: LiveServer, dialect: str, field: str, huge: int
) -> None:
    r = ask_tokens(short_server, dialect, field, huge)
    assert r.status_code == 400, r.text
    error = r.json()
    if dialect == "anthropic":
        assert error["type"] == "error"
        assert error["error"]["type"] == "invalid_request_error"
    elif dialect == "gemini":
        assert error["error"]["status"] == "INVALID_ARGUMENT"
    else:
        assert error["error"]["type"] == "invalid_request_error"
        assert error["error"]["param"] == field
    message = error["error"]["message"]
    sent_as = "generationConfig.maxOutputTokens" if dialect == "gemini" else field
    assert message == f"{sent_as} must be at most {SHORT_CONTEXT} (the model's context length)"


@pytest.mark.parametrize(("dialect", "field"), MAX_TOKEN_FIELDS)
def test_max_tokens_past_the_prompt_stops_when_the_context_is_full(
    short_server: LiveServer, dialect: str, field: str
) -> None:
    r = ask_tokens(short_server, dialect, field, SHORT_CONTEXT)
    assert r.status_code == 200, r.text
    answer = r.json()
    if dialect == "anthropic":
        used = answer["usage"]["input_tokens"] + answer["usage"]["output_tokens"]
        done = answer["stop_reason"] == "max_tokens"
    elif dialect == "gemini":
        meta = answer["usageMetadata"]
        used = meta["promptTokenCount"] + meta["candidatesTokenCount"]
        done = answer["candidates"][0]["finishReason"] == "MAX_TOKENS"
    elif dialect == "responses":
        used = answer["usage"]["total_tokens"]
        done = answer["status"] == "incomplete"
    else:
        used = answer["usage"]["total_tokens"]
        done = answer["choices"][0]["finish_reason"] == "length"
    assert done  # cut by the context (the end token is banned or never comes greedily)
    assert used == SHORT_CONTEXT


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_a_key_in_the_query_string_is_redacted_in_the_access_log(long_model: Path) -> None:
    secret = "s3cret-key-0451"
    access = logging.getLogger("uvicorn.access")
    with live_server(Settings(api_key=secret), models=[long_model]) as server:
        records = _Records()
        level = access.level
        access.addHandler(records)
        access.setLevel(logging.INFO)
        try:
            r = httpx.get(
                f"{server.url}/api/gemini/v1beta/models?pageSize=5&key={secret}", timeout=DEADLINE
            )
            assert r.status_code == 200
            wait_for(lambda: any("/api/gemini/v1beta/models" in x for x in records.lines),
                     "the access log line")
        finally:
            access.removeHandler(records)
            access.setLevel(level)
    line = next(x for x in records.lines if "/api/gemini/v1beta/models" in x)
    assert secret not in line
    assert "pageSize=5" in line and "key=" in line  # the rest of the line is kept


METHOD_CASES = [
    ("POST", "/admin/health", "GET", lambda b: b["error"]["type"], "method_not_allowed"),
    ("GET", "/api/openai/v1/chat/completions", "POST", lambda b: b["error"]["type"],
     "invalid_request_error"),
    ("DELETE", "/api/anthropic/v1/messages", "POST", lambda b: b["error"]["type"],
     "invalid_request_error"),
    ("PUT", "/api/gemini/v1beta/models", "GET", lambda b: b["error"]["status"], "UNIMPLEMENTED"),
    ("OPTIONS", "/api/openai/v1/models", "GET", lambda b: b["error"]["type"],
     "invalid_request_error"),
]


@pytest.mark.parametrize(("method", "path", "allow", "kind_of", "kind"), METHOD_CASES)
def test_a_method_a_route_lacks_answers_405_with_allow(
    server: LiveServer,
    method: str,
    path: str,
    allow: str,
    kind_of: Callable[[dict[str, object]], object],
    kind: str,
) -> None:
    r = httpx.request(method, f"{server.url}{path}", timeout=DEADLINE)
    assert r.status_code == 405, r.text
    assert allow in [m.strip() for m in r.headers["allow"].split(",")]
    assert kind_of(r.json()) == kind


def test_a_cors_preflight_needs_no_key(long_model: Path) -> None:
    origin = "http://app.example"
    settings = Settings(api_key="secret", cors_origins=(origin,))
    with live_server(settings, models=[long_model]) as server:
        r = httpx.options(
            f"{server.url}/api/openai/v1/chat/completions",
            headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "authorization, content-type"},
            timeout=DEADLINE,
        )
        assert r.status_code == 200, r.text
        assert r.headers["access-control-allow-origin"] == origin
        assert "POST" in r.headers["access-control-allow-methods"]
        # The request the preflight clears still needs the key.
        r = httpx.post(f"{server.url}/api/openai/v1/chat/completions", json=chat_body("tiny-long"),
                       headers={"Origin": origin}, timeout=DEADLINE)
        assert r.status_code == 401


@pytest.mark.parametrize("stream", [False, True])
def test_every_429_carries_an_integer_retry_after(long_model: Path, stream: bool) -> None:
    with live_server(Settings(max_queue=1, max_concurrent=1), models=[long_model]) as server:
        path, body = long_requests(stream=True)[0]
        running = send_raw(server, path, body)
        wait_for(lambda: completion_tokens(server) > 0, "the running stream to decode")
        queued = send_raw(server, path, body)
        wait_for(lambda: server.state.scheduler.depth == 1, "the queue to fill")
        try:
            for path, body in long_requests(stream):
                r = httpx.post(f"{server.url}{path}", json=body, timeout=DEADLINE)
                assert r.status_code == 429, (path, r.text)
                assert r.headers.get("retry-after", "").isdigit(), (path, r.headers)
                assert int(r.headers["retry-after"]) >= 1
        finally:
            queued.close()
            running.close()


# The embedded SmolLM2 answers this greedily with "く" and then starts "わ" (b"\xe3\x82\x8f"): its
# third token is the first two bytes of that character, so max_tokens=3 cuts it in half.
CUT_QUESTION = "Write the Japanese word for cat in kanji."
CUT_AT = 3
CUT_ANSWER = "く"


@pytest.fixture(scope="module")
def smollm2_server() -> Iterator[LiveServer]:
    with live_server(Settings()) as live:
        yield live


def openai_cut(url: str, stream: bool) -> str:
    client = openai.OpenAI(base_url=f"{url}/api/openai/v1", api_key="x", max_retries=0)
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [
        {"role": "user", "content": CUT_QUESTION}
    ]
    model = "smollm2-135m-instruct"
    if not stream:
        r = client.chat.completions.create(model=model, messages=messages, max_tokens=CUT_AT,
                                           temperature=0)
        assert r.choices[0].finish_reason == "length"
        return r.choices[0].message.content or ""
    chunks = client.chat.completions.create(model=model, messages=messages, max_tokens=CUT_AT,
                                            temperature=0, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def anthropic_cut(url: str, stream: bool) -> str:
    client = anthropic.Anthropic(base_url=f"{url}/api/anthropic", api_key="x", max_retries=0)
    model = "smollm2-135m-instruct"
    greedy = {"temperature": 0.0}  # anthropic>=2 takes sampling fields through extra_body
    messages: list[anthropic.types.MessageParam] = [{"role": "user", "content": CUT_QUESTION}]
    if not stream:
        r = client.messages.create(model=model, max_tokens=CUT_AT, messages=messages,
                                   extra_body=greedy)
        assert r.stop_reason == "max_tokens"
        return "".join(b.text for b in r.content if b.type == "text")
    with client.messages.stream(model=model, max_tokens=CUT_AT, messages=messages,
                                extra_body=greedy) as s:
        text = "".join(s.text_stream)
        assert s.get_final_message().stop_reason == "max_tokens"
        return text


def gemini_cut(url: str, stream: bool) -> str:
    client = genai.Client(
        api_key="x", http_options=types.HttpOptions(base_url=f"{url}/api/gemini", api_version="v1beta")
    )
    config = types.GenerateContentConfig(max_output_tokens=CUT_AT, temperature=0)
    model = "smollm2-135m-instruct"
    if not stream:
        return client.models.generate_content(model=model, contents=CUT_QUESTION, config=config).text or ""
    chunks = client.models.generate_content_stream(model=model, contents=CUT_QUESTION, config=config)
    return "".join(c.text or "" for c in chunks)


BIG_PROMPT = "word " * (5 * 1024 * 1024 // 5)  # 5 MB: over a million tokens, under --max-body


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/api/openai/v1/chat/completions",
         {"model": "smollm2-135m-instruct", "max_tokens": 1,
          "messages": [{"role": "user", "content": BIG_PROMPT}]}),
        ("/api/anthropic/v1/messages/count_tokens",
         {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": BIG_PROMPT}]}),
    ],
)
def test_health_answers_while_a_huge_prompt_is_tokenized(
    smollm2_server: LiveServer, path: str, body: dict[str, object]
) -> None:
    url = smollm2_server.url
    start = time.monotonic()
    big = ThreadPoolExecutor(1).submit(httpx.post, f"{url}{path}", json=body, timeout=300)
    slowest = 0.0
    with httpx.Client(timeout=300) as client:
        while not big.done():
            asked = time.monotonic()
            assert client.get(f"{url}/admin/health").status_code == 200
            slowest = max(slowest, time.monotonic() - asked)
            time.sleep(0.02)
    took = time.monotonic() - start
    answer = big.result()
    # Over a million tokens: the chat is refused for the context, the count is given.
    assert answer.status_code in (200, 400), answer.text
    assert "1048" in answer.text
    # Tokenizing takes seconds; a blocked event loop answers health only at its end. (Relative
    # to the request's own time, so a loaded machine slows both.)
    assert slowest < took / 4, (slowest, took)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("ask", [openai_cut, anthropic_cut, gemini_cut])
def test_an_answer_cut_inside_a_character_ends_at_the_last_whole_one(
    smollm2_server: LiveServer, ask: Callable[[str, bool], str], stream: bool
) -> None:
    text = ask(smollm2_server.url, stream)
    assert "\ufffd" not in text
    assert text == CUT_ANSWER
