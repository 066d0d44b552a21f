"""Specialized kernels, one package per operation (never per model).

A kernel binds to a layer declaration only when its `*_applies(...)` predicate accepts every
declared property, and only on the backend it was written for: the CUDA kernels here are
`mx.fast.cuda_kernel` sources, compiled by MLX with NVRTC on first use, and never bind on the CPU
or on Metal. Kernel objects are made lazily (creating one raises on a build without CUDA)."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any, cast

import mlx.core as mx


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
        header=header, ensure_row_contiguous=True,
    )
    return cast(Callable[..., Any], kernel)
