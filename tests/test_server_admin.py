"""The admin API, residency (LRU eviction, budget refusal, idle TTL), downloads with SSE progress,
metrics, API keys, CORS and body limits, on a real server on loopback with tiny models."""

from __future__ import annotations

import importlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import huggingface_hub.constants as hf_constants
import openai
import pytest

from mlx_omnia.server.manager import ModelManager
from mlx_omnia.server.settings import Settings
from tests.fixtures.tiny import write_tiny_llama
from tests.hub_server import HubServer
from tests.server_harness import LiveServer, live_server

TINY_BYTES = 460_032  # the weights of write_tiny_llama's checkpoint in float32


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("admin-models")
    return {
        name: write_tiny_llama(root / name, seed=i)
        for i, name in enumerate(("tiny-a", "tiny-b", "tiny-c"))
    }


def serve(settings: Settings, models: dict[str, Path]) -> tuple[ModelManager, dict[str, str]]:
    manager = ModelManager(settings)
    ids = {name: manager.add_alias(path) for name, path in models.items()}
    return manager, ids


def oai(server: LiveServer, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/api/openai/v1", api_key=key, max_retries=0)


def chat(server: LiveServer, model: str, max_tokens: int = 4) -> openai.types.chat.ChatCompletion:
    return oai(server).chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=max_tokens,
        temperature=0,
    )


def resident(server: LiveServer) -> set[str]:
    models = httpx.get(f"{server.url}/admin/models").json()["models"]
    return {m["id"] for m in models if m["resident"]}


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        key, value = line.rsplit(" ", 1)
        sample, _, rest = key.partition("{")
        got = ",".join(sorted(rest.rstrip("}").split(","))) if rest else ""
        if sample == name and got == want:
            return float(value)
    return 0.0


# -- listing, loading, unloading --------------------------------------------------------------------


def test_list_load_unload(tiny_models: dict[str, Path]) -> None:
    settings = Settings()
    manager, ids = serve(settings, tiny_models)
    with live_server(settings, manager) as server:
        listing = httpx.get(f"{server.url}/admin/models").json()
        by_id = {m["id"]: m for m in listing["models"]}
        assert {"tiny-a", "tiny-b", "tiny-c"} <= set(by_id)
        assert by_id["tiny-a"]["source"] == "alias"
        assert by_id["tiny-a"]["size_on_disk"] > TINY_BYTES
        assert by_id["tiny-a"]["estimated_bytes"] == TINY_BYTES
        assert not by_id["tiny-a"]["resident"]
        assert listing["memory"] == {"resident_bytes": 0, "limit_bytes": settings.memory_limit}
        if "smollm2-135m-instruct" in by_id:  # the embedded default, when installed
            assert by_id["smollm2-135m-instruct"]["source"] == "embedded"
            assert by_id["smollm2-135m-instruct"]["default"]

        r = httpx.put(f"{server.url}/admin/models/{ids['tiny-a']}/residency")
        assert r.status_code == 200, r.text
        assert r.json() == {"id": "tiny-a", "resident": True, "resident_bytes": TINY_BYTES}
        listing = httpx.get(f"{server.url}/admin/models").json()
        a = next(m for m in listing["models"] if m["id"] == "tiny-a")
        assert a["resident"] and a["resident_bytes"] == TINY_BYTES
        assert listing["memory"]["resident_bytes"] == TINY_BYTES

        r = httpx.delete(f"{server.url}/admin/models/tiny-a/residency")
        assert r.status_code == 200 and r.json()["unloaded"] is True
        assert resident(server) == set()
        assert (
            httpx.delete(f"{server.url}/admin/models/tiny-a/residency").json()["unloaded"] is False
        )

        # names, never paths; unknown models are 404 in the native shape
        r = httpx.put(f"{server.url}/admin/models/..%2F..%2Fetc/residency")
        assert r.status_code == 404
        r = httpx.put(f"{server.url}/admin/models/nobody/nothing/residency")
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found"
        # the embedded default and local aliases are never deleted
        r = httpx.delete(f"{server.url}/admin/models/smollm2-135m-instruct")
        assert r.status_code == 400 and "embedded default" in r.json()["error"]["message"]
        assert httpx.delete(f"{server.url}/admin/models/tiny-a").status_code == 400
        assert tiny_models["tiny-a"].is_dir()


