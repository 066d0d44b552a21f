"""The vendor coding-agent CLIs (Claude Code, Codex, Gemini CLI), installed from npm at pinned
versions, complete a prompt against a live omnia-server: exit code 0, the answer the served
checkpoint was built to give, and no 4xx/5xx in the server's access log for their requests.

Their requests are large (5-15k tokens: system prompts and 4-21 tool declarations), so the
server serves tests/fixtures/scripted.py's checkpoint: a 65k context, a fast prefill, and a
fixed answer whatever the prompt. Each CLI runs as a user would run it offline (the settings
the README gives), in a fresh HOME, stdin closed, with the server's API key.

npm and node are needed (Debian: apt-get install nodejs npm; .ci/run installs them): without
them the tests skip, except under CI (CI=true), where they fail. The install (~1 GB, ~30 s) is
kept in ~/.cache/mlx-omnia-tests/npm/<versions> and reused."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from mlx_omnia import Chat, GenerationOptions, load
from tests.fixtures import scripted
from tests.server_harness import server_process

pytestmark = pytest.mark.slow

PACKAGES = {
    "claude": "@anthropic-ai/claude-code@2.1.332",  # npm picks 2.1.197 on node < 22 unpinned
    "codex": "@openai/codex@0.171.0",
    "gemini": "@google/gemini-cli@0.61.0",
}
MODEL = "scripted"
KEY = "sk-omnia-test"
CONTEXT = scripted.CONTEXT
ACCESS = re.compile(r'"(?P<method>[A-Z]+) (?P<path>\S+) HTTP/[\d.]+" (?P<status>\d{3})')


def _under_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def _missing(reason: str) -> None:
    if _under_ci():
        pytest.fail(f"{reason}: the vendor CLI tests need it under CI")
    pytest.skip(reason)


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mlx-omnia-tests" / "npm"


@pytest.fixture(scope="module")
def bins() -> dict[str, Path]:
    """The three CLIs' executables, installed once per set of versions."""
    for tool in ("node", "npm"):
        if shutil.which(tool) is None:
            _missing(f"{tool} is not installed (apt-get install -y nodejs npm)")
    key = hashlib.sha256(" ".join(sorted(PACKAGES.values())).encode()).hexdigest()[:12]
    prefix = _cache_root() / key
    found = {name: prefix / "node_modules" / ".bin" / name for name in PACKAGES}
    if not all(p.exists() for p in found.values()):
        prefix.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f"tmp-{key}-", dir=prefix.parent))
        cmd = ["npm", "install", "--prefix", str(work), "--no-audit", "--no-fund",
               "--loglevel=error", *PACKAGES.values()]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            shutil.rmtree(work, ignore_errors=True)
            _missing(f"npm install {' '.join(PACKAGES.values())} failed: {done.stderr[-2000:]}")
        if not all(p.exists() for p in found.values()):
            shutil.rmtree(prefix, ignore_errors=True)  # a broken earlier install
        try:
            work.rename(prefix)
        except OSError:  # another run installed it meanwhile
            shutil.rmtree(work, ignore_errors=True)
    return found


