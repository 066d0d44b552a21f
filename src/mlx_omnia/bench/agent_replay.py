"""`omnia-bench agent-replay`: what a prefix cache saves an agent that resends its conversation.
A synthetic chat (a system message, then user and assistant turns of random words of the
checkpoint's vocabulary, sized so the last prompt is about --context tokens) is replayed turn by
turn: each request is the conversation so far plus a new user message, sent as a `Chat` (the
checkpoint's chat template renders it). The assistant turns are the synthetic ones, not the
model's answers, so every arm sends the same prompts. Per turn, time to first token of:

- `uncached`: a `Batch` with no prefix cache (the whole prompt prefilled);
- `cached-memory`: a `Batch` over one memory-only `PrefixCache` that served the earlier turns;
- `cached-disk`: a fresh `PrefixCache` on one directory before every turn (a restart: its memory
  tier is empty), so every hit is read from the files the earlier turns wrote;
- `mlx-lm-server`: `python -m mlx_lm.server` on the same directory, asked over its OpenAI
  /v1/chat/completions route (streamed; its own prompt cache), the time to the first content.

The arms take turns within each turn, the order rotating."""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import httpx
import numpy as np

from mlx_omnia import (
    Batch,
    Chat,
    ChatMessage,
    GenerationOptions,
    Model,
    OmniaError,
    PrefixCache,
    load,
)
from mlx_omnia.bench import common
from mlx_omnia.bench.common import (
    Out,
    checkpoint,
    environment,
    print_environment,
    progress,
    quantize_json,
    quantize_text,
    random_words,
    vocabulary_words,
    write_report,
)
from mlx_omnia.bench.shapes import DTYPES, SHAPES

BAN = -100.0  # OpenAI's logit_bias for "never": no answer ends before its first text
MEMORY_BYTES = DISK_BYTES = 1 << 40  # budgets no replay reaches: nothing is evicted
SERVER = "mlx-lm-server"
ENGINE_ARMS = ("uncached", "cached-memory", "cached-disk")


@dataclass(frozen=True)
class Conversation:
    system: str
    users: list[str]
    assistants: list[str]  # one fewer than users: the last turn's answer is the model's

    def messages(self, turn: int) -> list[ChatMessage]:
        """What turn `turn` (from 1) sends: the system message, the earlier user and assistant
        turns, and the new user message."""
        out: list[ChatMessage] = [{"role": "system", "content": self.system}]
        for i in range(turn):
            out.append({"role": "user", "content": self.users[i]})
            if i < turn - 1:
                out.append({"role": "assistant", "content": self.assistants[i]})
        return out


def conversation(words: Sequence[str], *, turns: int, system: int, message: int,
                 seed: int) -> Conversation:
    """A system message of `system` words, then `turns` user and `turns - 1` assistant messages
    of `message` words each."""
    rng = np.random.default_rng(seed)
    return Conversation(
        random_words(words, system, rng),
        [random_words(words, message, rng) for _ in range(turns)],
        [random_words(words, message, rng) for _ in range(turns - 1)],
    )


