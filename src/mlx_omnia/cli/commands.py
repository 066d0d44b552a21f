"""The one-shot commands: run, models (list/rm/load/unload), pull, status, stop."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from dataclasses import dataclass
from typing import Any, TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from mlx_omnia.cli import daemon, fmt
from mlx_omnia.cli.client import (
    EXIT_ERROR,
    EXIT_OK,
    EXIT_UNREACHABLE,
    Answer,
    Client,
    JsonObject,
    ServerError,
    UsageError,
    as_list,
    as_object,
    model_path,
)
from mlx_omnia.install import install_stamp, installed_version


@dataclass
class Context:
    url: str
    api_key: str | None
    client: Client
    err: Console  # everything but a command's result goes to stderr

    def note(self, message: str) -> None:
        self.err.print(message, style="dim", highlight=False, markup=False)

    def ensure_server(self) -> None:
        daemon.ensure_server(self.client, self.api_key, self.note)


def chat_body(
    model: str,
    messages: list[JsonObject],
    *,
    max_tokens: int | None,
    temperature: float | None,
    seed: int | None,
) -> JsonObject:
    body: JsonObject = {"model": model, "messages": messages}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if temperature is not None:
        body["temperature"] = float(temperature)
    if seed is not None:
        body["seed"] = seed
    return body


# -- run -------------------------------------------------------------------------------------------


def read_prompt(prompt: str | None, stdin: TextIO) -> str:
    """The prompt argument, stdin when it is not a terminal, or both as "PROMPT\\n\\nSTDIN"
    (stdin without its trailing whitespace: `echo hi | omnia run` asks "hi")."""
    piped = "" if stdin.isatty() else stdin.read().rstrip()
    if prompt is not None and piped.strip():
        text = f"{prompt}\n\n{piped}"
    elif prompt is not None:
        text = prompt
    else:
        text = piped
    if not text.strip():
        raise UsageError('give a prompt (omnia run "...") or pipe text on stdin')
    return text


def run(ctx: Context, args: Any) -> int:
    prompt = read_prompt(args.prompt, sys.stdin)
    ctx.ensure_server()
    model = args.model or ctx.client.default_model()
    messages: list[JsonObject] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    messages.append({"role": "user", "content": prompt})
    body = chat_body(
        model, messages, max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed
    )
    answer = Answer()
    out = sys.stdout
    try:
        with contextlib.closing(ctx.client.chat(body, answer)) as pieces:
            for text in pieces:
                out.write(text)
                out.flush()
    finally:  # the answer's last line ends, whatever stopped it (Ctrl-C notes "interrupted")
        if answer.text and not answer.text.endswith("\n"):
            out.write("\n")
            out.flush()
    if answer.finish_reason == "length":
        ctx.note("(the answer reached --max-tokens)")
    return EXIT_OK


# -- models ----------------------------------------------------------------------------------------


def models_list(ctx: Context, args: Any) -> int:
    ctx.ensure_server()
    listing = ctx.client.get("/admin/models")
    if getattr(args, "json", False):
        print(json.dumps(listing, indent=2))
        return EXIT_OK
    table = Table(box=None, pad_edge=False, header_style="bold")
    table.add_column("ID")
    table.add_column("SOURCE")
    table.add_column("ON DISK", justify="right")
    table.add_column("RESIDENT")
    table.add_column("MEMORY", justify="right")
    table.add_column("DEFAULT")
    for item in as_list(listing.get("models")):
        m = as_object(item)
        resident = bool(m.get("resident"))
        memory = (
            fmt.size(m.get("resident_bytes"))
            if resident
            else (f"~{fmt.size(m['estimated_bytes'])}" if m.get("estimated_bytes") else "-")
        )
        table.add_row(
            str(m.get("id")),
            str(m.get("source") or "-"),
            fmt.size(m.get("size_on_disk")),
            "yes" if resident else "no",
            memory,
            "*" if m.get("default") else "",
        )
    console = Console(highlight=False)
    console.print(table)
    memory = as_object(listing.get("memory"))
    console.print(
        f"resident: {fmt.size(memory.get('resident_bytes'))} of "
        f"{fmt.size(memory.get('limit_bytes'))} limit (~ = estimate when loaded)",
        style="dim",
    )
    return EXIT_OK


def models_rm(ctx: Context, args: Any) -> int:
    ctx.ensure_server()
    result = ctx.client.request("DELETE", f"/admin/models/{model_path(args.id)}")
    print(f"deleted {result.get('id', args.id)} (freed {fmt.size(result.get('freed_bytes'))})")
    return EXIT_OK


def models_load(ctx: Context, args: Any) -> int:
    ctx.ensure_server()
    ctx.note(f"loading {args.id}…")
    result = ctx.client.request("PUT", f"/admin/models/{model_path(args.id)}/residency")
    print(f"loaded {result.get('id', args.id)} ({fmt.size(result.get('resident_bytes'))})")
    return EXIT_OK


def models_unload(ctx: Context, args: Any) -> int:
    ctx.ensure_server()
    result = ctx.client.request("DELETE", f"/admin/models/{model_path(args.id)}/residency")
    mid = result.get("id", args.id)
    print(f"unloaded {mid}" if result.get("unloaded") else f"{mid} was not loaded")
    return EXIT_OK


# -- pull ------------------------------------------------------------------------------------------


def pull(ctx: Context, args: Any) -> int:
    ctx.ensure_server()
    body: JsonObject = {"model": args.repo}
    if args.revision:
        body["revision"] = args.revision
    job_id = ctx.client.request("POST", "/admin/models", body).get("job")
    if not isinstance(job_id, str):
        raise ServerError("the server did not name the download job")
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=ctx.err,
        transient=False,
    )
    last: JsonObject = {}
    with progress:
        task = progress.add_task(f"pulling {args.repo}", total=None)
        for event in ctx.client.events("GET", f"/admin/jobs/{job_id}/events"):
            try:
                last = as_object(json.loads(event.data))
            except ValueError:
                continue
            total, done = last.get("total"), last.get("done")
            progress.update(
                task,
                total=float(total) if isinstance(total, int) else None,
                completed=float(done) if isinstance(done, int) else 0.0,
            )
            if last.get("state") in ("done", "failed"):
                break
    state = last.get("state")
    if state == "done":
        print(f"pulled {last.get('model', args.repo)} into {last.get('path')}")
        return EXIT_OK
    if state == "failed":
        error = as_object(last.get("error"))
        raise ServerError(f"pull failed: {error.get('message') or 'unknown error'}")
    raise ServerError(f"the download job {job_id} stopped reporting (state {state!r})")


# -- status / stop ---------------------------------------------------------------------------------


def status(ctx: Context, args: Any) -> int:
    if not ctx.client.healthy():
        record = daemon.read_record(ctx.url) if daemon.is_default(ctx.url) else None
        if record is not None:
            ctx.err.print(
                f"omnia-server (pid {record.pid}, started by omnia) is not answering at {ctx.url} "
                f"yet; log: {record.log}",
                highlight=False,
                markup=False,
            )
        else:
            ctx.err.print(f"omnia-server is not running at {ctx.url}", highlight=False)
        return EXIT_UNREACHABLE
    info = ctx.client.get("/admin/status")
    record = daemon.read_record(ctx.url) if daemon.is_default(ctx.url) else None
    auto = record is not None and record.pid == info.get("pid")
    if getattr(args, "json", False):
        out = dict(
            info, url=ctx.url, auto_started=auto, log=record.log if auto and record else None,
            stale_install=stale_install(info),
        )
        print(json.dumps(out, indent=2))
        return EXIT_OK
    runtime = as_object(info.get("runtime"))
    memory = as_object(info.get("memory"))
    lines: list[tuple[str, str]] = [("url", ctx.url)]
    if auto and record is not None:
        lines.append(("daemon", f"auto-started by omnia (pid {record.pid}, log: {record.log})"))
    else:
        lines.append(("daemon", f"started outside omnia (pid {info.get('pid')})"))
    lines.append(("uptime", fmt.duration(_float(info.get("uptime_s")))))
    for note in as_list(info.get("notes")):
        lines.append(("note", str(note)))
    stale = stale_install(info)
    if stale:
        restart = "omnia stop, then any omnia command starts it again" if auto else "restart it"
        lines.append(("install", f"{stale}: {restart}"))
    details = [str(runtime["device"])] if runtime.get("device") else []
    details += [f"{k} {runtime[k]}" for k in ("mlx", "blas", "allocator") if runtime.get(k)]
    backend = str(runtime.get("backend") or "-")
    lines.append(("backend", f"{backend} ({', '.join(details)})" if details else backend))
    lines.append(
        (
            "memory",
            f"{fmt.size(memory.get('resident_bytes'))} resident of "
            f"{fmt.size(memory.get('limit_bytes'))} limit; "
            f"{fmt.size(memory.get('available_bytes'))} free of "
            f"{fmt.size(memory.get('total_bytes'))}",
        )
    )
    lines.append(("default model", str(info.get("default_model") or "-")))
    resident = [as_object(r) for r in as_list(info.get("resident"))]
    if resident:
        lines.append(
            (
                "resident",
                ", ".join(
                    f"{r.get('id')} ({fmt.size(r.get('bytes'))}, "
                    + ("busy" if r.get("busy") else f"idle {fmt.duration(_float(r.get('idle_s')))}")
                    + ")"
                    for r in resident
                ),
            )
        )
    else:
        lines.append(("resident", "none"))
    lines.append(("queue", str(info.get("queue_depth", "-"))))
    if "prefix_cache" in info:  # a server from before the prefix cache has no such key
        lines.append(("prefix cache", _prefix_cache(info.get("prefix_cache"))))
    last = as_object(info.get("last_answer"))
    if last:
        tps = _float(last.get("tokens_per_second"))
        ago = _float(last.get("finished_at"))
        when = f", {fmt.duration(time.time() - ago)} ago" if ago else ""
        lines.append(
            (
                "last answer",
                f"{last.get('model')}: {last.get('completion_tokens')} tokens"
                + (f" at {tps:.1f} tok/s" if tps is not None else "")
                + when,
            )
        )
    else:
        lines.append(("last answer", "none yet"))
    width = max(len(k) for k, _ in lines)
    for key, value in lines:
        print(f"{key + ':':<{width + 1}} {value}")
    return EXIT_OK


def stale_install(info: dict[str, Any]) -> str | None:
    """What differs when the server at hand runs another install of mlx-omnia than the one this
    CLI belongs to (a `pip install` since it started), else None."""
    install = as_object(info.get("install"))
    running = install.get("stamp")
    if not running or running == "unknown" or running == install_stamp():
        return None
    was, now = install.get("version"), installed_version()
    versions = f" ({was}; installed now: {now})" if was and was != now else ""
    return f"the server runs an older install of mlx-omnia than the one installed now{versions}"


def stop(ctx: Context, args: Any) -> int:
    record = daemon.read_record(ctx.url) if daemon.is_default(ctx.url) else None
    if record is None:
        ctx.err.print(
            f"no omnia-server started by omnia is running for {ctx.url}",
            highlight=False,
            markup=False,
        )
        return EXIT_OK
    if ctx.client.healthy():
        pid = ctx.client.get("/admin/status").get("pid")
        if pid != record.pid:
            daemon.forget(ctx.url)
            ctx.err.print(
                f"the server at {ctx.url} (pid {pid}) was not started by omnia; not stopping it",
                highlight=False,
                markup=False,
            )
            return EXIT_ERROR
    if not daemon.stop(record):
        raise ServerError(f"omnia-server (pid {record.pid}) did not stop")
    print(f"stopped omnia-server (pid {record.pid})")
    return EXIT_OK


def _prefix_cache(value: object) -> str:
    """A status's prefix cache in one line: each tier's blocks and bytes of its budget, lookups."""
    cache = as_object(value)
    if not cache:
        return "off"

    def tier(name: str, where: str) -> str:
        if not cache.get(f"{name}_limit_bytes"):
            return f"off {where}"
        return (
            f"{cache.get(f'{name}_blocks')} blocks ({fmt.size(cache.get(f'{name}_bytes'))} of "
            f"{fmt.size(cache.get(f'{name}_limit_bytes'))}) {where}"
        )

    return (
        f"{tier('memory', 'in memory')}, {tier('disk', 'on disk')}; "
        f"{cache.get('hits')} blocks found, {cache.get('misses')} missed "
        f"(blocks of {cache.get('block_tokens')} tokens)"
    )


def _float(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) else None
