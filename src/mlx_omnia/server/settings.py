"""Server settings (command line and environment)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field


def default_memory_limit() -> int:
    """A safe share of physical memory: 70 %, leaving room for the OS and KV caches."""
    try:
        pages = os.sysconf("SC_PHYS_PAGES")
        page = os.sysconf("SC_PAGE_SIZE")
        return int(pages * page * 0.7)
    except (ValueError, OSError, AttributeError):
        return 8 * 1024**3


@dataclass
class Settings:
    host: str = "127.0.0.1"
    port: int = 8642
    api_key: str | None = None
    memory_limit: int = field(default_factory=default_memory_limit)
    idle_ttl: float = 30 * 60.0
    max_queue: int = 64
    max_concurrent: int = 8  # generations of one model decoded together (continuous batching)
    cors_origins: tuple[str, ...] = ()
    model: str | None = None  # preloaded at start
    max_body_bytes: int = 8 * 1024 * 1024