@dataclass
class Server:
    url: str
    log: Path

    def access_lines(self) -> list[str]:
        return [line for line in self.log.read_text().splitlines() if ACCESS.search(line)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """omnia-server in its own process, as users start it, serving the scripted checkpoint as
    its default model, with an API key and an access log."""
    root = tmp_path_factory.mktemp("vendor")
    checkpoint = scripted.write_scripted(root / MODEL)
    # PYTHONUNBUFFERED: the access log reaches the file as requests are answered.
    env = {"HF_HOME": str(root / "hf"), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    log = root / "server.log"
    with server_process(["--model", str(checkpoint), "--api-key", KEY], log, env) as url:
        yield Server(url, log)


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    requests: list[str]  # the access-log lines of the server during the run


def run_cli(server: Server, argv: list[str], home: Path, env: dict[str, str]) -> Run:
    """Run a CLI in a fresh HOME and work directory, stdin closed, nothing of our environment
    but PATH (node)."""
    work = home / "work"
    work.mkdir(parents=True, exist_ok=True)
    before = len(server.access_lines())
    full = {"PATH": os.environ["PATH"], "HOME": str(home), "TERM": "dumb", **env}
    done = subprocess.run(
        argv, cwd=work, env=full, stdin=subprocess.DEVNULL, capture_output=True, text=True,
        timeout=300,
    )
    return Run(done.returncode, done.stdout, done.stderr, server.access_lines()[before:])


def assert_clean(run: Run, path: str) -> None:
    """The CLI exited 0 and every request it made reached `path`'s dialect and was answered
    below 400."""
    where = f"stdout:\n{run.stdout[-4000:]}\nstderr:\n{run.stderr[-4000:]}\nlog:\n" + "\n".join(
        run.requests
    )
    assert run.returncode == 0, where
    assert run.requests, where
    for line in run.requests:
        match = ACCESS.search(line)
        assert match is not None
        assert match["path"].startswith(path) and int(match["status"]) < 400, where


def test_scripted_checkpoint_answers_its_text_after_a_long_prompt(tmp_path: Path) -> None:
    path = scripted.write_scripted(tmp_path / MODEL)
    sums, recorded = scripted.read_sums()
    if recorded == scripted.versions():  # another tokenizers may write another tokenizer.json
        assert scripted.file_sums(path) == sums, (
            "the scripted checkpoint changed: if on purpose, run python -m tests.fixtures.scripted "
            "--write-sums"
        )
    model = load(path)
    assert model.signature.context_length == CONTEXT
    long = " ".join(f"word{i} and more" for i in range(6000))
    chat = Chat(({"role": "system", "content": "You are a coding agent."},
                 {"role": "user", "content": long}))  # fmt: skip
    done = model.generate(chat, GenerationOptions(max_tokens=64))
    assert done.usage.prompt_tokens > 20000
    assert (done.text, done.finish_reason) == (scripted.ANSWER, "stop")
    sampled = model.generate(chat, GenerationOptions(max_tokens=64, temperature=1.0, seed=3))
    assert sampled.text == scripted.ANSWER  # its logits leave sampling no choice


def test_claude_code_answers(bins: dict[str, Path], server: Server, tmp_path: Path) -> None:
    env = {
        "ANTHROPIC_BASE_URL": f"{server.url}/api/anthropic",
        "ANTHROPIC_API_KEY": KEY,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",  # no telemetry, update or probe calls
        "DISABLE_AUTOUPDATER": "1",
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "4096",
        "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(CONTEXT),
    }
    argv = [str(bins["claude"]), "-p", "Say hi.", "--model", MODEL, "--output-format", "json"]
    run = run_cli(server, argv, tmp_path, env)
    assert_clean(run, "/api/anthropic/v1/messages")
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["is_error"] is False and result["result"] == scripted.ANSWER
    assert result["modelUsage"][MODEL]["contextWindow"] == CONTEXT
    assert result["usage"]["input_tokens"] > 8000  # its system prompt and tools were read


def test_codex_answers(bins: dict[str, Path], server: Server, tmp_path: Path) -> None:
    codex_home = tmp_path / ".codex"
    codex_home.mkdir(parents=True)
    (codex_home / "config.toml").write_text(codex_config(server.url))
    env = {"CODEX_HOME": str(codex_home), "OMNIA_API_KEY": KEY}
    argv = [str(bins["codex"]), "exec", "--skip-git-repo-check", "--ephemeral", "--json", "Say hi."]
    run = run_cli(server, argv, tmp_path, env)
    assert_clean(run, "/api/openai/v1/responses")
    events = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    kinds = [e["type"] for e in events]
    assert "turn.completed" in kinds, run.stdout
    assert "turn.failed" not in kinds and "error" not in kinds, run.stdout
    items = [e["item"] for e in events if e["type"] == "item.completed"]
    assert [i["text"] for i in items if i["type"] == "agent_message"] == [scripted.ANSWER]
    # The only error item is codex's note that it knows nothing of this model's name.
    assert all("Model metadata" in i["message"] for i in items if i["type"] == "error"), items


def codex_config(url: str) -> str:
    """Codex's config.toml for omnia-server, as the README gives it, plus what keeps a test
    offline and quiet (no plugin fetch, no analytics)."""
    return f"""\
model = "{MODEL}"
model_provider = "omnia"
model_context_window = {CONTEXT}
check_for_update_on_startup = false
approval_policy = "never"
sandbox_mode = "read-only"
web_search = "disabled"

[model_providers.omnia]
name = "mlx-omnia"
base_url = "{url}/api/openai/v1"
wire_api = "responses"
env_key = "OMNIA_API_KEY"

[analytics]
enabled = false

[feedback]
enabled = false

[agents]
enabled = false

[features]
plugins = false
remote_plugin = false
apps = false
goals = false
"""


def test_gemini_cli_answers(bins: dict[str, Path], server: Server, tmp_path: Path) -> None:
    settings = {
        "security": {"auth": {"selectedType": "gemini-api-key"}, "folderTrust": {"enabled": False}},
        "privacy": {"usageStatisticsEnabled": False},
        "telemetry": {"enabled": False},
        "general": {"disableAutoUpdate": True, "disableUpdateNag": True},
    }
    (tmp_path / ".gemini").mkdir(parents=True)
    (tmp_path / ".gemini" / "settings.json").write_text(json.dumps(settings))
    env = {"GEMINI_API_KEY": KEY, "GOOGLE_GEMINI_BASE_URL": f"{server.url}/api/gemini"}
    # --yolo declares its shell and file tools too (15 tools): the larger request.
    argv = [str(bins["gemini"]), "-m", MODEL, "-p", "Say hi.", "--output-format", "json", "--yolo"]
    run = run_cli(server, argv, tmp_path, env)
    assert_clean(run, f"/api/gemini/v1beta/models/{MODEL}:streamGenerateContent")
    result = json.loads(run.stdout[run.stdout.index("{") :])
    assert result["response"] == scripted.ANSWER
    stats = result["stats"]["models"][MODEL]
    assert stats["api"]["totalErrors"] == 0 and stats["tokens"]["prompt"] > 8000
