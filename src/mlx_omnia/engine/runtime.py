"""What the engine runs on: backend, device, versions, the BLAS and the malloc in use."""

from __future__ import annotations

import platform
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import mlx.core as mx

from mlx_omnia import allocator
from mlx_omnia.engine import blas


def _version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def runtime_info() -> dict[str, str | None]:
    """Backend facts for status displays: {"backend": "metal"|"cuda"|"cpu", "device", ...}."""
    on_gpu = mx.default_device() == mx.gpu
    if not on_gpu:
        backend = "cpu"
    elif sys.platform == "darwin":
        backend = "metal"
    else:
        backend = "cuda"
    return {
        "backend": backend,
        "device": str(mx.default_device()),
        "mlx": _version("mlx"),
        "mlx_omnia": _version("mlx-omnia"),
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "blas": blas.loaded,
        "allocator": _allocator(),
    }


_NOTES_EVERY_S = 30.0  # status pages poll; looking for the libraries runs ldconfig
_notes: tuple[float, list[str]] | None = None


def runtime_notes() -> list[str]:
    """What slows this process down that the machine could fix: a missing or not yet loaded
    optimized BLAS (Linux CPU), a jemalloc installed since the start. Looked up again at most
    every 30 s."""
    global _notes
    now = time.monotonic()
    if _notes is None or now - _notes[0] > _NOTES_EVERY_S:
        on_cpu = mx.default_device() != mx.gpu
        _notes = (now, [n for n in (blas.note(on_cpu), allocator.note() if on_cpu else None) if n])
    return list(_notes[1])


def _allocator() -> str:
    """The malloc this process runs on: a preloaded jemalloc's file name, else "system"."""
    path = allocator.loaded()
    return Path(path).name if path else "system"
