"""The prefix cache as clients see it, through the official SDKs on a real server running the
real SmolLM2-135M-Instruct: a conversation resent with a new turn reports the prompt tokens
read from the cache in each dialect's own usage field and answers exactly as a server without
the cache does; the disk tier outlives a restart; /metrics, /admin/status and `omnia status`
show the cache. Blocks of 64 tokens keep the prompts short."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from google.genai import types

from mlx_omnia.server.settings import Settings
from tests.server_harness import (
    LiveServer,
    anthropic_client,
    gemini_client,
    live_server,
    openai_client,
)

MODEL = "smollm2-135m-instruct"
BLOCK = 64
MAX_TOKENS = 8
# About 200 tokens of system prompt: the first turn's prompt spans three whole blocks.
RULES = " ".join(f"Rule {i}: answer in plain words and keep to the facts." for i in range(1, 17))
FIRST = "What is the capital of France?"
SECOND = "And what is the capital of Italy?"


def system(name: str) -> str:
    """A system prompt of its own per test (its first block differs), so no test reads blocks
    another one stored."""
    return f"You are the {name} helper. {RULES}"


@dataclass(frozen=True)
class Turn:
    """An answer and its usage in engine terms: all prompt tokens, those read from the cache."""

    text: str
    prompt: int
    cached: int


@pytest.fixture(scope="module")
def prefix_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("prefix")


def cached_settings(prefix_dir: Path) -> Settings:
    return Settings(prefix_block=BLOCK, prefix_dir=prefix_dir)


@pytest.fixture(scope="module")
def server(prefix_dir: Path) -> Iterator[LiveServer]:
    with live_server(cached_settings(prefix_dir)) as s:
        yield s


@pytest.fixture(scope="module")
def plain() -> Iterator[LiveServer]:
    """The same model with the prefix cache off: every prompt prefilled whole."""
    with live_server(Settings(prefix_memory=0, prefix_disk=0)) as s:
        yield s


def assert_cached(turn: Turn, at_least: int) -> None:
    """`turn` read whole blocks from the cache, at least `at_least` tokens, never its whole
    prompt (the last prompt token is always prefilled: its logits give the first token)."""
    assert turn.cached % BLOCK == 0
    assert at_least // BLOCK * BLOCK <= turn.cached < turn.prompt
    assert turn.cached > 0


# -- OpenAI ----------------------------------------------------------------------------------------
def chat(server: LiveServer, messages: list[dict[str, str]], n: int = 1) -> Turn:
    r = openai_client(server).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0, n=n,  # type: ignore[arg-type]
    )
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    texts = {c.message.content or "" for c in r.choices}
    assert len(r.choices) == n and len(texts) == 1  # greedy: every choice the same
    cached = r.usage.prompt_tokens_details.cached_tokens
    assert cached is not None
    return Turn(texts.pop(), r.usage.prompt_tokens, cached)


def ending_near_a_block(server: LiveServer, name: str, room: int) -> str:
    """A system prompt after which the first turn's prompt (with FIRST) leaves `room` tokens
    of its last block (counted by the server's own tokenizer)."""
    text = system(name)
    for _ in range(BLOCK):  # " ok" is one more token each time
        body = {"model": MODEL, "system": text, "messages": [{"role": "user", "content": FIRST}]}
        r = httpx.post(f"{server.url}/api/anthropic/v1/messages/count_tokens", json=body,
                       timeout=60)
        if r.json()["input_tokens"] % BLOCK == BLOCK - room:
            return text
        text += " ok"
    raise AssertionError(f"no padding leaves {room} tokens of a block")


def test_chat_resent_conversation_reads_the_cache_and_answers_as_uncached(
    server: LiveServer, plain: LiveServer
) -> None:
    """An agent resends its conversation: the blocks of the first prompt and those its answer
    completed are read back; the answer is the one an uncached prompt gives."""
    text = ending_near_a_block(server, "chat", room=4)  # the answer completes that block
    messages = [{"role": "system", "content": text}, {"role": "user", "content": FIRST}]
    first = chat(server, messages)
    assert first.cached == 0 and first.prompt > 3 * BLOCK and first.prompt % BLOCK == BLOCK - 4
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": SECOND}]
    second = chat(server, messages, n=2)  # n choices: the prompt's tokens counted once
    assert_cached(second, first.prompt)
    assert second.cached == (first.prompt // BLOCK + 1) * BLOCK  # the answer's block too
    want = chat(plain, messages)
    assert want.cached == 0 and want.prompt == second.prompt
    assert second.text == want.text


def test_completions_resent_prompt_reads_the_cache_and_answers_as_uncached(
    server: LiveServer, plain: LiveServer
) -> None:
    def complete(s: LiveServer, prompt: str, stream: bool) -> Turn:
        client = openai_client(s)
        args: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                "temperature": 0}
        if not stream:
            r = client.completions.create(**args)
            assert r.usage is not None and r.usage.prompt_tokens_details is not None
            cached = r.usage.prompt_tokens_details.cached_tokens
            assert cached is not None
            return Turn(r.choices[0].text, r.usage.prompt_tokens, cached)
        chunks = list(client.completions.create(
            **args, stream=True, stream_options={"include_usage": True}
        ))
        usage = chunks[-1].usage
        assert usage is not None and usage.prompt_tokens_details is not None
        cached = usage.prompt_tokens_details.cached_tokens
        assert cached is not None
        return Turn("".join(c.choices[0].text for c in chunks if c.choices), usage.prompt_tokens,
                    cached)

    prompt = f"{system('completions')}\nQuestion: {FIRST}\nAnswer:"
    first = complete(server, prompt, stream=False)
    assert first.cached == 0
    prompt += f"{first.text}\nQuestion: {SECOND}\nAnswer:"
    second = complete(server, prompt, stream=True)
    # A raw prompt's last tokens may merge with the text appended after them: one block less.
    assert_cached(second, first.prompt - BLOCK)
    want = complete(plain, prompt, stream=True)
    assert want.cached == 0 and second.text == want.text


def test_responses_resent_conversation_reads_the_cache_and_answers_as_uncached(
    server: LiveServer, plain: LiveServer
) -> None:
    def respond(s: LiveServer, input: list[dict[str, str]]) -> Turn:
        r = openai_client(s).responses.create(
            model=MODEL, instructions=system("responses"), input=input,  # type: ignore[arg-type]
            max_output_tokens=MAX_TOKENS, temperature=0, store=False,
        )
        assert r.usage is not None
        assert r.usage.input_tokens_details.cache_write_tokens == 0
        return Turn(r.output_text, r.usage.input_tokens, r.usage.input_tokens_details.cached_tokens)

    input = [{"role": "user", "content": FIRST}]
    first = respond(server, input)
    assert first.cached == 0
    input += [{"role": "assistant", "content": first.text}, {"role": "user", "content": SECOND}]
    second = respond(server, input)
    assert_cached(second, first.prompt)
    want = respond(plain, input)
    assert want.cached == 0 and second.text == want.text


# -- Anthropic -------------------------------------------------------------------------------------
def test_anthropic_input_tokens_exclude_the_cache_read_ones(
    server: LiveServer, plain: LiveServer
) -> None:
    """Anthropic's input_tokens are the prompt tokens not read from the cache: input_tokens +
    cache_read_input_tokens is the whole prompt, as count_tokens counts it. A stream says so
    from message_start on."""
    client = anthropic_client(server)
    messages: list[Any] = [{"role": "user", "content": FIRST}]
    args: dict[str, Any] = {"model": MODEL, "system": system("anthropic"),
                            "max_tokens": MAX_TOKENS, "extra_body": {"temperature": 0}}

    def whole(count: int, usage: Any) -> Turn:
        assert usage.cache_creation_input_tokens == 0
        assert usage.input_tokens + usage.cache_read_input_tokens == count
        return Turn("", count, usage.cache_read_input_tokens)

    def counted() -> int:
        return client.messages.count_tokens(
            model=MODEL, system=args["system"], messages=messages
        ).input_tokens

    first = client.messages.create(**args, messages=messages)
    prompt = counted()
    assert whole(prompt, first.usage).cached == 0
    assert first.content[0].type == "text"
    messages += [{"role": "assistant", "content": first.content[0].text},
                 {"role": "user", "content": SECOND}]
    prompt2 = counted()  # count_tokens counts the whole prompt, cached or not

    with client.messages.stream(**args, messages=messages) as stream:
        starts = [e.message.usage for e in stream if e.type == "message_start"]
        final = stream.get_final_message()
    assert len(starts) == 1
    streamed = whole(prompt2, final.usage)
    assert_cached(streamed, prompt)
    assert whole(prompt2, starts[0]) == streamed  # message_start already knew the cached count

    again = client.messages.create(**args, messages=messages)  # the same prompt once more
    assert whole(prompt2, again.usage).cached >= streamed.cached

    want = anthropic_client(plain).messages.create(**args, messages=messages)
    assert whole(prompt2, want.usage).cached == 0
    assert want.content[0].type == final.content[0].type == again.content[0].type == "text"
    assert final.content[0].text == again.content[0].text == want.content[0].text


# -- Gemini ----------------------------------------------------------------------------------------
def test_gemini_cached_content_token_count_is_part_of_the_prompt(
    server: LiveServer, plain: LiveServer
) -> None:
    config = types.GenerateContentConfig(
        system_instruction=system("gemini"), temperature=0, max_output_tokens=MAX_TOKENS
    )

    def generate(s: LiveServer, contents: list[types.Content]) -> Turn:
        client = gemini_client(s)  # held: the SDK closes its connection when the client goes
        r = client.models.generate_content(model=MODEL, contents=contents, config=config)
        usage = r.usage_metadata
        assert usage is not None and usage.prompt_token_count is not None
        cached = usage.cached_content_token_count
        if cached is None:
            assert usage.cache_tokens_details is None  # no cache hit: neither field
        else:
            assert usage.cache_tokens_details == [
                types.ModalityTokenCount(modality=types.MediaModality.TEXT, token_count=cached)
            ]
        return Turn(r.text or "", usage.prompt_token_count, cached or 0)

    def said(role: str, text: str) -> types.Content:
        return types.Content(role=role, parts=[types.Part(text=text)])

    contents = [said("user", FIRST)]
    first = generate(server, contents)
    assert first.cached == 0
    contents += [said("model", first.text), said("user", SECOND)]
    second = generate(server, contents)
    assert_cached(second, first.prompt)
    want = generate(plain, contents)
    assert want.cached == 0 and second.text == want.text


# -- the disk tier, metrics, status ----------------------------------------------------------------
def test_a_restarted_server_reads_the_blocks_from_disk(
    server: LiveServer, prefix_dir: Path
) -> None:
    messages = [{"role": "system", "content": system("restart")}, {"role": "user", "content": FIRST}]
    first = chat(server, messages)
    server.state.scheduler.prefix_cache.flush()  # the blocks' files are written
    with live_server(cached_settings(prefix_dir)) as again:
        before = httpx.get(f"{again.url}/admin/status").json()["prefix_cache"]
        assert before["memory_blocks"] == 0 and before["disk_blocks"] > 0
        resent = chat(again, messages)
        after = httpx.get(f"{again.url}/admin/status").json()["prefix_cache"]
    # The same prompt: every whole block before its last token, read from disk.
    assert_cached(resent, first.prompt - 1)
    assert resent.text == first.text
    assert after["hits"] == resent.cached // BLOCK and after["memory_blocks"] > 0


def metric(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample in Prometheus text (None when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        sample, _, rest = key.partition("{")
        if sample == name and ",".join(sorted(rest.rstrip("}").split(","))) == (want or ""):
            return float(value)
    return None


def test_metrics_status_and_cli_show_the_prefix_cache(
    server: LiveServer, plain: LiveServer
) -> None:
    def cached_total() -> float | None:
        text = httpx.get(f"{server.url}/metrics").text
        return metric(text, "omnia_prompt_tokens_cached_total", model=MODEL)

    messages = [{"role": "system", "content": system("metrics")}, {"role": "user", "content": FIRST}]
    chat(server, messages)
    before = cached_total()
    assert before is not None
    resent = chat(server, messages)
    assert cached_total() == before + resent.cached > before

    server.state.scheduler.prefix_cache.flush()
    text = httpx.get(f"{server.url}/metrics").text
    status = httpx.get(f"{server.url}/admin/status").json()["prefix_cache"]
    assert status["block_tokens"] == BLOCK and status["hits"] >= resent.cached // BLOCK
    for tier in ("memory", "disk"):
        assert metric(text, "omnia_prefix_cache_blocks", tier=tier) == status[f"{tier}_blocks"] > 0
        assert metric(text, "omnia_prefix_cache_bytes", tier=tier) == status[f"{tier}_bytes"] > 0
        assert metric(text, "omnia_prefix_cache_evictions_total", tier=tier) == 0
    for name in ("hits", "misses", "stored", "dropped_corrupt", "disk_errors"):
        assert metric(text, f"omnia_prefix_cache_{name}_total") == status[name]
    assert metric(text, "omnia_prefix_cache_pending_writes") == status["pending_writes"] == 0

    off = httpx.get(f"{plain.url}/metrics").text
    assert "omnia_prefix_cache_bytes" not in off
    assert httpx.get(f"{plain.url}/admin/status").json()["prefix_cache"] is None

    assert re.search(
        r"prefix cache:\s+\d+ blocks \([\d.]+ \w+ of [\d.]+ \w+\) in memory, \d+ blocks "
        r"\([\d.]+ \w+ of 8\.6 GB\) on disk; \d+ blocks found, \d+ missed \(blocks of 64 tokens\)",
        omnia_status(server),
    )
    assert re.search(r"prefix cache:\s+off\n", omnia_status(plain))


def omnia_status(server: LiveServer) -> str:
    """What `omnia status` prints for `server`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNIA_")}
    return subprocess.run(
        [sys.executable, "-m", "mlx_omnia.cli.main", "status", "--url", server.url],
        capture_output=True, text=True, env=env, timeout=60, check=True,
    ).stdout
