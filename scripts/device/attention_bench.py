"""Decode attention per layer, in a compiled 36-layer step (as decode runs it): the bound kernel,
`wide` (the same kernel with 640 slices a kv head before any walks: a block a chunk up to
40,960 rows, as it was before slices walked their chunks), and the core path (the two-launch
kernel it replaced measured 29.0 / 36.2 us at 512 / 4000 rows on 2026-12-03;
scripts/_attention_v1.py in git history up to c9a50ab).

    python3 scripts/device/attention_bench.py [VARIANT,... [LENGTH,...]]"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import mlx.core as mx

from mlx_omnia.engine.core.cache import OFFSET_SLOTS, StaticKVCache
from mlx_omnia.engine.core.kernels.attention_step import ATTENTION_STEP
from mlx_omnia.engine.core.kernels.attention_step import cuda as att
from mlx_omnia.engine.core.kernels.cuda_common import HEADER, header, render
from mlx_omnia.engine.core.layers import AttentionStep, RmsNorm, Rope


@contextmanager
def slices(n: int) -> Iterator[None]:
    """Kernels built meanwhile take up to n slices a kv head before walking."""
    saved = att.MAX_SLICES, att.ATTENTION_DEVICE, att.ATTENTION_HEADER, att.cuda_kernel
    plain = att.cuda_kernel
    # MLX keeps a compiled kernel by name: these get names of their own
    att.cuda_kernel = lambda name, *rest: plain(f"{name}_slices{n}", *rest)  # type: ignore[assignment]
    att.MAX_SLICES = n
    att.ATTENTION_DEVICE = header(render("attention_step/attention_step.cuh", MAX_SLICES=n,
                                         OFFSET_SLOTS=OFFSET_SLOTS))
    att.ATTENTION_HEADER = HEADER + att.ATTENTION_DEVICE
    att.launcher.cache_clear()
    try:
        yield
    finally:
        att.MAX_SLICES, att.ATTENTION_DEVICE, att.ATTENTION_HEADER, att.cuda_kernel = saved
        att.launcher.cache_clear()

LAYERS, H, HKV, D = 36, 32, 8, 128


def norm() -> RmsNorm:
    n = RmsNorm(D, 1e-6)
    n.weight = (1 + 0.1 * mx.random.normal((D,))).astype(mx.bfloat16)
    return n


def caches(length: int) -> list[StaticKVCache]:
    cap = ((length + 300 + 255) // 256) * 256
    out = []
    for _ in range(LAYERS):
        k = mx.random.normal((1, HKV, cap, D)).astype(mx.bfloat16)
        v = mx.random.normal((1, HKV, cap, D)).astype(mx.bfloat16)
        out.append(StaticKVCache(k, v, length))
    mx.eval([c.arrays() for c in out])
    return out


def measure(name: str, project, length: int) -> None:
    cs = caches(length)
    state = [c.state for c in cs]

    def step(q: mx.array, k: mx.array, v: mx.array) -> mx.array:
        acc = q
        for c in cs:
            acc = project(acc, k, v, c)
        return acc

    f = mx.compile(step, inputs=state, outputs=state)
    q = mx.random.normal((1, 1, H * D)).astype(mx.bfloat16)
    k = mx.random.normal((1, 1, HKV * D)).astype(mx.bfloat16)
    v = mx.random.normal((1, 1, HKV * D)).astype(mx.bfloat16)
    for _ in range(10):
        mx.eval(f(q, k, v))
    n = 100
    t = time.perf_counter()
    for _ in range(n):
        out = f(q, k, v)
        mx.async_eval(out)
    mx.eval(out)
    dt = (time.perf_counter() - t) / n / LAYERS * 1e6
    print(f"  {name:8s} L={length:5d}: {dt:6.2f} us per layer", flush=True)


def main() -> None:
    decl = AttentionStep(n_heads=H, n_kv_heads=HKV, head_dim=D, q_norm=norm(), k_norm=norm(),
                         rope=Rope(D, base=1e6))
    with slices(640):
        wide = ATTENTION_STEP.build(decl)
    variants = {"kernel": ATTENTION_STEP.build(decl), "wide": wide, "core": decl.reference_project()}
    names = sys.argv[1].split(",") if len(sys.argv) > 1 else list(variants)
    lengths = [int(n) for n in sys.argv[2].split(",")] if len(sys.argv) > 2 else [512, 2000, 4000]
    for length in lengths:
        for name, project in variants.items():
            if name not in names:
                continue
            with slices(640) if name == "wide" else nullcontext():
                measure(name, project, length)


if __name__ == "__main__":
    main()