def sized(words: Sequence[str], *, turns: int, context: int, seed: int,
          count: Callable[[Conversation], int]) -> Conversation:
    """A conversation whose last prompt is about `context` tokens (`count` renders it): a tenth
    for the system message, the rest shared by the 2 * turns - 1 messages the last prompt holds,
    corrected once for what the template adds."""
    system = max(1, context // 10)
    messages = 2 * turns - 1
    message = max(1, (context - system) // messages)
    first = conversation(words, turns=turns, system=system, message=message, seed=seed)
    over = count(first) - context
    message = max(1, message - -(-over // messages))  # rounded up: at most `context`, or near
    return conversation(words, turns=turns, system=system, message=message, seed=seed)


@dataclass
class Turn:
    """One request: its time to first text and to its end, and its token counts."""

    first_s: float
    total_s: float
    prompt_tokens: int
    cached_tokens: int
    tokens: int
    finish: str
    token_ids: list[int] = field(default_factory=list[int])
    cache: dict[str, int] | None = None  # the disk arm: its fresh cache's blocks at start, hits

    def to_json(self) -> dict[str, Any]:
        return {"first_s": self.first_s, "total_s": self.total_s,
                "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "new_tokens": self.prompt_tokens - self.cached_tokens, "tokens": self.tokens,
                "finish": self.finish, "token_ids": self.token_ids, "cache": self.cache}


def ask(batch: Batch, chat: Chat, options: GenerationOptions) -> Turn:
    """One request through `batch` (alone in it), timed from `add` (template, tokens, the prefix
    cache's lookup) to the step that hands out its first text, and to its last token."""
    start = time.perf_counter()
    batch.add(chat, options)
    first: float | None = None
    ids: list[int] = []
    finish, prompt_tokens, cached = "?", 0, 0
    while len(batch):
        for _, event in batch.step():
            now = time.perf_counter() - start
            if isinstance(event, Exception):
                raise event
            for piece in event:
                ids.extend(piece.token_ids)
                if first is None and piece.text:
                    first = now
                if piece.finish_reason is not None:
                    finish = piece.finish_reason
                    if piece.usage is not None:
                        prompt_tokens, cached = piece.usage.prompt_tokens, piece.usage.cached_tokens
    total = time.perf_counter() - start
    return Turn(total if first is None else first, total, prompt_tokens, cached, len(ids),
                finish, ids)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerUnavailable(Exception):
    """mlx_lm.server did not come up: the arm is skipped, the report says why."""


@contextlib.contextmanager
def mlx_lm_server(path: Path, log: Path, timeout: float) -> Generator[str]:
    """`python -m mlx_lm.server` on `path` at a free port, until it answers /health."""
    port = free_port()
    cmd = [sys.executable, "-m", "mlx_lm.server", "--model", str(path), "--port", str(port),
           "--host", "127.0.0.1"]
    url = f"http://127.0.0.1:{port}"
    with log.open("wb") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + timeout
            while True:
                if proc.poll() is not None:
                    tail = log.read_text(errors="replace")[-600:]
                    raise ServerUnavailable(f"mlx_lm.server exited with {proc.returncode}: {tail}")
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise ServerUnavailable(f"mlx_lm.server did not answer /health within "
                                            f"{timeout:g} s")
                time.sleep(0.2)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def ask_server(client: httpx.Client, messages: list[ChatMessage], answer: int,
               ban: dict[int, float]) -> Turn:
    """One streamed chat completion, timed from sending it to the first chunk with content,
    and to the end of the stream; token counts from its usage chunk."""
    body = {"model": "default_model", "messages": messages, "max_tokens": answer,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
            "logit_bias": {str(k): v for k, v in ban.items()}}
    start = time.perf_counter()
    first: float | None = None
    finish, usage = "?", cast(dict[str, Any], {})
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            raise ServerUnavailable(f"mlx_lm.server answered {response.status_code}: "
                                    f"{response.text[:300]}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = cast(dict[str, Any], json.loads(line[6:]))
            for choice in cast(list[dict[str, Any]], chunk.get("choices") or []):
                delta = cast(dict[str, Any], choice.get("delta") or {})
                if first is None and delta.get("content"):
                    first = time.perf_counter() - start
                finish = str(choice.get("finish_reason") or finish)
            usage = cast(dict[str, Any], chunk.get("usage") or usage)
    total = time.perf_counter() - start
    details = cast(dict[str, Any], usage.get("prompt_tokens_details") or {})
    return Turn(total if first is None else first, total, int(usage.get("prompt_tokens", 0)),
                int(details.get("cached_tokens", 0)), int(usage.get("completion_tokens", 0)),
                finish)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help=f"a checkpoint directory with a chat template, or a shape to build with "
                        f"random weights: {', '.join(SHAPES)}")
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    p.add_argument("--quantize", type=int, choices=[2, 3, 4, 5, 6, 8], default=None,
                   help="with a named shape: write the checkpoint affine-quantized (bits), which "
                        "every arm, mlx_lm.server included, loads as it is")
    p.add_argument("--group-size", type=int, choices=[32, 64, 128], default=64)
    common.add_layers_argument(p)
    p.add_argument("--turns", type=int, default=20)
    p.add_argument("--context", type=int, default=16384,
                   help="about the last turn's prompt tokens")
    p.add_argument("--answer", type=int, default=32, help="tokens each answer generates")
    p.add_argument("--block-tokens", type=int, default=256,
                   help="the prefix cache's block (PrefixCache's default)")
    p.add_argument("--against", choices=[SERVER, "none"], default=SERVER)
    p.add_argument("--server-timeout", type=float, default=300.0,
                   help="seconds mlx_lm.server may take to answer /health, else its arm is "
                        "skipped with a note")
    p.add_argument("--seed", type=int, default=0, help="for the random weights and words")
    p.add_argument("--json", default=None, metavar="OUT", help="write the details here")
    p.add_argument("--results", default=None, metavar="DIR",
                   help="also write the JSON under DIR with a name from its date, revision, "
                        "device and model")
    p.add_argument("--workdir", default=None,
                   help="where the random checkpoint and the disk arm's cache directory go")


def expected_cached(prompt: Sequence[int], earlier: Sequence[Sequence[int]], block: int) -> int:
    """The prompt tokens a prefix cache holding `earlier` sequences' whole blocks serves: the
    longest common prefix, in whole blocks, leaving the prompt's last token to prefill."""
    best = 0
    for seq in earlier:
        n = 0
        for a, b in zip(prompt[:-1], seq, strict=False):
            if a != b:
                break
            n += 1
        best = max(best, n)
    return best // block * block


@dataclass
class Arm:
    name: str
    run: Callable[[list[ChatMessage]], Turn]


def engine_arms(model: Model, options: GenerationOptions, block: int, disk_dir: Path) -> list[Arm]:
    """The engine's three arms, each with caches of its own (the disk arm's under `disk_dir`)."""
    memory = PrefixCache(block_tokens=block, memory_bytes=MEMORY_BYTES)

    def uncached(messages: list[ChatMessage]) -> Turn:
        return ask(Batch(model), Chat(tuple(messages)), options)

    def cached_memory(messages: list[ChatMessage]) -> Turn:
        return ask(Batch(model, memory), Chat(tuple(messages)), options)

    def cached_disk(messages: list[ChatMessage]) -> Turn:
        # A restart before every turn: a new cache object on the directory, its memory empty.
        cache = PrefixCache(block_tokens=block, memory_bytes=MEMORY_BYTES, disk_dir=disk_dir,
                            disk_bytes=DISK_BYTES)
        held = cache.stats()
        try:
            turn = ask(Batch(model, cache), Chat(tuple(messages)), options)
        finally:
            cache.close()  # this turn's blocks on disk before the next restart
        turn.cache = {"memory_blocks": held.memory_blocks, "disk_blocks": held.disk_blocks,
                      "hits": cache.stats().hits}
        return turn

    return [Arm("uncached", uncached), Arm("cached-memory", cached_memory),
            Arm("cached-disk", cached_disk)]


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None or seconds != seconds else f"{seconds * 1e3:,.1f}"


def agent_replay(args: argparse.Namespace, out: Out) -> dict[str, Any]:
    """Replay a synthetic conversation turn by turn through every arm; time each first token."""
    if args.turns < 1 or args.context < 1 or args.answer < 1 or args.block_tokens < 1:
        raise SystemExit("--turns, --context, --answer and --block-tokens must be at least 1")
    on_disk = None if args.quantize is None else (int(args.quantize), int(args.group_size))
    if on_disk is not None and Path(args.model).is_dir():
        raise SystemExit("agent-replay loads a checkpoint directory as it is (mlx_lm.server "
                         "cannot quantize at load): leave out --quantize")
    env = environment()
    notes: list[str] = []
    with contextlib.ExitStack() as stack:
        path = stack.enter_context(checkpoint(args.model, dtype=args.dtype, seed=args.seed,
                                              workdir=args.workdir, quantize=on_disk,
                                              layers=args.layers))
        scratch = Path(stack.enter_context(
            tempfile.TemporaryDirectory(prefix="omnia-replay-", dir=args.workdir)))
        progress("loading omnia")
        model = load(str(path), dtype=args.dtype)
        limit = model.signature.context_length
        words = vocabulary_words(path)

        def render(talk: Conversation, turn: int) -> list[int]:
            try:
                return model.encode(Chat(tuple(talk.messages(turn))))
            except OmniaError as e:
                raise SystemExit(f"agent-replay sends a Chat through the checkpoint's chat "
                                 f"template: {e}") from e

        talk = sized(words, turns=args.turns, context=args.context, seed=args.seed,
                     count=lambda c: len(render(c, args.turns)))
        # another conversation of the same sizes, for the warm-up
        warm = sized(words, turns=args.turns, context=args.context, seed=args.seed + 1,
                     count=lambda c: len(render(c, args.turns)))
        prompts = [render(talk, t) for t in range(1, args.turns + 1)]
        if len(prompts[-1]) + args.answer > limit:
            raise SystemExit(f"the last turn's {len(prompts[-1])} prompt tokens and the "
                             f"{args.answer}-token answer exceed the model's context ({limit} "
                             "tokens): lower --context")
        ban = dict.fromkeys(sorted(model.tokenizer.eos_token_ids), BAN)
        options = GenerationOptions(max_tokens=args.answer, temperature=0.0, logit_bias=ban)

        server: list[Arm] = []
        skipped: dict[str, str] = {}
        if args.against == SERVER:
            if env["mlx_lm"] is None:
                skipped[SERVER] = "mlx_lm is not importable (pip install mlx-lm==0.32.2)"
            else:
                progress("starting mlx_lm.server")
                try:
                    url = stack.enter_context(
                        mlx_lm_server(path, scratch / "mlx_lm_server.log", args.server_timeout))
                    client = stack.enter_context(
                        httpx.Client(base_url=url, timeout=httpx.Timeout(600.0, connect=30.0)))
                    server.append(Arm(SERVER, lambda m: ask_server(client, m, args.answer, ban)))
                except ServerUnavailable as e:
                    skipped[SERVER] = str(e)
        for name, why in skipped.items():
            notes.append(f"{name} arm skipped: {why}")
            progress(notes[-1])

        # Warm-up: two turns of another conversation through every arm, untimed, the engine
        # arms with caches of their own (the server's cache keeps them: they share no block
        # with the replay's, whose system message differs).
        for arm in [*engine_arms(model, options, args.block_tokens, scratch / "warm"), *server]:
            progress(f"warming up {arm.name}")
            for t in (1, 2):
                arm.run(warm.messages(t))
        arms = [*engine_arms(model, options, args.block_tokens, scratch / "prefix"), *server]

        turns: dict[str, list[Turn]] = {a.name: [] for a in arms}
        orders: list[list[str]] = []
        for t in range(1, args.turns + 1):
            order = arms[t % len(arms):] + arms[: t % len(arms)]
            orders.append([a.name for a in order])
            for arm in order:
                progress(f"turn {t}/{args.turns} ({len(prompts[t - 1])} tokens): {arm.name}")
                turns[arm.name].append(arm.run(talk.messages(t)))
        config = json.loads((path / "config.json").read_text())

    report = _report(args, env, config, path, on_disk, prompts, turns, skipped, notes, orders)
    _print(report, out)
    write_report(report, args)
    return report


def _checks(prompts: Sequence[Sequence[int]], turns: dict[str, list[Turn]],
            block: int) -> dict[str, Any]:
    """What every figure stands on (untimed): each engine arm sent the prompt the template
    renders; the uncached arm was served no cached token; each cached arm exactly the whole
    blocks its earlier turns left (their prompts and answers); the answers of the engine arms."""
    problems: list[str] = []
    for name in ENGINE_ARMS:
        for t, turn in enumerate(turns[name]):
            if turn.prompt_tokens != len(prompts[t]):
                problems.append(f"{name} turn {t + 1}: {turn.prompt_tokens} prompt tokens, "
                                f"the template renders {len(prompts[t])}")
            earlier = [[*prompts[s], *turns[name][s].token_ids] for s in range(t)]
            want = 0 if name == "uncached" else expected_cached(prompts[t], earlier, block)
            if turn.cached_tokens != want:
                problems.append(f"{name} turn {t + 1}: {turn.cached_tokens} cached tokens, "
                                f"expected {want}")
            if turn.tokens < 1:
                problems.append(f"{name} turn {t + 1}: no token generated")
            if name == "cached-disk" and turn.cache is not None and turn.cache["memory_blocks"]:
                problems.append(f"cached-disk turn {t + 1}: the fresh cache held "
                                f"{turn.cache['memory_blocks']} blocks in memory")
    same = [len({tuple(turns[n][t].token_ids) for n in ENGINE_ARMS}) == 1
            for t in range(len(prompts))]
    server = turns.get(SERVER, [])
    return {
        "passed": not problems,
        "problems": problems,
        # greedy answers of the engine arms, token for token (a cached prefix may round
        # differently from a full prefill, so a near-tie may flip: reported, not required)
        "engine_answers_equal": sum(same),
        "server_prompt_tokens_equal": (
            sum(s.prompt_tokens == len(p) for s, p in zip(server, prompts, strict=True))
            if server else None
        ),
    }


def _report(
    args: argparse.Namespace, env: dict[str, Any], config: dict[str, Any], path: Path,
    on_disk: tuple[int, int] | None, prompts: Sequence[Sequence[int]],
    turns: dict[str, list[Turn]], skipped: dict[str, str], notes: list[str],
    orders: list[list[str]],
) -> dict[str, Any]:
    last = len(prompts) - 1
    firsts = {name: done[last].first_s for name, done in turns.items()}
    ratios = {
        "uncached/cached-memory": firsts["uncached"] / firsts["cached-memory"],
        "uncached/cached-disk": firsts["uncached"] / firsts["cached-disk"],
    }
    if SERVER in firsts:
        ratios[f"{SERVER}/cached-memory"] = firsts[SERVER] / firsts["cached-memory"]
    rows = [
        {"turn": t + 1, "prompt_tokens": len(prompts[t]),
         "added_tokens": len(prompts[t]) - (len(prompts[t - 1]) if t else 0),
         **{name: {"first_s": done[t].first_s, "cached_tokens": done[t].cached_tokens}
            for name, done in turns.items()}}
        for t in range(len(prompts))
    ]
    source = common.model_source(args.model, path, args.layers)
    return {
        **common.report_head("agent-replay", env, source, args.model, config),
        "options": {
            "dtype": args.dtype,
            "like_for_like": True,  # one checkpoint, one format, the same prompts
            "quantize": quantize_json(None, on_disk),
            "layers": common.layers_json(args.model, args.layers),
            "prompt": args.context,
            "generate": args.answer,
            "turns": args.turns,
            "context": args.context,
            "answer": args.answer,
            "block_tokens": args.block_tokens,
            "seed": args.seed,
            "input": "Chat (the checkpoint's chat template); synthetic assistant turns",
            "sampling": {"temperature": 0.0, "end_tokens_banned": BAN},
        },
        "notes": notes,
        "skipped": skipped,
        "run_orders": orders,
        "checks": _checks(prompts, turns, args.block_tokens),
        "last_turn": {"turn": last + 1, "prompt_tokens": len(prompts[last]),
                      "first_s": firsts, "ratios": ratios},
        "arms": {name: {"turns": [x.to_json() for x in done]} for name, done in turns.items()},
        "table": rows,
    }


def _print(report: dict[str, Any], out: Out) -> None:
    options, checks = report["options"], report["checks"]
    names = list(report["arms"])
    print_environment(report["environment"], out)
    out(f"model: {report['model']['source']}  dtype {options['dtype']}  quantize "
        f"{quantize_text(None, _on_disk(options))}  turns {options['turns']}  context "
        f"~{options['context']}  answer {options['answer']}  block {options['block_tokens']}")
    out("each turn sends the conversation so far and a new user message as a Chat (the chat "
        "template; the assistant turns are the synthetic ones), greedy, end tokens banned. "
        "first token ms = from the request (engine arms: Batch.add, its template, tokens and "
        "cache lookup) to its first text; (n) = prompt tokens served by the arm's cache. "
        "cached-disk: a new PrefixCache on the directory before each turn, memory empty. "
        f"{SERVER}: over HTTP on loopback, its own prompt cache")
    for note in report["notes"]:
        out(note)
    for problem in checks["problems"]:
        out(f"CHECK FAILED: {problem}")
    out(f"engine arms' greedy answers equal on {checks['engine_answers_equal']} of "
        f"{len(report['table'])} turns"
        + ("" if checks["server_prompt_tokens_equal"] is None else
           f"; {SERVER} counted the same prompt tokens on {checks['server_prompt_tokens_equal']}"))
    out("")
    head = ["turn", "prompt", "added", *(f"{n} ms (cached)" for n in names)]
    body = [
        [str(r["turn"]), str(r["prompt_tokens"]), str(r["added_tokens"]),
         *(f"{_ms(r[n]['first_s'])} ({r[n]['cached_tokens']})" for n in names)]
        for r in report["table"]
    ]
    widths = [max(len(line[i]) for line in (head, *body)) for i in range(len(head))]
    for line in (head, ["-" * w for w in widths], *body):
        out("  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)))
    last = report["last_turn"]
    out("")
    out(f"last turn ({last['prompt_tokens']} prompt tokens): " + "; ".join(
        f"{k} {v:.2f}x" for k, v in last["ratios"].items()))


def _on_disk(options: dict[str, Any]) -> tuple[int, int] | None:
    q = options.get("quantize")
    return None if q is None else (int(q["bits"]), int(q["group_size"]))
