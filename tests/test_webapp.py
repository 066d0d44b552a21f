"""The web app at `/`, driven in Debian's chromium through Playwright against a live server.

Skipped when chromium (/usr/bin/chromium) or playwright is missing, except under CI (CI=true),
where that is a failure. `OMNIA_UPDATE_SCREENSHOT=1 pytest tests/test_webapp.py -k reload`
rewrites docs/webapp.png."""

from __future__ import annotations

import importlib
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import huggingface_hub.constants as hf_constants
import pytest

from mlx_omnia.server.manager import ModelManager
from mlx_omnia.server.settings import Settings
from tests.hub_server import HubServer
from tests.server_harness import LiveServer, live_server

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
VIEWPORT = {"width": 1280, "height": 800}
SCREENSHOT = Path(__file__).resolve().parent.parent / "docs" / "webapp.png"
DEFAULT = "smollm2-135m-instruct"
ANSWER_TIMEOUT_MS = 120_000

pytestmark = pytest.mark.slow


def _under_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def _browser_missing(reason: str) -> None:
    if _under_ci():
        pytest.fail(f"{reason}: the web app tests need it under CI")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not CHROMIUM.exists():
        _browser_missing(f"{CHROMIUM} is missing (apt-get install -y chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _browser_missing("playwright is not installed (pip install -e '.[dev]')")
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS
        )
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path) -> Iterator[LiveServer]:
    """One server for the module: the embedded SmolLM2 and the tiny llama as a second model."""
    settings = Settings()
    manager = ModelManager(settings)
    manager.add_alias(tiny_llama_dir)
    with live_server(settings, manager) as s:
        yield s


@pytest.fixture
def tiny(tiny_llama_dir: Path) -> str:
    return tiny_llama_dir.name


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    """A fresh browser context (empty localStorage) per test, at 1280x800."""
    context = browser.new_context(viewport=VIEWPORT)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        yield page
    finally:
        context.close()
    assert not errors, f"uncaught errors in the page: {errors}"


def expect(target: Any) -> Any:
    from playwright.sync_api import expect as playwright_expect

    return playwright_expect(target)


def send(page: Any, text: str) -> Any:
    """Type `text`, send it, and return the locator of the answer being written."""
    page.get_by_role("textbox", name="Message").fill(text)
    page.get_by_role("button", name="Send").click()
    return page.get_by_role("article", name="Assistant").last


def wait_answer(page: Any, answer: Any) -> None:
    expect(answer).to_have_attribute("aria-busy", "false", timeout=ANSWER_TIMEOUT_MS)
    expect(page.get_by_role("button", name="Send")).to_be_enabled()
    expect(page.get_by_role("button", name="Stop")).to_be_disabled()


def answer_text(answer: Any) -> str:
    return str(answer.locator(".content").inner_text())


def status(server: LiveServer, key: str | None = None) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(f"{server.url}/admin/status", headers=headers, timeout=10).json()


# -- serving ---------------------------------------------------------------------------------------


def test_page_and_assets_are_served_from_package_data(server: LiveServer) -> None:
    r = httpx.get(f"{server.url}/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert '<script type="module" src="/static/app.js">' in r.text
    assert "default-src 'self'" in r.headers["content-security-policy"]
    for name, kind in [
        ("app.js", "text/javascript"),
        ("markdown.js", "text/javascript"),
        ("style.css", "text/css"),
        ("icon.svg", "image/svg+xml"),
    ]:
        r = httpx.get(f"{server.url}/static/{name}")
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind), name
    for bad in ("nope.js", "../webapp.py", "..%2Fwebapp.py", "%2e%2e/app.py", ""):
        assert httpx.get(f"{server.url}/static/{bad}").status_code == 404, bad


def test_assets_are_read_at_start_and_revalidated_by_etag(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A reinstall that replaces or removes the package's files under a running server (pip
    install over the same venv) leaves the page it serves intact."""
    from mlx_omnia.server import webapp

    copy = tmp_path / "web"
    shutil.copytree(webapp.WEB_DIR, copy)
    monkeypatch.setattr(webapp, "WEB_DIR", copy)
    with live_server() as live:
        first = httpx.get(f"{live.url}/")
        shutil.rmtree(copy)
        again = httpx.get(f"{live.url}/")
        assert first.status_code == again.status_code == 200 and again.text == first.text
        script = httpx.get(f"{live.url}/static/app.js")
        assert script.status_code == 200 and script.text
        tag = script.headers["etag"]
        cached = httpx.get(f"{live.url}/static/app.js", headers={"If-None-Match": tag})
        assert cached.status_code == 304 and cached.headers["etag"] == tag


def test_sizes_read_as_the_cli_writes_them(server: LiveServer, page: Any) -> None:
    from mlx_omnia.cli import fmt

    page.goto(server.url)
    for n in (0, 999, 98_400_000, 17_700_000_000, 123_456_789, 1_500):
        shown = page.evaluate("n => import('/static/app.js').then(m => m.formatBytes(n))", n)
        assert shown == fmt.size(n), n


# -- markdown --------------------------------------------------------------------------------------


def test_markdown_renderer_formats_and_escapes(server: LiveServer, page: Any) -> None:
    page.goto(server.url)
    cases = {
        "hello": "<p>hello</p>",
        "# Title": "<h1>Title</h1>",
        "### Sub *it*": "<h3>Sub <em>it</em></h3>",
        "**bold** and *it* and _it_ and `x < y`": (
            "<p><strong>bold</strong> and <em>it</em> and <em>it</em> and <code>x &lt; y</code></p>"
        ),
        "- a\n- b **c**": "<ul><li>a</li><li>b <strong>c</strong></li></ul>",
        "1. one\n2. two\n   - inner": "<ol><li>one</li><li>two<ul><li>inner</li></ul></li></ol>",
        "```python\nprint('<b>')\n```": (
            '<pre><span class="code-lang">python</span><code class="language-python">'
            "print(&#39;&lt;b&gt;&#39;)</code></pre>"
        ),
        "```\nunterminated <i>": "<pre><code>unterminated &lt;i&gt;</code></pre>",
        "<img src=x onerror=alert(1)>": "<p>&lt;img src=x onerror=alert(1)&gt;</p>",
        "[site](https://example.com/a?b=1&c=2)": (
            '<p><a href="https://example.com/a?b=1&amp;c=2" target="_blank" '
            'rel="noopener noreferrer">site</a></p>'
        ),
        "[x](javascript:alert(1))": "<p>[x](javascript:alert(1))</p>",
        '[x](https://e.com/"onmouseover="a)': None,  # checked below: no raw quote in the href
        "2 * 3 * 4": "<p>2 * 3 * 4</p>",
        "snake_case_name": "<p>snake_case_name</p>",
        "line one\nline two": "<p>line one<br>line two</p>",
    }
    got = page.evaluate(
        """async (sources) => {
            const { renderMarkdown } = await import('/static/markdown.js');
            return sources.map((s) => renderMarkdown(s));
        }""",
        list(cases),
    )
    for (source, want), html in zip(cases.items(), got, strict=True):
        if want is not None:
            assert html == want, source
    assert '"onmouseover' not in got[list(cases).index('[x](https://e.com/"onmouseover="a)')]


# -- chat ------------------------------------------------------------------------------------------


def test_chat_streams_an_answer_that_survives_a_reload(server: LiveServer, page: Any) -> None:
    page.goto(server.url)
    page.get_by_label("Temperature").fill("0")
    page.get_by_label("Max tokens").fill("48")
    expect(page.get_by_role("combobox", name="Model")).to_have_value(DEFAULT)
    answer = send(page, "What is the capital of France?")
    expect(answer).to_have_attribute("aria-busy", "true")  # shown while it streams
    wait_answer(page, answer)
    assert "Paris" in answer_text(answer)
    expect(answer.locator(".meta")).to_contain_text(DEFAULT)
    expect(answer.locator(".meta")).to_contain_text("tok/s")
    conversation = page.get_by_role("navigation", name="Conversation list")
    expect(
        conversation.get_by_role("button", name="What is the capital of France?", exact=True)
    ).to_be_visible()
    # the status panel was refreshed after the answer
    expect(page.locator("#status-last")).to_contain_text("tok/s", timeout=10_000)
    expect(page.locator("#status-resident")).to_contain_text(DEFAULT)
    expect(page.locator("#status-backend")).to_contain_text("cpu")

    page.reload()
    user = page.get_by_role("article", name="You")
    expect(user).to_have_count(1)
    expect(user.locator(".content")).to_have_text("What is the capital of France?")
    restored = page.get_by_role("article", name="Assistant")
    expect(restored).to_have_count(1)
    expect(restored.locator(".content")).to_contain_text("Paris")
    expect(page.get_by_role("heading", level=1)).to_have_text("What is the capital of France?")
    expect(page.get_by_label("Temperature")).to_have_value("0")  # settings survive too

    # a new conversation, then back to the first one; deleting removes it from the list
    page.get_by_role("button", name="New chat").click()
    expect(page.get_by_role("article")).to_have_count(0)
    conversation.get_by_role("button", name="What is the capital of France?", exact=True).click()
    expect(page.get_by_role("article", name="Assistant")).to_have_count(1)

    if os.environ.get("OMNIA_UPDATE_SCREENSHOT") == "1":
        page.get_by_label("Max tokens").fill("160")
        more = send(page, "Give three tips for writing clean Python code, as a numbered list.")
        wait_answer(page, more)
        page.get_by_role("textbox", name="Message").click()
        time.sleep(0.3)
        SCREENSHOT.parent.mkdir(exist_ok=True)
        page.screenshot(path=str(SCREENSHOT))

    page.get_by_role("button", name="Delete conversation: What is the capital of France?").click()
    expect(conversation.get_by_role("listitem")).to_have_count(0)
    expect(page.get_by_role("article")).to_have_count(0)


def test_stop_interrupts_a_long_answer(server: LiveServer, page: Any) -> None:
    page.goto(server.url)
    page.get_by_label("Temperature").fill("0")
    page.get_by_label("Max tokens").fill("2000")
    answer = send(page, "Write a very long story about a dragon who learns to cook.")
    content = answer.locator(".content")
    # a few words are in (or the answer failed: say why at once rather than at the timeout)
    page.wait_for_function(
        """() => {
            const a = [...document.querySelectorAll('article.assistant')].pop();
            if (!a) return false;  // not drawn yet (a busy machine)
            return a.querySelector('.error').textContent
                || /\\S+\\s+\\S+\\s+\\S+/.test(a.querySelector('.content').innerText);
        }""",
        timeout=ANSWER_TIMEOUT_MS,
    )
    assert answer.locator(".error").inner_text() == ""
    expect(content).to_have_text(re.compile(r"\S+\s+\S+\s+\S+"))
    expect(page.get_by_role("button", name="Send")).to_be_disabled()
    page.get_by_role("button", name="Stop").click()

    wait_answer(page, answer)  # the UI is ready for the next message at once
    expect(answer.locator(".meta")).to_contain_text("stopped")
    stopped = answer_text(answer)
    time.sleep(1.5)
    assert answer_text(answer) == stopped  # it stopped growing
    assert 0 < len(stopped.split()) < 200

    # the server stopped generating too: the model goes idle and nothing is queued
    deadline = time.monotonic() + 30
    while True:
        s = status(server)
        if s["queue_depth"] == 0 and not any(r["busy"] for r in s["resident"]):
            break
        assert time.monotonic() < deadline, s
        time.sleep(0.1)

    page.get_by_label("Max tokens").fill("6")
    follow = send(page, "Say hi.")
    wait_answer(page, follow)
    assert answer_text(follow).strip()


def test_a_conversation_past_the_context_says_to_start_a_new_chat(
    server: LiveServer, page: Any
) -> None:
    page.goto(server.url)
    page.get_by_label("Max tokens").fill("4")
    answer = send(page, "hello " * 9000)
    wait_answer(page, answer)
    error = answer.locator(".error")
    expect(error).to_contain_text("the most this model takes")
    expect(error).to_contain_text("Start a new chat (New chat) to go on.")


def test_a_message_sent_before_the_model_list_arrives_names_the_model(
    server: LiveServer, page: Any
) -> None:
    """The model list (/admin/models) is held back until the message is sent: the app fetches
    it before it posts, so the request names the default model instead of none (HTTP 400)."""
    held: list[Any] = []
    page.route("**/admin/models", lambda route: held.append(route))
    page.goto(server.url)
    page.get_by_label("Max tokens").fill("4")
    answer = send(page, "Say hi.")
    deadline = time.monotonic() + 10
    while len(held) < 2:  # the page's own load, then the one the send waits on
        assert time.monotonic() < deadline, len(held)
        page.wait_for_timeout(50)
    for route in held:
        route.continue_()
    page.unroute("**/admin/models")
    wait_answer(page, answer)
    expect(answer.locator(".error")).to_be_hidden()
    assert answer_text(answer).strip()


def test_switching_to_another_model_answers_from_it(
    server: LiveServer, page: Any, tiny: str
) -> None:
    page.goto(server.url)
    picker = page.get_by_role("combobox", name="Model")
    expect(picker.locator(f'option[value="{tiny}"]')).to_have_count(1)
    picker.select_option(tiny)
    page.get_by_label("Max tokens").fill("8")
    answer = send(page, "Hello there")
    wait_answer(page, answer)
    expect(answer.locator(".meta")).to_contain_text(tiny)
    expect(answer.locator(".error")).to_be_hidden()
    assert status(server)["last_answer"]["model"] == tiny
    page.reload()
    expect(page.get_by_role("combobox", name="Model")).to_have_value(tiny)  # the choice is kept


def test_load_and_unload_update_the_picker_and_status(
    server: LiveServer, page: Any, tiny: str
) -> None:
    httpx.delete(f"{server.url}/admin/models/{tiny}/residency")
    page.goto(server.url)
    picker = page.get_by_role("combobox", name="Model")
    picker.select_option(tiny)
    info = page.locator("#model-info")
    expect(info).to_contain_text("On disk")
    load, unload = (page.get_by_role("button", name=n, exact=True) for n in ("Load", "Unload"))
    expect(unload).to_be_disabled()

    load.click()
    expect(info).to_contain_text("Resident")
    expect(load).to_be_disabled()
    expect(unload).to_be_enabled()
    expect(picker.locator('optgroup[label="In memory"] option', has_text=tiny)).to_have_count(1)
    expect(page.locator("#status-resident")).to_contain_text(tiny)
    assert tiny in [r["id"] for r in status(server)["resident"]]

    unload.click()
    expect(info).to_contain_text("On disk")
    expect(load).to_be_enabled()
    expect(picker.locator('optgroup[label="On disk"] option', has_text=tiny)).to_have_count(1)
    expect(page.locator("#status-resident")).not_to_contain_text(tiny)
    assert tiny not in [r["id"] for r in status(server)["resident"]]


# -- pull ------------------------------------------------------------------------------------------

REPO = "acme/tiny-llama"


@pytest.fixture
def hub(tmp_path: Path, tiny_llama_dir: Path) -> Iterator[HubServer]:
    """A loopback hub serving REPO, with huggingface_hub pointed at it and at a fresh cache."""
    hub = HubServer().start()
    hub.add_repo(REPO, tiny_llama_dir)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.chdir(tmp_path)
            for key, value in {
                "HF_ENDPOINT": hub.url,
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
            yield hub
    finally:
        hub.stop()
        importlib.reload(hf_constants)


def test_pull_shows_progress_to_100_percent(hub: HubServer, browser: Any) -> None:
    with live_server(Settings()) as server:
        context = browser.new_context(viewport=VIEWPORT)
        try:
            page = context.new_page()
            page.goto(server.url)
            picker = page.get_by_role("combobox", name="Model")
            expect(picker.locator(f'option[value="{REPO}"]')).to_have_count(0)
            page.get_by_label("Repository id").fill(REPO)
            page.get_by_role("button", name="Pull").click()
            progress = page.get_by_role("progressbar", name="Pull progress")
            expect(progress).to_have_attribute("aria-valuetext", "100%", timeout=60_000)
            assert progress.evaluate("p => p.value") == 100
            expect(page.locator("#pull-text")).to_contain_text(f"{REPO} is ready")
            expect(picker).to_have_value(REPO)  # listed and selected
            expect(page.locator("#model-info")).to_contain_text("hub")

            page.get_by_label("Repository id").fill("acme/missing")
            page.get_by_role("button", name="Pull").click()
            expect(page.locator("#pull-text")).to_contain_text("Failed", timeout=60_000)
            expect(page.locator("#pull-text")).to_contain_text("acme/missing")
        finally:
            context.close()


# -- API key ---------------------------------------------------------------------------------------


def test_api_key_is_asked_for_then_used(browser: Any, tiny_llama_dir: Path) -> None:
    settings = Settings(api_key="sesame")
    manager = ModelManager(settings)
    tiny = manager.add_alias(tiny_llama_dir)
    with live_server(settings, manager) as server:
        # the page itself is public; the API is not
        assert httpx.get(f"{server.url}/").status_code == 200
        assert httpx.get(f"{server.url}/static/app.js").status_code == 200
        assert httpx.get(f"{server.url}/admin/models").status_code == 401

        context = browser.new_context(viewport=VIEWPORT)
        try:
            page = context.new_page()
            page.goto(server.url)
            ask = page.get_by_role("region", name="This server needs an API key")
            expect(ask).to_be_visible()
            key = page.get_by_label("API key", exact=True)
            key.fill("wrong")
            page.get_by_role("button", name="Save key").click()
            expect(ask).to_be_visible()
            expect(ask.get_by_role("alert")).to_contain_text("refused")

            key.fill("sesame")
            page.get_by_role("button", name="Save key").click()
            expect(ask).to_be_hidden()
            picker = page.get_by_role("combobox", name="Model")
            expect(picker.locator(f'option[value="{tiny}"]')).to_have_count(1)
            expect(page.locator("#status-backend")).to_contain_text("cpu")
            picker.select_option(tiny)
            page.get_by_label("Max tokens").fill("6")
            answer = send(page, "Hi")
            wait_answer(page, answer)
            expect(answer.locator(".error")).to_be_hidden()
            expect(answer.locator(".meta")).to_contain_text(tiny)

            page.reload()  # the key is remembered
            expect(picker.locator(f'option[value="{tiny}"]')).to_have_count(1)
            expect(ask).to_be_hidden()
        finally:
            context.close()
