"""The FastAPI application: routes of every dialect on one engine, auth, limits, error shapes."""

from __future__ import annotations

import hmac
import json
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import Scope

from mlx_omnia import OmniaError, PrefixCache, default_prefix_dir
from mlx_omnia.server import admin, webapp
from mlx_omnia.server.dialects import anthropic, gemini, openai
from mlx_omnia.server.dialects.errors import (
    dialect_of,
    error_response,
    error_responses,
    from_engine,
)
from mlx_omnia.server.errors import ApiError, Kind
from mlx_omnia.server.limits import BodyLimit
from mlx_omnia.server.logs import redact_access_log
from mlx_omnia.server.manager import ModelManager
from mlx_omnia.server.metrics import Metrics
from mlx_omnia.server.scheduler import Scheduler
from mlx_omnia.server.settings import Settings
from mlx_omnia.server.state import LastAnswer, ServerState

# Paths that need no key (nor do the web app's assets under /static/).
OPEN_PATHS = ("/admin/health", "/", *anthropic.PROBES)


def _presented_key(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return (
        request.headers.get("x-api-key")
        or request.headers.get("x-goog-api-key")
        or request.query_params.get("key")
    )


def create_app(settings: Settings, *, manager: ModelManager | None = None) -> FastAPI:
    manager = manager or ModelManager(settings)
    prefix_cache = None
    if settings.prefix_memory > 0 or settings.prefix_disk > 0:
        prefix_cache = PrefixCache(
            block_tokens=settings.prefix_block, memory_bytes=settings.prefix_memory,
            disk_dir=settings.prefix_dir or default_prefix_dir(), disk_bytes=settings.prefix_disk,
        )
    scheduler = Scheduler(
        manager, max_queue=settings.max_queue, max_concurrent=settings.max_concurrent,
        prefix_cache=prefix_cache,
    )
    state = ServerState(settings, manager, scheduler)
    metrics = Metrics(manager)
    metrics.attach(scheduler)

    def remember(model: str, prompt: int, completion: int, rate: float | None) -> None:
        state.last_answer = LastAnswer(model, prompt, completion, rate, time.time())

    metrics.on_answer = remember

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncGenerator[None, None]:
        redact_access_log()
        reaper = admin.start_reaper(state)
        yield
        reaper.cancel()
        scheduler.stop()
        if prefix_cache is not None:
            prefix_cache.close()  # queued blocks reach the disk before the process ends

    app = FastAPI(title="mlx-omnia", lifespan=lifespan)
    app.state.omnia = state
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.cors_origins),
            allow_methods=["*"],
            allow_headers=["*"],
        )

    # Inside the guard (a refused key reads no body), outside the routes.
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)

    @app.middleware("http")
    async def guard(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        dialect = dialect_of(request.url.path)
        if (
            settings.api_key
            and request.method != "OPTIONS"
            and request.url.path not in OPEN_PATHS
            and not request.url.path.startswith("/static/")
        ):
            key = _presented_key(request)
            if key is None or not hmac.compare_digest(key.encode(), settings.api_key.encode()):
                return error_response(
                    dialect, ApiError("authentication", "missing or invalid API key")
                )
        return await call_next(request)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> Response:
        return error_response(dialect_of(request.url.path), exc)

    @app.exception_handler(OmniaError)
    async def engine_error(request: Request, exc: OmniaError) -> Response:
        return error_response(dialect_of(request.url.path), from_engine(exc))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        errors = exc.errors()
        first: dict[str, Any] = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            message, param = "the request body is not valid JSON", None
        else:
            where = ".".join(loc) or "body"
            message, param = f"{where}: {first.get('msg', 'invalid value')}", where
        return error_response(dialect_of(request.url.path), ApiError("invalid_request", message, param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        kind: dict[int, Kind] = {
            401: "authentication", 404: "not_found", 405: "method_not_allowed", 413: "too_large"
        }
        message = str(exc.detail)
        headers = exc.headers
        if exc.status_code == 405:
            # Starlette names the methods of the first route on the path; say them all.
            allow = ", ".join(_methods_on(app, request.scope))
            headers = {**(headers or {}), "Allow": allow}
            message = f"{request.method} is not allowed on {request.url.path}; use {allow}"
        return error_response(
            dialect_of(request.url.path),
            ApiError(kind.get(exc.status_code, "invalid_request"), message),
            headers,
        )

    @app.exception_handler(json.JSONDecodeError)
    async def json_error(request: Request, exc: json.JSONDecodeError) -> Response:
        return error_response(
            dialect_of(request.url.path), ApiError("invalid_request", "the request body is not valid JSON")
        )

    metrics.install(app)  # after the guard: outermost, so refusals are counted too
    app.include_router(admin.router, responses=error_responses("native"))
    app.include_router(openai.router, prefix="/api/openai/v1", responses=error_responses("openai"))
    app.include_router(
        anthropic.router, prefix="/api/anthropic/v1", responses=error_responses("anthropic")
    )
    app.include_router(anthropic.probes)
    app.include_router(
        gemini.router, prefix="/api/gemini/v1beta", responses=error_responses("gemini")
    )
    app.include_router(webapp.make_router(webapp.WEB_DIR))
    app.openapi = lambda: _schema(app)
    return app


def _methods_on(app: FastAPI, scope: Scope) -> list[str]:
    """The methods some route takes on the path of `scope` (a request's)."""
    return [
        method
        for method in ("GET", "POST", "PUT", "PATCH", "DELETE")
        if any(
            route.matches({**scope, "method": method})[0] == Match.FULL
            for route in app.router.routes
        )
    ]


def _schema(app: FastAPI) -> dict[str, Any]:
    """FastAPI's OpenAPI schema, less the 422 it documents for invalid requests: those answer
    400 in the dialect's own shape (validation_error above), documented on each route."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for operations in schema["paths"].values():
            for operation in operations.values():
                operation["responses"].pop("422", None)
        schemas = schema.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema
