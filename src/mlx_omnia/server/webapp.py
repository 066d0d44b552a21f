"""The web app: one page at `/` and its assets under `/static/`, package data read into memory
when the server starts.

The page talks to the server through its public HTTP API only (OpenAI chat completions, /admin/*).
Its files carry no secrets, so they are served without an API key (the page asks for the key
when the API answers 401)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import Response

from mlx_omnia.server.errors import ApiError

WEB_DIR = Path(__file__).resolve().parent / "web"

MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
}

# Revalidate on every load (the ETag makes that a 304): an upgraded server never runs stale JS.
HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}

# Everything the page loads comes from this server; no inline script, no plugins, no framing.
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"
)


@dataclass(frozen=True)
class Asset:
    body: bytes
    media_type: str
    etag: str


def read_assets(web_dir: Path = WEB_DIR) -> dict[str, Asset]:
    """Every servable file under `web_dir` (the known types), read once: the server serves what
    it started with, even after a reinstall replaces or removes the files on disk."""
    assets: dict[str, Asset] = {}
    for path in sorted(web_dir.rglob("*")):
        if path.is_file() and path.suffix in MEDIA_TYPES:
            body = path.read_bytes()
            etag = f'"{hashlib.sha256(body).hexdigest()[:32]}"'
            assets[path.relative_to(web_dir).as_posix()] = Asset(body, MEDIA_TYPES[path.suffix], etag)
    return assets


def make_router(web_dir: Path = WEB_DIR) -> APIRouter:
    """The page and its assets, as read from `web_dir` now; an unknown name (a traversal, an
    unknown type, a directory) is a 404."""
    assets = read_assets(web_dir)
    router = APIRouter(include_in_schema=False)

    def serve(request: Request, name: str, extra: dict[str, str] | None = None) -> Response:
        asset = assets.get(name)
        if asset is None:
            raise ApiError("not_found", f"no static file {name!r}")
        headers = {**HEADERS, **(extra or {}), "ETag": asset.etag}
        if request.headers.get("if-none-match") == asset.etag:
            return Response(status_code=304, headers=headers)
        return Response(asset.body, media_type=asset.media_type, headers=headers)

    @router.get("/")
    async def index(request: Request) -> Response:
        return serve(request, "index.html", {"Content-Security-Policy": CSP})

    @router.get("/static/{name:path}")
    async def static(request: Request, name: str) -> Response:
        return serve(request, name)

    return router
