"""The generation queue and the engine thread. Requests wait FIFO per model; up to
`max_concurrent` of a model's run together in its `Batch` (continuous batching: they share each
decode step, a newcomer joins at the next step), and the engine thread steps every model's batch
in turn, handing pieces to the asyncio side as they come. A full queue refuses (429). A
cancelled job leaves the queue at once; a running one leaves its batch at the next step, and the
others go on."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict, deque
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

from mlx_omnia import Batch, Chat, Generation, GenerationOptions, OmniaError, Piece, PrefixCache
from mlx_omnia.server.errors import ApiError
from mlx_omnia.server.manager import ModelManager, Resident


@dataclass(eq=False)  # a job is itself: found in its queue by identity
class Job:
    model_id: str
    input: Chat | str
    options: GenerationOptions
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue[Any] = field(default_factory=lambda: asyncio.Queue[Any]())
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    generation: Generation | None = None  # once admitted to its model's batch
    resident: Resident | None = None


_DONE = object()
T = TypeVar("T")


@dataclass
class _Call:
    """Work for the engine thread that is not a generation (loading a model): it runs before the
    next queued job and does not count against max_queue."""

    fn: Callable[[], Any]
    future: Future[Any]


# Called with (job, piece) for every piece produced, on the engine thread (metrics hook).
PieceHook = Callable[[Job, Piece], None]
# Called with each job once it has left the engine (finished, failed or cancelled).
EndHook = Callable[[Job], None]


class _Running:
    """A model's batch and the jobs in it."""

    def __init__(self, batch: Batch) -> None:
        self.batch = batch
        self.jobs: dict[Generation, Job] = {}


