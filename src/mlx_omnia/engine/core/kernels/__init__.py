"""Specialized kernels, one package per operation: each kernel is one object registered with the
binding layer for a declaration type, and binds only where its predicate accepts every declared
property, on the backend it was written for (CUDA here: `.cu`/`.cuh` sources compiled by MLX with
NVRTC on first use; docs/kernels.md). This module holds what they share at launch time."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Generator
from contextlib import contextmanager
from contextvars import ContextVar
from functools import cache
from pathlib import Path
from typing import Any, TypeVar, cast

import mlx.core as mx

from mlx_omnia.engine.core.binding import Declaration, Kernel
from mlx_omnia.engine.core.mxcompat import evaluate

D = TypeVar("D", bound=Declaration)


def launch_counters(n: int) -> mx.array:
    """n int32 zeros (at least 4) for a kernel's in-place counters: MLX 0.32 serves 8 bytes or
    less from a read-mostly managed pool, where a kernel's write stalls every other scalar in the
    page; 16 bytes come from device memory (docs/kernels.md, "Launch scratch and counters")."""
    return mx.zeros((max(n, 4),), dtype=mx.int32)


_SCOPE: ContextVar[list[mx.array] | None] = ContextVar("omnia_launch_scratch", default=None)


@contextmanager
def scratch_scope() -> Generator[None]:
    """Bindings built inside share one launch scratch (bind_layers opens one per model)."""
    token = _SCOPE.set([])
    try:
        yield
    finally:
        _SCOPE.reset(token)


def launch_scratch(nbytes: int) -> mx.array:
    """float32 words (at least `nbytes`) a launch writes and reads back itself (an input, which
    costs less host time than an output). Inside a scratch_scope every caller shares the scope's
    one buffer, outside each gets its own (docs/kernels.md, "Launch scratch and counters")."""
    words = max(-(-nbytes // 16) * 4, 4)
    holder = _SCOPE.get()
    if holder is not None and holder and holder[0].size >= words:
        return holder[0]
    buffer = mx.zeros((words,), dtype=mx.float32)
    evaluate(buffer)
    if holder is not None:
        holder[:] = [buffer]
    return buffer


def own_scratch(nbytes: int) -> Callable[[], mx.array]:
    """A launcher's own scratch for calls that bring none (tests, probes): made on first use."""
    made: list[mx.array] = []

    def get() -> mx.array:
        if not made:
            made.append(launch_scratch(nbytes))
        return made[0]

    return get


def cuda_backend() -> bool:
    """True when MLX runs on its CUDA backend (an NVIDIA GPU is the default device)."""
    return bool(mx.cuda.is_available()) and mx.default_device() == mx.gpu


class CudaKernel(Kernel[D]):
    """A kernel for MLX's CUDA backend: it applies where the process runs on CUDA and it fits."""

    def applies(self, decl: D) -> bool:
        return cuda_backend() and self.fits(decl)


@cache
def cuda_kernel(name: str, inputs: tuple[str, ...], outputs: tuple[str, ...], source: str,
                header: str) -> Callable[..., Any]:
    """One `mx.fast.cuda_kernel` per distinct source (MLX caches the compiled module by name, so
    a name is never reused for another source: callers put every baked constant in the name)."""
    kernel: Any = mx.fast.cuda_kernel(
        name=name, input_names=list(inputs), output_names=list(outputs), source=source,
        header=header_include(header), ensure_row_contiguous=True,
    )
    return cast(Callable[..., Any], kernel)


def header_dir() -> Path:
    """Where kernel headers are written for NVRTC to include: $OMNIA_KERNEL_HEADERS, else
    $XDG_CACHE_HOME/mlx-omnia/cuda (~/.cache/mlx-omnia/cuda)."""
    if chosen := os.environ.get("OMNIA_KERNEL_HEADERS"):
        return Path(chosen)
    cache_home = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache_home) / "mlx-omnia" / "cuda"


@cache
def header_include(header: str) -> str:
    """`#include` of a file holding `header`, named by its SHA-256 (else the text itself): MLX
    hashes a kernel's whole source at every launch, so the header is kept out of it, and a changed
    header is a changed name (docs/kernels.md, "Sources")."""
    path = header_dir() / f"omnia-{hashlib.sha256(header.encode()).hexdigest()[:32]}.cuh"
    text = str(path)
    if not text.isascii() or any(c in text for c in '"\\\n'):
        return header
    try:
        if not (path.is_file() and path.read_text(encoding="utf-8") == header):
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            partial.write_text(header, encoding="utf-8")
            partial.replace(path)
    except OSError:
        return header
    return f'#include "{text}"\n'
