"""GET /admin/status: what `omnia status` and the web app show."""

from __future__ import annotations

import httpx

from mlx_omnia.server.settings import Settings
from tests.server_harness import live_server


def test_status_reports_backend_memory_resident_models_and_last_answer() -> None:
    with live_server(Settings(api_key="k")) as s:
        headers = {"Authorization": "Bearer k"}
        assert httpx.get(f"{s.url}/admin/status").status_code == 401
        before = httpx.get(f"{s.url}/admin/status", headers=headers).json()
        assert before["last_answer"] is None and before["resident"] == []
        assert before["runtime"]["backend"] == "cpu"
        r = httpx.post(
            f"{s.url}/api/openai/v1/chat/completions",
            headers=headers,
            json={"model": "smollm2-135m-instruct", "max_tokens": 6,
                  "messages": [{"role": "user", "content": "Count to five."}]},
            timeout=120,
        )
        usage = r.json()["usage"]
        after = httpx.get(f"{s.url}/admin/status", headers=headers).json()
        assert [m["id"] for m in after["resident"]] == ["smollm2-135m-instruct"]
        assert after["memory"]["resident_bytes"] == after["resident"][0]["bytes"] > 100_000_000
        last = after["last_answer"]
        assert last["model"] == "smollm2-135m-instruct"
        assert last["completion_tokens"] == usage["completion_tokens"]
        assert last["prompt_tokens"] == usage["prompt_tokens"]
        assert last["tokens_per_second"] is None or last["tokens_per_second"] > 0
