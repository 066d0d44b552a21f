"""The OpenAPI schema says what the server does (issue 28 item 8): schemathesis fuzzes a live
omnia-server, started as users start it, from the schema the server publishes. Every answer
must be documented (status, content type, headers, body schema), none may be a 5xx, requests
the schema calls invalid must be refused, and a method a path lacks answers 405 with Allow.

Not checked: that every request the schema allows is accepted. Some limits are the model's
(max_tokens within its context, logit_bias ids within its vocabulary, an empty prompt only with
a BOS token) and a static schema cannot state them; those answer 400, which is documented."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.fixtures.tiny import write_tiny_llama
from tests.server_harness import server_process

HERE = Path(__file__).parent
CHECKS = (
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_headers_conformance",
    "response_schema_conformance",
    "negative_data_rejection",
    "unsupported_method",
    "allow_header_conformance",
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """omnia-server in its own process, serving a tiny llama (a 64-token context: every answer
    is short) as the default model "tiny", with a hub cache of its own and no network."""
    root = tmp_path_factory.mktemp("fuzz")
    tiny = write_tiny_llama(root / "tiny", max_position_embeddings=64)
    env = {
        "HF_HOME": str(root / "hf"),
        "HF_HUB_CACHE": str(root / "hf" / "hub"),
        "HF_HUB_OFFLINE": "1",
    }
    with server_process(["--model", str(tiny)], root / "server.log", env) as url:
        yield url


def test_schema_documents_what_the_server_answers(server: str) -> None:
    schema = httpx.get(f"{server}/openapi.json").json()
    operations = [op for ops in schema["paths"].values() for op in ops.values()]
    assert all("422" not in op["responses"] for op in operations)
    assert all("400" in op["responses"] for op in operations)
    chat = schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert chat["messages"]["minItems"] == 1
    assert (chat["temperature"]["minimum"], chat["temperature"]["maximum"]) == (0, 2)
    gemini = "/api/gemini/v1beta/models/{model}:generateContent"
    body = schema["paths"][gemini]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["properties"]["contents"]["minItems"] == 1
    anthropic = httpx.get(f"{server}/api/anthropic/v1/models", params={"after_id": ""})
    assert anthropic.status_code == 200, anthropic.text  # an empty cursor is no cursor


def test_a_non_ascii_digit_is_refused_not_a_crash(server: str) -> None:
    """'²'.isdigit() is true and int('²') fails: such ids and counts were a plain-text 500."""
    openai = httpx.post(
        f"{server}/api/openai/v1/completions",
        json={"model": "tiny", "prompt": "Hi", "max_tokens": 2, "logit_bias": {"²": 1.0}},
    )
    assert openai.status_code == 400 and openai.json()["error"]["param"] == "logit_bias"
    gemini = httpx.post(
        f"{server}/api/gemini/v1beta/models/tiny:generateContent",
        json={"contents": [{"parts": [{"text": "Hi"}]}], "generationConfig": {"maxOutputTokens": "²"}},
    )
    assert gemini.status_code == 400 and gemini.json()["error"]["status"] == "INVALID_ARGUMENT"
    pages = httpx.get(f"{server}/api/gemini/v1beta/models", params={"pageToken": "²"})
    assert pages.status_code == 400


def test_fuzzing_from_the_schema_finds_nothing(server: str, tmp_path: Path) -> None:
    # POST /admin/models starts a download, which this offline server cannot make.
    cmd = [
        sys.executable, "-m", "schemathesis.cli",
        "--config-file", str(HERE / "fuzz" / "schemathesis.toml"),
        "run", f"{server}/openapi.json",
        "--checks", ",".join(CHECKS),
        "--exclude-name", "POST /admin/models",
        "--max-examples", "25", "--seed", "28", "--workers", "1",
        "--continue-on-failure", "--request-timeout", "60", "--no-color",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-20000:] + done.stderr[-5000:]
    assert "Tested: 25" in done.stdout, done.stdout[-5000:]  # every operation but the pull


@pytest.mark.parametrize(
    ("path", "allow"),
    [
        ("/admin/models", "GET, POST"),
        ("/admin/models/tiny/residency", "PUT, DELETE"),
        ("/api/gemini/v1beta/models/tiny:countTokens", "POST"),
        ("/api/gemini/v1beta/models/acme/tiny", "GET"),
    ],
)
def test_allow_names_every_method_of_the_path(server: str, path: str, allow: str) -> None:
    """Starlette's 405 named only the first route's methods (GET of GET and POST)."""
    r = httpx.request("PATCH", f"{server}{path}")
    assert r.status_code == 405 and r.headers["allow"] == allow, (r.headers, r.text)
