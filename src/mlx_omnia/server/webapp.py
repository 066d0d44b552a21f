"""The web app: one page at `/` and its assets under `/static/`, served from package data.

The page talks to the server through its public HTTP API only (OpenAI chat completions, /admin/*).
Its files carry no secrets, so they are served without an API key (the page asks for the key
when the API answers 401)."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

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

router = APIRouter(include_in_schema=False)


def _asset(name: str) -> Path:
    """The file `name` under the web directory; anything else (a traversal, an unknown type,
    a directory) is a 404."""
    path = (WEB_DIR / name).resolve()
    if not path.is_relative_to(WEB_DIR) or path.suffix not in MEDIA_TYPES or not path.is_file():
        raise ApiError("not_found", f"no static file {name!r}")
    return path


@router.get("/")
async def index() -> FileResponse:
    return FileResponse(
        _asset("index.html"),
        media_type=MEDIA_TYPES[".html"],
        headers={**HEADERS, "Content-Security-Policy": CSP},
    )


@router.get("/static/{name:path}")
async def static(name: str) -> FileResponse:
    path = _asset(name)
    return FileResponse(path, media_type=MEDIA_TYPES[path.suffix], headers=HEADERS)


# Everything the page loads comes from this server; no inline script, no plugins, no framing.
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"
)
