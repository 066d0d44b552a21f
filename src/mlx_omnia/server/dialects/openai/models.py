"""OpenAI models: GET /models and /models/{model}."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from mlx_omnia.server.dialects.common import model_ids
from mlx_omnia.server.errors import ApiError
from mlx_omnia.server.state import state_of

router = APIRouter()


def _model(model_id: str) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "mlx-omnia"}


@router.get("/models")
async def list_models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [_model(i) for i in model_ids(state_of(request))]}


@router.get("/models/{model_id:path}")
async def retrieve_model(request: Request, model_id: str) -> dict[str, Any]:
    state = state_of(request)
    canonical = state.manager.check_id(model_id)
    if canonical not in model_ids(state):
        raise ApiError(
            "not_found", f"model {model_id!r} is not loaded or known to this server", "model"
        )
    return _model(canonical)
