"""OpenAI dialect, under /api/openai/v1: chat completions, legacy completions, responses, models.
One module an API; what they share is in `shared`."""

from fastapi import APIRouter

from mlx_omnia.server.dialects.openai import chat, completions, models, responses

router = APIRouter()
for api in (chat, completions, responses, models):
    router.include_router(api.router)
