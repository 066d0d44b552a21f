"""What every route reaches through `request.app.state.omnia`."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from fastapi import Request

from mlx_omnia import Chat, GenerationOptions
from mlx_omnia.server.manager import ModelManager
from mlx_omnia.server.scheduler import Job, Scheduler
from mlx_omnia.server.settings import Settings


@dataclass
class ServerState:
    settings: Settings
    manager: ModelManager
    scheduler: Scheduler

    def job(self, model_id: str, input: Chat | str, options: GenerationOptions) -> Job:
        return Job(model_id, input, options, asyncio.get_running_loop())


def state_of(request: Request) -> ServerState:
    state = request.app.state.omnia
    assert isinstance(state, ServerState)
    return state
