"""Administration under /admin: health, the models on disk and in memory, loading and unloading,
deleting from the HF cache, downloads as jobs with SSE progress; and the idle-model reaper.

Model ids may hold one slash (owner/name): routes take `{model_id:path}`. The residency routes
(`.../residency`) are registered first, so the suffix always names the residency of the id before
it (a repo literally named "owner/residency" cannot be deleted through this API)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict

from mlx_omnia import (
    OmniaError,
    PullProgress,
    cached_models,
    default_prefix_dir,
    delete_cached,
    embedded_model,
    estimate_memory,
    pull,
    runtime_info,
    runtime_notes,
)
from mlx_omnia.server.dialects.common import sse
from mlx_omnia.server.dialects.errors import from_engine
from mlx_omnia.server.errors import ApiError
from mlx_omnia.server.manager import DEFAULT_MODEL
from mlx_omnia.server.state import ServerState, state_of

router = APIRouter()


@router.get("/admin/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


def _system_memory() -> dict[str, int | None]:
    def pages(name: str) -> int | None:
        try:
            return int(os.sysconf(name) * os.sysconf("SC_PAGE_SIZE"))
        except (ValueError, OSError, AttributeError):
            return None

    return {"total_bytes": pages("SC_PHYS_PAGES"), "available_bytes": pages("SC_AVPHYS_PAGES")}


@router.get("/admin/status")
async def status(request: Request) -> dict[str, Any]:
    """The daemon at a glance: host, backend, memory, resident models, queue, prefix cache, last
    answer."""
    state = state_of(request)
    now = time.monotonic()
    last = state.last_answer
    return {
        "status": "ok",
        "pid": os.getpid(),
        "host": state.settings.host,
        "port": state.settings.port,
        "started_at": state.started_at,
        "uptime_s": time.time() - state.started_at,
        "runtime": runtime_info(),
        "install": state.install,
        "notes": runtime_notes(),
        "memory": {
            **_system_memory(),
            "limit_bytes": state.settings.memory_limit,
            "resident_bytes": state.manager.memory_used(),
        },
        "default_model": state.manager.default_id,
        "resident": [
            {"id": r.id, "bytes": r.nbytes, "busy": r.busy > 0, "idle_s": now - r.last_used}
            for r in state.manager.resident()
        ],
        "queue_depth": state.scheduler.depth,
        "prefix_cache": _prefix_cache(state),
        "last_answer": None
        if last is None
        else {
            "model": last.model,
            "prompt_tokens": last.prompt_tokens,
            "completion_tokens": last.completion_tokens,
            "tokens_per_second": last.tokens_per_second,
            "finished_at": last.finished_at,
        },
    }


def _prefix_cache(state: ServerState) -> dict[str, Any] | None:
    """The prefix cache's settings, sizes and counters (blocks); None when it is off."""
    cache = state.scheduler.prefix_cache
    if cache is None:
        return None
    settings = state.settings
    disk = settings.prefix_disk > 0
    return {
        "block_tokens": cache.block_tokens,
        "memory_limit_bytes": settings.prefix_memory,
        "disk_limit_bytes": settings.prefix_disk,
        "dir": str(settings.prefix_dir or default_prefix_dir()) if disk else None,
        **asdict(cache.stats()),
    }


# -- models ----------------------------------------------------------------------------------------


def _disk_size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _estimate(reference: str | Path | None) -> int | None:
    try:
        return estimate_memory(reference)
    except OmniaError:
        return None


def _list_models(state: ServerState) -> dict[str, Any]:
    manager = state.manager
    resident = {r.id: r for r in manager.resident()}
    entries: dict[str, dict[str, Any]] = {}

    def entry(
        model_id: str, source: str, size: int | None, path: Path | None, **extra: Any
    ) -> None:
        if model_id in entries:
            return
        res = resident.get(model_id)
        entries[model_id] = {
            "id": model_id,
            "source": source,
            "size_on_disk": size,
            "path": str(path) if path is not None else None,
            "estimated_bytes": _estimate(path) if path is not None else None,
            "resident": res is not None,
            "resident_bytes": res.nbytes if res is not None else None,
            "default": model_id == manager.default_id,
            **extra,
        }

    default = embedded_model()
    if default is not None:
        entry(default.repo_id, "embedded", default.size_on_disk, default.path)
    for alias, path in manager.aliases().items():
        entry(alias, "alias", _disk_size(path) if path.exists() else None, path)
    for cached in cached_models():
        entry(
            cached.repo_id,
            "hub",
            cached.size_on_disk,
            cached.path,
            commit=cached.commit,
            refs=list(cached.refs),
        )
    for model_id in resident:
        entry(model_id, "resident", None, None)
    return {
        "models": list(entries.values()),
        "memory": {
            "resident_bytes": manager.memory_used(),
            "limit_bytes": state.settings.memory_limit,
        },
    }


@router.get("/admin/models")
async def list_models(request: Request) -> dict[str, Any]:
    return await asyncio.to_thread(_list_models, state_of(request))


@router.put("/admin/models/{model_id:path}/residency")
async def load_model(request: Request, model_id: str) -> dict[str, Any]:
    state = state_of(request)
    mid = state.manager.check_id(model_id)

    def load_now() -> int:
        res = state.manager.get(mid)
        state.manager.release(res)
        return res.nbytes

    nbytes = await state.scheduler.call(load_now)  # MLX work stays on the engine thread
    return {"id": mid, "resident": True, "resident_bytes": nbytes}


