"""Specialized kernels, one package per operation (never per model).

A kernel binds to a layer declaration only when its `*_applies(...)` predicate accepts every
declared property, and only on the backend it was written for: the CUDA kernels here are
`mx.fast.cuda_kernel` sources, compiled by MLX with NVRTC on first use, and never bind on the CPU
or on Metal. Kernel objects are made lazily (creating one raises on a build without CUDA)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Generator
from contextlib import contextmanager
from contextvars import ContextVar
from functools import cache
from pathlib import Path
from typing import Any, cast

import mlx.core as mx


def launch_counters(n: int) -> mx.array:
    """n int32 zeros (at least 4) for a kernel's in-place counters. MLX's CUDA allocator (0.32)
    serves arrays of 8 bytes or less from one pool of managed memory advised read-mostly, where
    a kernel's write invalidates the page for every other scalar in it: 16 bytes or more come
    from ordinary device-resident buffers (see core/cache.py)."""
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
    """float32 words (at least `nbytes`) where a launch keeps what it writes and then reads back
    itself: a chained launch's first-phase results, the attention's partial sums. As outputs
    they cost host time at every launch (MLX 0.32 on CUDA: ~2 us each to make and dispatch,
    against ~0.3 us for an input; scripts/h200_slots.py, 2026-12-04).

    Inside a scratch_scope (one model's bindings) every caller gets the scope's one buffer,
    grown to the largest request (a smaller one stays with the bindings that took it): the
    launches of one model's decode step each read an output of the one before, so they run
    one after another and never at once. Two launches that do not depend on each other, in
    one evaluation, must not share a buffer (MLX may run them concurrently): outside a scope,
    each call gets a buffer of its own. Bindings take theirs when they are built, so a launch
    traced into a compiled step never allocates."""
    from mlx_omnia.engine.core.mxcompat import evaluate

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
    """`#include` of a file holding `header`, named by its SHA-256, for use in place of the header
    text; the header text itself when no such file can be written.

    MLX 0.32's CUDA backend hashes a custom kernel's whole source, header included, at every
    launch (it names the compiled module by that hash): with the header inlined that was 12-28 KB
    hashed per launch, 29 % of `mx.async_eval` for a qwen3-4b decode token (py-spy, H200,
    2026-12-03). Included, the hashed text is the kernel body and this one line. The file name
    carries the content's hash, so a changed header is a changed source to MLX (no stale
    compiled module); an existing file is used only when its content is the header's."""
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
