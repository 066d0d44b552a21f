"""OpenAI legacy completions: POST /completions (raw text in, raw text out)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field, StrictBool, StrictInt, StrictStr

from mlx_omnia import Bounds, Piece, TokenLogprob
from mlx_omnia.server.dialects.common import STREAMED, new_id, token_text
from mlx_omnia.server.dialects.fields import COMPLETIONS
from mlx_omnia.server.dialects.generation import Options, documented, run_all, stream_all
from mlx_omnia.server.dialects.openai.shared import (
    LIMITS,
    Reply,
    Sampling,
    accepted,
    events,
    sampling_options,
    usage_of,
)
from mlx_omnia.server.errors import ApiError

router = APIRouter()

# Legacy completions answer at most this many tokens when max_tokens is not given (as OpenAI's do).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
COMPLETIONS_LIMITS = {**LIMITS, "logprobs": Bounds(le=5)}  # alternatives a token


class CompletionRequest(Sampling):
    prompt: StrictStr | list[Any] = Field(
        description="Text, or a list of exactly one text; an empty text needs a model whose "
        "tokenizer adds a BOS token.",
        json_schema_extra={"minItems": 1, "maxItems": 1},
    )
    echo: StrictBool | None = Field(None, json_schema_extra={"not": {"const": True}})
    suffix: StrictStr | None = Field(None, json_schema_extra={"not": {"type": "string"}})
    logprobs: StrictInt | None = Field(
        None, json_schema_extra=documented("logprobs", COMPLETIONS_LIMITS)
    )
    best_of: StrictInt | None = Field(None, json_schema_extra={"minimum": 1, "maximum": 1})


def completion_logprobs(entries: tuple[TokenLogprob, ...], offset: int) -> dict[str, Any]:
    """A legacy completion choice's `logprobs`; `offset`: characters of the completion's text
    before these tokens (text_offset counts from the completion's start)."""
    tokens: list[str] = []
    offsets: list[int] = []
    text = b""
    for e in entries:
        offsets.append(offset + len(text.decode("utf-8", errors="ignore")))
        tokens.append(token_text(e.token_bytes))
        text += e.token_bytes
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{token_text(t.token_bytes): t.logprob for t in e.top} for e in entries],
        "text_offset": offsets,
    }


def _prompt_of(prompt: str | list[Any]) -> str:
    if isinstance(prompt, str):
        return prompt
    if len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    if len(prompt) != 1:
        raise ApiError(
            "invalid_request", "prompt must be a string or a list of exactly one string", "prompt"
        )
    raise ApiError("invalid_request", "prompt as token ids is not supported; send text", "prompt")


def _completion_options(body: CompletionRequest) -> Options:
    if body.echo:
        raise ApiError("invalid_request", "echo=true is not supported", "echo")
    if body.suffix is not None:
        raise ApiError("invalid_request", "suffix is not supported", "suffix")
    if body.best_of not in (None, 1):
        raise ApiError("invalid_request", "only best_of=1 is supported", "best_of")
    options = sampling_options(body, COMPLETIONS_LIMITS)
    max_tokens = body.max_tokens if body.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
    options.set("max_tokens", max_tokens)
    options.set("logprobs", body.logprobs)
    return options


@router.post("/completions", response_model=None, responses=STREAMED)
async def completions(
    request: Request, body: CompletionRequest
) -> JSONResponse | StreamingResponse:
    model_id = accepted(request, body, body.model, COMPLETIONS)
    generation = _completion_options(body).generation(model_id, _prompt_of(body.prompt), "prompt")
    reply = Reply(new_id("cmpl-"), model_id)
    n = body.n or 1

    def choice(
        index: int, text: str, finish: str | None, logprobs: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        return {"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish}

    def completion(
        index: int, text: str, finish: str | None, logprobs: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        return reply.of("text_completion", [choice(index, text, finish, logprobs)])

    wants = body.logprobs is not None
    if not body.stream:
        answers = await run_all(request, generation, n)
        choices = [
            choice(
                i, a.text, a.last.finish_reason,
                completion_logprobs(a.logprobs, 0) if wants else None,
            )
            for i, a in enumerate(answers)
        ]
        out = reply.of("text_completion", choices)
        return JSONResponse({**out, "usage": usage_of(*(a.usage for a in answers))})
    streams = await stream_all(request, generation, n)

    def chunk_of(piece: Piece, index: int, sent: int) -> dict[str, Any]:
        return completion(
            index, piece.text, None, completion_logprobs(piece.logprobs, sent) if wants else None
        )

    return events(
        streams, chunk_of, lambda i, finish: completion(i, "", finish), body.stream_options
    )
