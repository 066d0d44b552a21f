"""What every route reaches through `request.app.state.omnia`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from fastapi import Request

from mlx_omnia import Chat, GenerationOptions, Model
from mlx_omnia.install import install_stamp, installed_version
from mlx_omnia.server.manager import ModelManager
from mlx_omnia.server.scheduler import Job, Scheduler
from mlx_omnia.server.settings import Settings
from mlx_omnia.server.stored import ResponseStore

T = TypeVar("T")


@dataclass
class LastAnswer:
    """The most recent finished generation, for status displays."""

    model: str
    prompt_tokens: int
    completion_tokens: int
    tokens_per_second: float | None
    finished_at: float


@dataclass
class ServerState:
    settings: Settings
    manager: ModelManager
    scheduler: Scheduler
    started_at: float = field(default_factory=time.time)
    # the install this server runs (mlx_omnia/install.py), taken at start
    install: dict[str, str] = field(
        default_factory=lambda: {"version": installed_version(), "stamp": install_stamp()}
    )
    last_answer: LastAnswer | None = None
    responses: ResponseStore = field(default_factory=ResponseStore)

    def job(self, model_id: str, input: Chat | str, options: GenerationOptions) -> Job:
        return Job(model_id, input, options, asyncio.get_running_loop())

    async def with_model(self, model_id: str, fn: Callable[[Model], T]) -> T:
        """Run `fn` (tokenizer work, no MLX) on the model off the event loop. A model that is not
        resident is loaded on the engine thread, where all MLX work happens."""
        res = self.manager.get_resident(model_id)
        if res is None:
            res = await self.scheduler.call(lambda: self.manager.get(model_id))
        try:
            return await asyncio.to_thread(fn, res.model)
        finally:
            self.manager.release(res)


def state_of(request: Request) -> ServerState:
    state = request.app.state.omnia
    assert isinstance(state, ServerState)
    return state
