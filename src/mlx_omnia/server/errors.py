"""Errors the HTTP layer answers with, independent of dialect; each dialect renders its shape."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal[
    "invalid_request",  # 400
    "authentication",  # 401
    "permission",  # 403
    "not_found",  # 404
    "method_not_allowed",  # 405 (with an Allow header)
    "too_large",  # 413
    "rate_limit",  # 429 (queue full)
    "overloaded",  # 503/529
    "internal",  # 500
    "client_closed",  # 499: the client left before its answer (never seen by it; logs, metrics)
]

STATUS: dict[Kind, int] = {
    "invalid_request": 400,
    "authentication": 401,
    "permission": 403,
    "not_found": 404,
    "method_not_allowed": 405,
    "too_large": 413,
    "rate_limit": 429,
    "overloaded": 503,
    "internal": 500,
    "client_closed": 499,
}


@dataclass
class ApiError(Exception):
    kind: Kind
    message: str
    param: str | None = None
    code: str | None = None  # a machine-readable reason (OpenAI's error.code)

    @property
    def status(self) -> int:
        return STATUS[self.kind]

    def __str__(self) -> str:
        return self.message