@router.delete("/admin/models/{model_id:path}/residency")
async def unload_model(request: Request, model_id: str) -> dict[str, Any]:
    state = state_of(request)
    mid = state.manager.check_id(model_id)
    unloaded = state.manager.unload(mid)
    return {"id": mid, "resident": False, "unloaded": unloaded}


@router.delete("/admin/models/{model_id:path}")
async def delete_model(request: Request, model_id: str) -> dict[str, Any]:
    state = state_of(request)
    mid = state.manager.check_id(model_id)
    if mid == DEFAULT_MODEL:
        raise ApiError(
            "invalid_request", f"{mid!r} is the embedded default model; it cannot be deleted"
        )
    if mid in state.manager.aliases():
        raise ApiError(
            "invalid_request",
            f"{mid!r} is a local path given to the server; it is not deleted through the API",
        )
    state.manager.repo_id(mid)
    state.manager.unload(mid)  # refuses while it is generating
    freed = await asyncio.to_thread(delete_cached, mid)
    return {"id": mid, "deleted": True, "freed_bytes": freed}


# -- downloads -------------------------------------------------------------------------------------

JobState = Literal["queued", "running", "done", "failed"]


@dataclass
class PullJob:
    id: str
    model: str
    revision: str | None
    state: JobState = "queued"
    done: int = 0
    total: int | None = None
    files: dict[str, dict[str, int | None]] = field(
        default_factory=dict[str, dict[str, int | None]]
    )
    error: dict[str, str] | None = None
    path: str | None = None
    created: float = field(default_factory=time.time)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def view(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "model": self.model,
            "revision": self.revision,
            "state": self.state,
            "done": self.done,
            "total": self.total,
            "files": self.files,
            "error": self.error,
            "path": self.path,
        }

    def touch(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()


class Jobs:
    """Download jobs of one app: one at a time (downloads share the network), kept for listing."""

    def __init__(self) -> None:
        self.jobs: dict[str, PullJob] = {}
        self._ids = itertools.count(1)
        self._one = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self, model: str, revision: str | None) -> PullJob:
        for job in self.jobs.values():
            if (
                job.model == model
                and job.revision == revision
                and job.state in ("queued", "running")
            ):
                return job
        job = PullJob(f"pull-{next(self._ids)}", model, revision)
        self.jobs[job.id] = job
        task = asyncio.get_running_loop().create_task(self._run(job))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return job

    async def _run(self, job: PullJob) -> None:
        loop = asyncio.get_running_loop()

        def apply(p: PullProgress) -> None:
            job.done, job.total = p.done, p.total
            if p.filename is not None:
                job.files[p.filename] = {"done": p.file_done, "total": p.file_total}
            job.touch()

        def progress(p: PullProgress) -> None:  # download thread
            loop.call_soon_threadsafe(apply, p)

        async with self._one:
            job.state = "running"
            job.touch()
            try:
                path = await asyncio.to_thread(pull, job.model, job.revision, progress)
            except OmniaError as e:
                err = from_engine(e)
                job.state, job.error = "failed", {"type": err.kind, "message": err.message}
            except Exception as e:
                job.state, job.error = (
                    "failed",
                    {"type": "internal", "message": f"download failed: {e}"},
                )
            else:
                job.state, job.path = "done", str(path)
                job.done = job.total if job.total is not None else job.done
            await asyncio.sleep(0)  # let progress reports queued by the thread land first
            job.touch()

    def get(self, job_id: str) -> PullJob:
        job = self.jobs.get(job_id)
        if job is None:
            raise ApiError("not_found", f"no job {job_id!r}")
        return job


def jobs_of(request: Request) -> Jobs:
    jobs = getattr(request.app.state, "omnia_jobs", None)
    if not isinstance(jobs, Jobs):
        jobs = Jobs()
        request.app.state.omnia_jobs = jobs
    return jobs


class PullRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    revision: str | None = None


@router.post("/admin/models", status_code=202)
async def start_pull(request: Request, body: PullRequest) -> JSONResponse:
    state = state_of(request)
    mid = state.manager.repo_id(body.model)
    job = jobs_of(request).start(mid, body.revision)
    return JSONResponse({"job": job.id, "state": job.state}, status_code=202)


@router.get("/admin/jobs")
async def list_jobs(request: Request) -> dict[str, Any]:
    return {"jobs": [j.view() for j in jobs_of(request).jobs.values()]}


@router.get("/admin/jobs/{job_id}")
async def get_job(request: Request, job_id: str) -> dict[str, Any]:
    return jobs_of(request).get(job_id).view()


@router.get("/admin/jobs/{job_id}/events")
async def job_events(request: Request, job_id: str) -> StreamingResponse:
    job = jobs_of(request).get(job_id)

    async def events() -> AsyncIterator[str]:
        while True:
            changed = job.changed
            yield sse(job.view(), event=job.state)
            if job.state in ("done", "failed"):
                return
            try:
                await asyncio.wait_for(changed.wait(), timeout=15)
            except TimeoutError:
                yield ": keep-alive\n\n"
            await asyncio.sleep(0.05)  # at most ~20 reports a second

    return StreamingResponse(
        events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


# -- the idle reaper -------------------------------------------------------------------------------


async def reap_idle_models(state: ServerState) -> None:
    """Unload models idle for longer than --idle-ttl, checking a few times per TTL."""
    interval = min(30.0, max(0.05, state.settings.idle_ttl / 4))
    while True:
        await asyncio.sleep(interval)
        with contextlib.suppress(Exception):  # a failed sweep must not end the reaper
            state.manager.reap_idle()


def start_reaper(state: ServerState) -> asyncio.Task[None]:
    return asyncio.get_running_loop().create_task(reap_idle_models(state), name="omnia-reaper")
