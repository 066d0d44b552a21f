"""Each dialect's own error shape, from one ApiError."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel

from mlx_omnia import (
    ChatTemplateError,
    CheckpointError,
    ConstraintError,
    ContextLengthError,
    DownloadError,
    InvalidOptionsError,
    ModelNotFoundError,
    OmniaError,
    TokenizerError,
    UnsupportedModelError,
)
from mlx_omnia.server.errors import ApiError, Kind

Dialect = Literal["openai", "anthropic", "gemini", "native"]

# Seconds a client told "queue full" (429) waits before trying again: one answer's worth of a
# short wait; the SDKs of all three APIs honour the header in their retries.
RETRY_AFTER_S = 1

OPENAI_TYPES: dict[Kind, str] = {
    "invalid_request": "invalid_request_error",
    "authentication": "authentication_error",
    "permission": "permission_error",
    "not_found": "invalid_request_error",
    "method_not_allowed": "invalid_request_error",
    "too_large": "invalid_request_error",
    "rate_limit": "rate_limit_error",
    "overloaded": "overloaded_error",
    "internal": "server_error",
    "client_closed": "invalid_request_error",
}
ANTHROPIC_TYPES: dict[Kind, str] = {
    "invalid_request": "invalid_request_error",
    "authentication": "authentication_error",
    "permission": "permission_error",
    "not_found": "not_found_error",
    "method_not_allowed": "invalid_request_error",
    "too_large": "request_too_large",
    "rate_limit": "rate_limit_error",
    "overloaded": "overloaded_error",
    "internal": "api_error",
    "client_closed": "invalid_request_error",
}
GEMINI_STATUS: dict[Kind, str] = {
    "invalid_request": "INVALID_ARGUMENT",
    "authentication": "UNAUTHENTICATED",
    "permission": "PERMISSION_DENIED",
    "not_found": "NOT_FOUND",
    "method_not_allowed": "UNIMPLEMENTED",  # as Google's REST gateways answer a 405
    "too_large": "INVALID_ARGUMENT",
    "rate_limit": "RESOURCE_EXHAUSTED",
    "overloaded": "UNAVAILABLE",
    "internal": "INTERNAL",
    "client_closed": "CANCELLED",
}


def dialect_of(path: str) -> Dialect:
    if path.startswith("/api/openai/"):
        return "openai"
    if path.startswith("/api/anthropic/"):
        return "anthropic"
    if path.startswith("/api/gemini/"):
        return "gemini"
    return "native"


def from_engine(
    error: OmniaError, input_field: str = "messages", names: Mapping[str, str] | None = None
) -> ApiError:
    """Map an engine error to the HTTP layer's kinds. `input_field` is where the request put its
    input, `names` its name for each option (GenerationOptions field): errors say those."""
    if isinstance(error, ModelNotFoundError):
        return ApiError("not_found", str(error), "model")
    if isinstance(error, ContextLengthError):
        return ApiError("invalid_request", str(error), input_field, "context_length_exceeded")
    if isinstance(error, InvalidOptionsError) and error.option is not None:
        name = (names or {}).get(error.option, error.option)
        return ApiError("invalid_request", f"{name} {error.reason}", name)
    if isinstance(error, ConstraintError):  # the request's grammar, against this vocabulary
        name = (names or {}).get("constraint")
        return ApiError("invalid_request", f"{name}: {error}" if name else str(error), name)
    if isinstance(error, InvalidOptionsError | ChatTemplateError | TokenizerError):
        return ApiError("invalid_request", str(error))
    if isinstance(error, CheckpointError | UnsupportedModelError):
        return ApiError("invalid_request", f"the model cannot be loaded: {error}", "model")
    if isinstance(error, DownloadError):
        return ApiError("overloaded", str(error), "model")
    return ApiError("internal", str(error))


def error_body(dialect: Dialect, error: ApiError) -> dict[str, object]:
    if dialect == "openai":
        code = error.code or (
            "model_not_found" if error.kind == "not_found" and error.param == "model" else None
        )
        return {
            "error": {
                "message": error.message,
                "type": OPENAI_TYPES[error.kind],
                "param": error.param,
                "code": code,
            }
        }
    if dialect == "anthropic":
        return {"type": "error", "error": {"type": ANTHROPIC_TYPES[error.kind], "message": error.message}}
    if dialect == "gemini":
        return {
            "error": {"code": error.status, "message": error.message, "status": GEMINI_STATUS[error.kind]}
        }
    return {"error": {"type": error.kind, "message": error.message}}


# -- the error shapes, as the OpenAPI schema documents them --------------------------------------


class _OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIError(BaseModel):
    error: _OpenAIErrorDetail


class _TypedMessage(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    type: Literal["error"]
    error: _TypedMessage


class _GeminiErrorDetail(BaseModel):
    code: int
    message: str
    status: str


class GeminiError(BaseModel):
    error: _GeminiErrorDetail


class NativeError(BaseModel):
    error: _TypedMessage


ERROR_MODELS: dict[Dialect, type[BaseModel]] = {
    "openai": OpenAIError, "anthropic": AnthropicError, "gemini": GeminiError, "native": NativeError
}
_WHEN = {
    400: "The request is not valid (its body, a field, an option out of bounds, the input too "
    "long).",
    401: "The server has an API key and the request did not present it.",
    404: "No such model (or other resource) here.",
    405: "The path takes other methods, which Allow names (a path parameter that is not valid "
    "can make it another route's path).",
    413: "The request body is over the server's limit.",
    429: "The server's queue is full: try again after Retry-After seconds.",
    500: "The server failed.",
    503: "The model cannot be had now (a download failed).",
}


def error_responses(dialect: Dialect) -> dict[int | str, dict[str, Any]]:
    """The error answers a dialect's routes may give, for their OpenAPI documentation (FastAPI's
    `responses`), each in the dialect's own shape."""
    out: dict[int | str, dict[str, Any]] = {
        status: {"model": ERROR_MODELS[dialect], "description": why}
        for status, why in _WHEN.items()
    }
    out[405]["headers"] = {
        "Allow": {"description": "The path's methods.", "schema": {"type": "string"}}
    }
    out[429]["headers"] = {
        "Retry-After": {"description": "Seconds to wait.", "schema": {"type": "integer"}}
    }
    if dialect == "anthropic":
        out[529] = {**out.pop(503), "description": "Overloaded: " + _WHEN[503]}
    return out


def error_response(
    dialect: Dialect, error: ApiError, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    status = error.status
    if dialect == "anthropic" and error.kind == "overloaded":
        status = 529  # Anthropic's own status for overloaded_error
    if error.kind == "rate_limit":
        headers = {**(headers or {}), "Retry-After": str(RETRY_AFTER_S)}
    return JSONResponse(error_body(dialect, error), status_code=status, headers=headers)
