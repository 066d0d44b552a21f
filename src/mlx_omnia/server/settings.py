"""Server settings (command line and environment)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path


def physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def default_memory_limit() -> int:
    """A safe share of physical memory: 70 %, leaving room for the OS and KV caches."""
    total = physical_memory()
    return int(total * 0.7) if total is not None else 8 * 1024**3


def default_prefix_memory() -> int:
    """The prefix cache's memory tier: 5 % of physical memory, at most 2 GiB (it comes on top
    of the models' budget, from what that leaves for the OS and KV caches)."""
    total = physical_memory()
    return min(2 * 1024**3, int(total * 0.05)) if total is not None else 512 * 1024**2


@dataclass
class Settings:
    host: str = "127.0.0.1"
    port: int = 8642
    api_key: str | None = None
    memory_limit: int = field(default_factory=default_memory_limit)
    idle_ttl: float = 30 * 60.0
    max_queue: int = 64
    max_concurrent: int = 8  # generations of one model decoded together (continuous batching)
    # The prefix cache: blocks of prompt keys/values in memory and on disk (0 turns a tier off);
    # prefix_dir None is the platform's cache dir (mlx_omnia.default_prefix_dir).
    prefix_memory: int = field(default_factory=default_prefix_memory)
    prefix_disk: int = 8 * 1024**3
    prefix_dir: Path | None = None
    prefix_block: int = 256
    # A quantized KV cache for every model loaded (8 or 4 bits; None: as computed); a model
    # whose attention cannot take it is served with a plain cache, and the log says so.
    kv_bits: int | None = None
    kv_group_size: int = 64
    # Whether a request may ask for its own KV format (`kv_bits`: 8 or 4; each model's group
    # size); off, such a request is refused (400) and every answer caches as its model does.
    request_kv_bits: bool = False
    cors_origins: tuple[str, ...] = ()
    model: str | None = None  # preloaded at start
    max_body_bytes: int = 8 * 1024 * 1024
