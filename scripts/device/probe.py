"""What the probes in this folder share (imported as a sibling: a script's own folder is first
on sys.path): timing a call on the device, and a random-weight model of a bench shape."""
from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx

from mlx_omnia import Model, load
from mlx_omnia.bench.shapes import build_checkpoint


def timed(fn: Callable[[], mx.array], n: int) -> float:
    """Milliseconds per call of `fn`, evaluated, after two warm-up calls."""
    for _ in range(2):
        mx.eval(fn())
    mx.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        mx.eval(fn())
    mx.synchronize()
    return (time.perf_counter() - t) / n * 1e3


@contextmanager
def random_model(shape: str, quantize: int | None) -> Iterator[Model]:
    """`load` of a random-weight checkpoint of the bench shape, bf16, written `quantize`-bit
    (g64) when given, in a temporary directory removed afterwards."""
    with tempfile.TemporaryDirectory() as tmp:
        path = build_checkpoint(shape, Path(tmp) / "ckpt", dtype="bfloat16",
                                quantize=(quantize, 64) if quantize else None)
        yield load(path)
