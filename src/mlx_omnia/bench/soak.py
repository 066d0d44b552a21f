"""omnia-bench soak: many streaming clients at once against a live omnia-server, some of which
hang up mid-answer, for minutes. It reports errors, answers that differ from the same request
answered alone (a mixed-up output), the server's memory over time and whether /metrics agrees
with what the clients saw. It speaks HTTP only: the server is started as users start it (or
named with --url).

Every request asks for a greedy answer to one of a few prompts, through one of the three
dialects' streaming routes. Before the soak each (dialect, prompt) is answered alone: that is
the reference every complete answer of the soak must equal."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import re
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import httpx

DIALECTS = ("openai", "anthropic", "gemini")
PROMPTS = (
    "Name three colours.",
    "What is the capital of France?",
    "Count from one to five.",
    "Write a short sentence about the sea.",
    "What is two plus two?",
    "Say hello in Spanish.",
    "Name a fruit that is yellow.",
    "What day comes after Monday?",
)
STREAM_ROUTES = {
    "openai": "/api/openai/v1/chat/completions",
    "anthropic": "/api/anthropic/v1/messages",
    "gemini": "/api/gemini/v1beta/models/{model_id}:streamGenerateContent",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None,
                   help="a running server (RSS is then not measured); default: start omnia-server")
    p.add_argument("--model", default="",
                   help="the model to ask for (default: the server's default, listed first)")
    p.add_argument("--serve", default=None, metavar="MODEL",
                   help="the --model of the omnia-server this starts (default: its own default)")
    p.add_argument("--streams", type=int, default=64, help="concurrent clients")
    p.add_argument("--seconds", type=float, default=600.0, help="how long the soak runs")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--disconnect", type=float, default=0.25,
                   help="the share of requests whose client hangs up mid-answer")
    p.add_argument("--sample", type=float, default=15.0, help="seconds between RSS samples")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="FILE", help="also write the report as JSON")


@dataclass
class Outcome:
    dialect: str
    prompt: int
    status: int
    text: str = ""
    error: str | None = None
    hung_up: bool = False


@dataclass
class Tally:
    outcomes: list[Outcome] = field(default_factory=lambda: list[Outcome]())
    rss: list[tuple[float, int]] = field(default_factory=lambda: list[tuple[float, int]]())


def _request(dialect: str, model: str, prompt: str, max_tokens: int) -> tuple[str, dict[str, Any]]:
    """The route (with the model, for Gemini) and the body of a greedy streamed answer."""
    if dialect == "openai":
        return STREAM_ROUTES[dialect], {
            "model": model, "messages": [{"role": "user", "content": prompt}], "stream": True,
            "max_tokens": max_tokens, "temperature": 0,
        }
    if dialect == "anthropic":
        return STREAM_ROUTES[dialect], {
            "model": model, "messages": [{"role": "user", "content": prompt}], "stream": True,
            "max_tokens": max_tokens, "temperature": 0,
        }
    route = STREAM_ROUTES[dialect].format(model_id=model) + "?alt=sse"
    return route, {
        "contents": [{"role": "user", "parts": [{"text": prompt}]}],
        "generationConfig": {"temperature": 0, "maxOutputTokens": max_tokens},
    }


def _at(value: object, *path: str | int) -> object:
    """value[path[0]][path[1]]..., or None where a step is missing."""
    for key in path:
        if isinstance(key, int):
            items = cast(list[object], value) if isinstance(value, list) else []
            value = items[key] if key < len(items) else None
        else:
            value = cast(dict[str, object], value).get(key) if isinstance(value, dict) else None
    return value


def _piece(dialect: str, event: object) -> tuple[str, str | None]:
    """The text an event adds, and the error it carries if any."""
    error = _at(event, "error")
    if error is not None and (dialect != "anthropic" or _at(event, "type") == "error"):
        return "", json.dumps(error)
    if dialect == "openai":
        text = _at(event, "choices", 0, "delta", "content")
    elif dialect == "anthropic":
        text = _at(event, "delta", "text") if _at(event, "type") == "content_block_delta" else None
    else:
        parts = _at(event, "candidates", 0, "content", "parts")
        found = [_at(p, "text") for p in cast(list[object], parts)] if isinstance(parts, list) else []
        text = "".join(t for t in found if isinstance(t, str))
    return (text if isinstance(text, str) else ""), None


async def ask(
    client: httpx.AsyncClient, dialect: str, model: str, prompt: int, max_tokens: int,
    hang_up_after: int | None = None,
) -> Outcome:
    """One streamed answer; `hang_up_after`: close the connection after that many events."""
    route, body = _request(dialect, model, PROMPTS[prompt], max_tokens)
    out = Outcome(dialect, prompt, 0)
    try:
        async with client.stream("POST", route, json=body) as r:
            out.status = r.status_code
            if r.status_code != 200:
                out.error = (await r.aread()).decode(errors="replace")[:300]
                return out
            events = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                text, error = _piece(dialect, json.loads(line[6:]))
                out.text += text
                if error is not None:
                    out.error = error
                events += 1
                if hang_up_after is not None and events >= hang_up_after:
                    out.hung_up = True
                    return out  # leaving the block closes the connection mid-stream
    except httpx.HTTPError as e:
        out.error = f"{type(e).__name__}: {e}"
    return out


def _rss(pid: int) -> int | None:
    """Resident memory of process `pid` in bytes (Linux /proc, else ps)."""
    status = Path(f"/proc/{pid}/status")
    if status.exists():
        m = re.search(r"VmRSS:\s+(\d+) kB", status.read_text())
        return int(m.group(1)) * 1024 if m else None
    done = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True)
    return int(done.stdout.strip()) * 1024 if done.stdout.strip() else None


@contextlib.contextmanager
def _server(args: argparse.Namespace) -> Generator[tuple[str, int | None]]:
    if args.url:
        yield args.url.rstrip("/"), None
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    cmd = [sys.executable, "-m", "mlx_omnia.server.main", "--port", str(port),
           "--max-queue", str(max(64, 2 * args.streams))]
    if args.serve:
        cmd += ["--model", args.serve]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"omnia-server exited with {proc.returncode}")
            try:
                if httpx.get(f"{url}/admin/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        yield url, proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def _metrics(url: str) -> dict[str, float]:
    """/metrics as {name{labels}: value}."""
    out: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def _sum(metrics: dict[str, float], prefix: str, *having: str) -> float:
    return sum(v for k, v in metrics.items() if k.startswith(prefix) and all(h in k for h in having))


async def _soak(args: argparse.Namespace, url: str, pid: int | None, write: Callable[[str], None]
                ) -> tuple[Tally, dict[tuple[str, int], str]]:
    rng = random.Random(args.seed)
    tally = Tally()
    limits = httpx.Limits(max_connections=args.streams + 8)
    timeout = httpx.Timeout(600.0, connect=30.0)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:
        reference: dict[tuple[str, int], str] = {}
        for dialect in DIALECTS:
            for i in range(len(PROMPTS)):
                alone = await ask(client, dialect, args.model, i, args.max_tokens)
                if alone.status != 200 or alone.error:
                    raise SystemExit(f"{dialect} prompt {i} failed alone: {alone.error}")
                reference[dialect, i] = alone.text
        write(f"[soak] references: {len(reference)} answers alone; {args.streams} clients for "
              f"{args.seconds:.0f} s")
        start = time.monotonic()
        end = start + args.seconds

        async def client_loop(n: int) -> None:
            k = n
            while time.monotonic() < end:
                dialect = DIALECTS[k % len(DIALECTS)]
                k += 1
                cut = rng.randint(1, 4) if rng.random() < args.disconnect else None
                tally.outcomes.append(
                    await ask(client, dialect, args.model, rng.randrange(len(PROMPTS)),
                              args.max_tokens, cut)
                )

        async def sample() -> None:
            while pid is not None and time.monotonic() < end:
                rss = _rss(pid)
                if rss is not None:
                    tally.rss.append((time.monotonic() - start, rss))
                    done = len(tally.outcomes)
                    write(f"[soak] {time.monotonic() - start:6.0f} s  {done:5d} requests  "
                          f"RSS {rss / 2**20:7.1f} MiB")
                await asyncio.sleep(args.sample)

        await asyncio.gather(sample(), *(client_loop(n) for n in range(args.streams)))
    return tally, reference


def run(args: argparse.Namespace, write: Callable[[str], None]) -> int:
    with _server(args) as (url, pid):
        if not args.model:  # the default model, listed first (asked before the metrics' start)
            args.model = httpx.get(f"{url}/api/openai/v1/models", timeout=30).json()["data"][0]["id"]
        before = _metrics(url)
        tally, reference = asyncio.run(_soak(args, url, pid, write))
        # Let the server see every hang-up and finish what it was doing, then read /metrics.
        deadline = time.monotonic() + 120
        after = _metrics(url)
        while time.monotonic() < deadline and (
            _sum(after, "omnia_queue_depth") or _sum(after, "omnia_running_requests")
        ):
            time.sleep(1)
            after = _metrics(url)
        final_rss = _rss(pid) if pid is not None else None
    report = _report(args, tally, reference, before, after, final_rss)
    for line in report["lines"]:
        write(line)
    if args.json:
        Path(args.json).write_text(json.dumps({k: v for k, v in report.items() if k != "lines"},
                                              indent=2))
    return 0 if report["ok"] else 1


def _report(
    args: argparse.Namespace, tally: Tally, reference: dict[tuple[str, int], str],
    before: dict[str, float], after: dict[str, float], final_rss: int | None,
) -> dict[str, Any]:
    outs = tally.outcomes
    complete = [o for o in outs if not o.hung_up and o.status == 200 and o.error is None]
    errors = [o for o in outs if o.error is not None]
    mixed = [o for o in complete if o.text != reference[o.dialect, o.prompt]]
    statuses = Counter(o.status for o in outs)
    by_dialect = Counter(o.dialect for o in outs)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    # Every request the soak sent (and the references) is counted once under its route.
    sent = {d: by_dialect[d] + len(PROMPTS) for d in DIALECTS}
    counted = {d: _sum(delta, "omnia_requests_total", f'dialect="{d}"') for d in DIALECTS}
    finished = _sum(delta, "omnia_generations_total")
    want_finished = len(complete) + len(reference)
    checks = {
        "no errors": not errors,
        "no mixed-up answers": not mixed,
        "requests counted by dialect": counted == {d: float(n) for d, n in sent.items()},
        "finished generations counted": finished >= want_finished,
        "queue empty, nothing running": not _sum(after, "omnia_queue_depth")
        and not _sum(after, "omnia_running_requests"),
    }
    rss = [r for _, r in tally.rss] + ([final_rss] if final_rss else [])
    lines = [
        f"soak: {args.streams} clients, {args.seconds:.0f} s, max_tokens {args.max_tokens}, "
        f"{args.disconnect:.0%} hang up mid-answer",
        f"requests {len(outs)} ({', '.join(f'{d} {by_dialect[d]}' for d in DIALECTS)}); "
        f"complete {len(complete)}, hung up {sum(o.hung_up for o in outs)}, "
        f"statuses {dict(sorted(statuses.items()))}",
        f"errors {len(errors)}; mixed-up answers {len(mixed)} of {len(complete)}",
        f"/metrics: requests by dialect {counted} (sent {sent}); finished generations "
        f"{finished:.0f} (complete answers {want_finished}; hung-up ones may finish too)",
    ]
    if rss:
        lines.append(f"server RSS: first {rss[0] / 2**20:.0f} MiB, max {max(rss) / 2**20:.0f} MiB, "
                     f"last {rss[-1] / 2**20:.0f} MiB ({len(rss)} samples)")
    lines += [f"{'ok  ' if ok else 'FAIL'} {name}" for name, ok in checks.items()]
    lines += [f"  error: {o.dialect} {o.status} {o.error}" for o in errors[:5]]
    lines += [f"  mixed: {o.dialect} prompt {o.prompt}: {o.text!r} (alone: {reference[o.dialect, o.prompt]!r})" for o in mixed[:5]]
    return {
        "ok": all(checks.values()), "checks": checks, "requests": len(outs),
        "complete": len(complete), "errors": len(errors), "mixed": len(mixed),
        "statuses": {str(k): v for k, v in statuses.items()}, "rss": tally.rss,
        "metrics_requests": counted, "sent": sent, "lines": lines,
        "streams": args.streams, "seconds": args.seconds,
    }