def test_lru_eviction_and_budget_refusal(tiny_models: dict[str, Path]) -> None:
    settings = Settings(memory_limit=int(TINY_BYTES * 2.5))  # room for two
    manager, _ = serve(settings, tiny_models)
    with live_server(settings, manager) as server:
        assert chat(server, "tiny-a").choices[0].message.content is not None
        chat(server, "tiny-b")
        assert resident(server) == {"tiny-a", "tiny-b"}
        chat(server, "tiny-a")  # a is now the most recently used
        chat(server, "tiny-c")  # evicts b, the least recently used
        assert resident(server) == {"tiny-a", "tiny-c"}
        r = httpx.put(f"{server.url}/admin/models/tiny-b/residency")  # evicts a
        assert r.status_code == 200
        assert resident(server) == {"tiny-c", "tiny-b"}

    settings = Settings(memory_limit=TINY_BYTES // 2)  # not even one fits
    manager, _ = serve(settings, tiny_models)
    with live_server(settings, manager) as server:
        with pytest.raises(openai.BadRequestError) as info:
            chat(server, "tiny-a")
        body = info.value.body
        assert isinstance(body, dict)
        assert body["type"] == "invalid_request_error" and "--memory-limit" in body["message"]
        r = httpx.put(f"{server.url}/admin/models/tiny-a/residency")
        assert r.status_code == 400 and "--memory-limit" in r.json()["error"]["message"]
        assert resident(server) == set()


def test_idle_models_unload_after_ttl(tiny_models: dict[str, Path]) -> None:
    settings = Settings(idle_ttl=1.0)
    manager, _ = serve(settings, tiny_models)
    with live_server(settings, manager) as server:
        chat(server, "tiny-a")
        assert "tiny-a" in resident(server)
        deadline = time.monotonic() + 10
        while "tiny-a" in resident(server) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert resident(server) == set()
        chat(server, "tiny-a")  # loads again on demand


# -- metrics ------------------------------------------------------------------------------------


def test_metrics_count_requests_and_tokens(tiny_models: dict[str, Path]) -> None:
    settings = Settings()
    manager, _ = serve(settings, tiny_models)
    with live_server(settings, manager) as server:
        completion = chat(server, "tiny-a", max_tokens=5)
        assert completion.usage is not None
        chat(server, "tiny-a", max_tokens=3)
        text = httpx.get(f"{server.url}/metrics").text
        route = "/api/openai/v1/chat/completions"
        assert (
            metric(text, "omnia_requests_total", dialect="openai", route=route, status="200") == 2
        )
        assert (
            metric(text, "omnia_completion_tokens_total", model="tiny-a")
            == completion.usage.completion_tokens + 3
        )
        assert (
            metric(text, "omnia_prompt_tokens_total", model="tiny-a")
            == 2 * completion.usage.prompt_tokens
        )
        assert metric(text, "omnia_time_to_first_token_seconds_count", model="tiny-a") == 2
        assert metric(text, "omnia_decode_tokens_per_second_count", model="tiny-a") == 2
        assert metric(text, "omnia_queue_depth") == 0
        assert metric(text, "omnia_resident_models") == 1
        assert metric(text, "omnia_resident_model_bytes", model="tiny-a") == TINY_BYTES
        httpx.post(f"{server.url}{route}", json={"model": "tiny-a"})  # 400: no messages
        text = httpx.get(f"{server.url}/metrics").text
        assert (
            metric(text, "omnia_requests_total", dialect="openai", route=route, status="400") == 1
        )


# -- API key, CORS, body limit --------------------------------------------------------------------


def test_api_key_in_each_dialect(tiny_models: dict[str, Path]) -> None:
    settings = Settings(api_key="s3cret")
    manager, _ = serve(settings, tiny_models)
    with live_server(settings, manager) as server:
        for key in ("none", "wrong"):
            with pytest.raises(openai.AuthenticationError) as oerr:
                oai(server, key).chat.completions.create(
                    model="tiny-a", messages=[{"role": "user", "content": "hi"}], max_tokens=2
                )
            assert (
                isinstance(oerr.value.body, dict)
                and oerr.value.body["type"] == "authentication_error"
            )
            client = anthropic.Anthropic(
                base_url=f"{server.url}/api/anthropic", api_key=key, max_retries=0
            )
            with pytest.raises(anthropic.AuthenticationError) as aerr:
                client.messages.create(
                    model="tiny-a", max_tokens=2, messages=[{"role": "user", "content": "hi"}]
                )
            assert aerr.value.body == {
                "type": "error",
                "error": {"type": "authentication_error", "message": "missing or invalid API key"},
            }
        gemini = f"{server.url}/api/gemini/v1beta/models/tiny-a:generateContent"
        body = {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}
        for headers in ({}, {"x-goog-api-key": "wrong"}):
            r = httpx.post(gemini, json=body, headers=headers)
            assert r.status_code == 401
            assert (
                r.json()["error"]["status"] == "UNAUTHENTICATED"
                and r.json()["error"]["code"] == 401
            )
        r = httpx.get(f"{server.url}/admin/models")
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication"
        assert httpx.get(f"{server.url}/metrics").status_code == 401
        assert httpx.get(f"{server.url}/admin/health").status_code == 200  # stays open

        # the right key, in each dialect's own header
        good = oai(server, "s3cret").chat.completions.create(
            model="tiny-a", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert good.choices[0].finish_reason in ("length", "stop")
        assert (
            httpx.get(f"{server.url}/admin/models", headers={"x-api-key": "s3cret"}).status_code
            == 200
        )
        r = httpx.post(gemini, json=body, headers={"x-goog-api-key": "s3cret"})
        assert r.status_code != 401


def test_cors_and_body_limit(tiny_models: dict[str, Path]) -> None:
    settings = Settings(cors_origins=("http://app.example",), max_body_bytes=2000)
    manager, _ = serve(settings, tiny_models)
    with live_server(settings, manager) as server:
        r = httpx.get(f"{server.url}/admin/health", headers={"Origin": "http://app.example"})
        assert r.headers["access-control-allow-origin"] == "http://app.example"
        r = httpx.options(
            f"{server.url}/api/openai/v1/chat/completions",
            headers={
                "Origin": "http://app.example",
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization,content-type",
            },
        )
        assert (
            r.status_code == 200
            and r.headers["access-control-allow-origin"] == "http://app.example"
        )
        r = httpx.get(f"{server.url}/admin/health", headers={"Origin": "http://evil.example"})
        assert "access-control-allow-origin" not in r.headers

        big = "x" * 5000
        with pytest.raises(openai.APIStatusError) as info:
            oai(server).chat.completions.create(
                model="tiny-a", messages=[{"role": "user", "content": big}], max_tokens=2
            )
        assert info.value.status_code == 413
        assert isinstance(info.value.body, dict) and "2000 bytes" in info.value.body["message"]
    with live_server(Settings(), manager) as server:  # no CORS configured: no headers
        r = httpx.get(f"{server.url}/admin/health", headers={"Origin": "http://app.example"})
        assert "access-control-allow-origin" not in r.headers


# -- downloads ------------------------------------------------------------------------------------

REPO = "acme/tiny-llama"


@pytest.fixture
def hub(tmp_path: Path, tiny_llama_dir: Path) -> Iterator[HubServer]:
    """A loopback hub serving REPO, with huggingface_hub pointed at it and at a fresh cache."""
    server = HubServer().start()
    server.add_repo(REPO, tiny_llama_dir, extra_files={"README.md": b"# tiny\n"})
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.chdir(tmp_path)
            for key, value in {
                "HF_ENDPOINT": server.url,
                "HF_HOME": str(tmp_path / "hf"),
                "HF_HUB_CACHE": str(tmp_path / "hf" / "hub"),
                "HF_HUB_DISABLE_XET": "1",
                "HF_HUB_DISABLE_TELEMETRY": "1",
                "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            }.items():
                mp.setenv(key, value)
            for key in ("HF_HUB_OFFLINE", "HF_TOKEN", "HF_TOKEN_PATH", "HUGGINGFACE_HUB_CACHE"):
                mp.delenv(key, raising=False)
            importlib.reload(hf_constants)
            yield server
    finally:
        server.stop()
        importlib.reload(hf_constants)


def events(server: LiveServer, job: str) -> list[tuple[str, dict[str, object]]]:
    out: list[tuple[str, dict[str, object]]] = []
    with httpx.stream("GET", f"{server.url}/admin/jobs/{job}/events", timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        event = "message"
        for line in r.iter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                out.append((event, json.loads(line[6:])))
    return out


def test_pull_with_progress_then_chat_then_delete(hub: HubServer) -> None:
    settings = Settings()
    with live_server(settings) as server:
        assert REPO not in {
            m["id"] for m in httpx.get(f"{server.url}/admin/models").json()["models"]
        }
        r = httpx.post(f"{server.url}/admin/models", json={"model": REPO})
        assert r.status_code == 202, r.text
        job = r.json()["job"]
        seen = events(server, job)
        states = [e for e, _ in seen]
        assert states[-1] == "done" and set(states) <= {"queued", "running", "done"}
        last = seen[-1][1]
        assert (
            last["error"] is None and isinstance(last["total"], int) and last["total"] > TINY_BYTES
        )
        assert last["done"] == last["total"]
        files = last["files"]
        assert (
            isinstance(files, dict)
            and files["model.safetensors"]["done"] == files["model.safetensors"]["total"]
        )
        assert "README.md" not in files  # only what loading needs
        partial = [d["done"] for e, d in seen if e == "running"]
        assert partial == sorted(partial)  # type: ignore[type-var]
        assert httpx.get(f"{server.url}/admin/jobs/{job}").json()["state"] == "done"

        listing = {m["id"]: m for m in httpx.get(f"{server.url}/admin/models").json()["models"]}
        assert listing[REPO]["source"] == "hub" and listing[REPO]["commit"] == hub.commit(REPO)
        assert listing[REPO]["estimated_bytes"] == TINY_BYTES

        answer = chat(server, REPO)
        assert (
            answer.model == REPO
            and answer.usage is not None
            and answer.usage.completion_tokens >= 1
        )

        r = httpx.delete(f"{server.url}/admin/models/{REPO}")
        assert r.status_code == 200 and r.json()["freed_bytes"] > TINY_BYTES
        assert REPO not in {
            m["id"] for m in httpx.get(f"{server.url}/admin/models").json()["models"]
        }
        assert httpx.delete(f"{server.url}/admin/models/{REPO}").status_code == 404

        # a repo the hub does not have: the job fails with the engine's error
        r = httpx.post(f"{server.url}/admin/models", json={"model": "acme/missing"})
        seen = events(server, r.json()["job"])
        assert seen[-1][0] == "failed"
        error = seen[-1][1]["error"]
        assert (
            isinstance(error, dict)
            and error["type"] == "not_found"
            and "acme/missing" in error["message"]
        )
        assert httpx.get(f"{server.url}/admin/jobs/pull-999").status_code == 404
        r = httpx.post(f"{server.url}/admin/models", json={"model": "../etc"})
        assert r.status_code == 400  # not a repo id: the body's field is refused, as "acme" is
        assert "not a hub repo id" in r.json()["error"]["message"]