class Scheduler:
    def __init__(
        self,
        manager: ModelManager,
        *,
        max_queue: int,
        max_concurrent: int = 8,
        prefix_cache: PrefixCache | None = None,
        on_piece: PieceHook | None = None,
    ):
        self.manager = manager
        self.max_queue = max_queue
        self.max_concurrent = max_concurrent
        self.prefix_cache = prefix_cache
        self._queues: OrderedDict[str, deque[Job]] = OrderedDict()
        self._calls: deque[_Call] = deque()
        self._batches: OrderedDict[str, _Running] = OrderedDict()
        self._cv = threading.Condition()
        self._stopping = False
        self.on_piece = on_piece
        self.on_end: EndHook | None = None
        self.running: tuple[Job, ...] = ()  # admitted jobs, refreshed every step
        self._thread = threading.Thread(target=self._work, name="omnia-engine", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        """Jobs waiting (not counting the running ones)."""
        with self._cv:
            return sum(len(q) for q in self._queues.values())

    def submit(self, job: Job) -> None:
        with self._cv:
            if sum(len(q) for q in self._queues.values()) >= self.max_queue:
                raise ApiError(
                    "rate_limit", f"the server's queue is full ({self.max_queue} waiting); retry later"
                )
            self._queues.setdefault(job.model_id, deque()).append(job)
            self._cv.notify()

    def cancel(self, job: Job) -> None:
        """Stop `job`: out of the queue if it waits there (its place is free again), else out of
        its batch at the next step."""
        job.cancelled.set()
        with self._cv:
            queue = self._queues.get(job.model_id)
            if queue is not None and job in queue:
                queue.remove(job)
            self._cv.notify()

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()

    async def stream(self, job: Job) -> AsyncGenerator[Piece, None]:
        """Submit `job` and yield its pieces; leaving early (client gone) cancels it."""
        self.submit(job)
        try:
            while True:
                item = await job.out.get()
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.cancel(job)

    async def run(self, job: Job) -> list[Piece]:
        return [piece async for piece in self.stream(job)]

    async def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the engine thread (all MLX work happens there) and return its result."""
        future: Future[T] = Future()
        with self._cv:
            if self._stopping:
                raise ApiError("overloaded", "the server is shutting down")
            self._calls.append(_Call(fn, future))
            self._cv.notify()
        return await asyncio.wrap_future(future)

    # -- engine thread -------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._stopping and not (self._calls or self._batches or self._admissible()):
                    self._cv.wait()
                if self._stopping:
                    break
                calls = list(self._calls)
                self._calls.clear()
            for call in calls:
                if call.future.set_running_or_notify_cancel():
                    try:
                        call.future.set_result(call.fn())
                    except BaseException as e:  # handed to the awaiting request
                        call.future.set_exception(e)
            self._admit()
            for model_id in list(self._batches):
                self._step(model_id)
            self.running = tuple(j for r in self._batches.values() for j in r.jobs.values())
        for running in self._batches.values():
            for job in list(running.jobs.values()):
                self._finish(running, job, ApiError("overloaded", "the server is shutting down"))

    def _admissible(self) -> bool:
        """Whether a queued job may join its model's batch now (under the cv)."""
        for model_id, queue in self._queues.items():
            running = self._batches.get(model_id)
            if queue and (running is None or len(running.jobs) < self.max_concurrent):
                return True
        return False

    def _admit(self) -> None:
        """Queued jobs join their models' batches, up to max_concurrent each, models taken in
        turn (the one just served goes to the back)."""
        while True:
            with self._cv:
                job = None
                for model_id in list(self._queues):
                    queue = self._queues[model_id]
                    running = self._batches.get(model_id)
                    if queue and (running is None or len(running.jobs) < self.max_concurrent):
                        job = queue.popleft()
                        self._queues.move_to_end(model_id)
                        break
                if job is None:
                    return
            if job.cancelled.is_set():
                self._emit(job, _DONE)
                self._ended(job)
                continue
            self._start(job)

    def _start(self, job: Job) -> None:
        try:
            job.resident = self.manager.get(job.model_id)
            running = self._batches.get(job.model_id)
            if running is None or running.batch.model is not job.resident.model:
                running = _Running(Batch(job.resident.model, self.prefix_cache))
                self._batches[job.model_id] = running
            job.generation = running.batch.add(job.input, job.options)  # tokenizes, checks
            running.jobs[job.generation] = job
        except (ApiError, OmniaError) as e:
            self._fail(job, e)
        except Exception as e:  # never let one request take the engine down
            self._fail(job, ApiError("internal", f"generation failed: {e}"))

    def _step(self, model_id: str) -> None:
        running = self._batches[model_id]
        for generation, job in list(running.jobs.items()):
            if job.cancelled.is_set():
                running.batch.cancel(generation)
                self._finish(running, job, None)
        try:
            events = running.batch.step() if len(running.batch) else []
        except Exception as e:  # the step itself failed: every job of this batch ends with it
            error = ApiError("internal", f"generation failed: {e}")
            for job in list(running.jobs.values()):
                self._finish(running, job, error)
            del self._batches[model_id]
            return
        for generation, event in events:
            job = running.jobs.get(generation)
            if job is None:
                continue
            if isinstance(event, Exception):
                error = event if isinstance(event, OmniaError | ApiError) else ApiError(
                    "internal", f"generation failed: {event}"
                )
                self._finish(running, job, error)
                continue
            for piece in event:
                if job.first_token_at is None:
                    job.first_token_at = time.monotonic()
                if self.on_piece is not None:
                    self.on_piece(job, piece)
                self._emit(job, piece)
            if event and event[-1].finish_reason is not None:
                self._finish(running, job, None)
        if not running.jobs:
            del self._batches[model_id]  # an idle model holds no batch (it may be unloaded)

    def _finish(self, running: _Running, job: Job, error: BaseException | None) -> None:
        """The job leaves its batch: its end (or error) goes out, its model is released."""
        if job.generation is not None:
            running.jobs.pop(job.generation, None)
        self._emit(job, _DONE if error is None else error)
        self._ended(job)

    def _fail(self, job: Job, error: BaseException) -> None:
        self._emit(job, error)
        self._ended(job)

    def _ended(self, job: Job) -> None:
        if job.resident is not None:
            self.manager.release(job.resident)
            job.resident = None
        if self.on_end is not None:
            self.on_end(job)

    def _emit(self, job: Job, item: Any) -> None:
        try:
            job.loop.call_soon_threadsafe(job.out.put_nowait, item)
        except RuntimeError:  # the event loop is closed (server stopping): nobody is listening
            job.cancelled.set()
