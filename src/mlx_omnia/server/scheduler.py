"""The generation queue: one engine thread runs jobs FIFO per model, round-robin across models,
handing pieces to the asyncio side as they come; a full queue refuses. A cancelled job leaves the
queue at once; a running one stops before its prefill or at its next token."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict, deque
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

from mlx_omnia import Chat, GenerationOptions, OmniaError, Piece
from mlx_omnia.server.errors import ApiError
from mlx_omnia.server.manager import ModelManager


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


class Scheduler:
    def __init__(self, manager: ModelManager, *, max_queue: int, on_piece: PieceHook | None = None):
        self.manager = manager
        self.max_queue = max_queue
        self._queues: OrderedDict[str, deque[Job]] = OrderedDict()
        self._calls: deque[_Call] = deque()
        self._cv = threading.Condition()
        self._stopping = False
        self.on_piece = on_piece
        self.on_end: EndHook | None = None
        self.running: Job | None = None
        self._thread = threading.Thread(target=self._work, name="omnia-engine", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        """Jobs waiting (not counting the one running)."""
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
        """Stop `job`: out of the queue if it waits there (its place is free again), else at the
        running job's next check."""
        job.cancelled.set()
        with self._cv:
            queue = self._queues.get(job.model_id)
            if queue is not None and job in queue:
                queue.remove(job)

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
    def _next(self) -> Job | _Call | None:
        with self._cv:
            while not self._stopping:
                if self._calls:
                    return self._calls.popleft()
                for model_id in list(self._queues):
                    queue = self._queues[model_id]
                    if queue:
                        job = queue.popleft()
                        # Round-robin: the model just served goes to the back.
                        self._queues.move_to_end(model_id)
                        return job
                self._cv.wait()
            return None

    def _emit(self, job: Job, item: Any) -> None:
        try:
            job.loop.call_soon_threadsafe(job.out.put_nowait, item)
        except RuntimeError:  # the event loop is closed (server stopping): nobody is listening
            job.cancelled.set()

    def _work(self) -> None:
        while (job := self._next()) is not None:
            if isinstance(job, _Call):
                if job.future.set_running_or_notify_cancel():
                    try:
                        job.future.set_result(job.fn())
                    except BaseException as e:  # handed to the awaiting request
                        job.future.set_exception(e)
                continue
            if job.cancelled.is_set():
                self._emit(job, _DONE)
                continue
            self.running = job
            try:
                self._run(job)
            except ApiError as e:
                self._emit(job, e)
            except OmniaError as e:
                self._emit(job, e)
            except Exception as e:  # never let one request take the engine down
                self._emit(job, ApiError("internal", f"generation failed: {e}"))
            else:
                self._emit(job, _DONE)
            finally:
                self.running = None
                if self.on_end is not None:
                    self.on_end(job)

    def _run(self, job: Job) -> None:
        res = self.manager.get(job.model_id)
        try:
            pieces = res.model.stream(job.input, job.options)  # tokenizes; prefill comes next
            if job.cancelled.is_set():
                return
            for piece in pieces:
                if job.first_token_at is None:
                    job.first_token_at = time.monotonic()
                if self.on_piece is not None:
                    self.on_piece(job, piece)
                self._emit(job, piece)
                if job.cancelled.is_set():
                    break
        finally:
            self.manager.release(res)
