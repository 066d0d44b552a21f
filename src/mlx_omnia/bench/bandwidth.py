"""The memory bandwidth a decode step's floor divides by: the best of several kernels measured
in this process, and the card's datasheet figure beside it.

A copy reads n bytes and writes n bytes (bandwidth = 2n / its median time); a reduction reads n
bytes (n / its time), as a decode step mostly reads. The floor uses the best of them, so a
decode rate is never compared with a bandwidth that another kernel on the same machine beats."""

from __future__ import annotations

import os
import statistics
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

import mlx.core as mx
import numpy as np

from mlx_omnia.bench.measure import evaluate

SPEC_ENV = "OMNIA_BENCH_SPEC_BANDWIDTH"  # bytes/s, for a device the table below lacks

# Datasheet memory bandwidth (NVIDIA's product pages), bytes/s, by a substring of the name
# nvidia-smi reports; the first match wins, so the more specific names come first.
SPEC_BANDWIDTH: tuple[tuple[str, float], ...] = (
    ("H200", 4.8e12),
    ("GH200", 4.0e12),
    ("H100 NVL", 3.9e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),  # SXM5, 80 GB HBM3 ("NVIDIA H100 80GB HBM3")
    ("A100-SXM4-80GB", 2.039e12),
    ("A100", 1.555e12),
    ("L40S", 0.864e12),
)

CUDA_HEADER = """
__device__ __forceinline__ float4 ld_plain(const float4* p) { return *p; }
__device__ __forceinline__ float4 ld_ldg(const float4* p) { return __ldg(p); }
__device__ __forceinline__ float4 ld_ldcs(const float4* p) { return __ldcs(p); }
__device__ __forceinline__ void st_plain(float4* p, float4 v) { *p = v; }
__device__ __forceinline__ void st_stcs(float4* p, float4 v) { __stcs(p, v); }
"""
# grid-stride over float4s, `unroll` loads in flight per thread, then their stores
CUDA_COPY_SOURCE = """
    const unsigned long long n4 = {n4}ULL;
    const float4* s = reinterpret_cast<const float4*>(src);
    float4* d = reinterpret_cast<float4*>(dst);
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + {last} * stride < n4; i += {unroll} * stride) {{
        float4 v[{unroll}];
        #pragma unroll
        for (int k = 0; k < {unroll}; ++k) v[k] = ld_{load}(s + i + k * stride);
        #pragma unroll
        for (int k = 0; k < {unroll}; ++k) st_{store}(d + i + k * stride, v[k]);
    }}
    for (; i < n4; i += stride) st_{store}(d + i, ld_{load}(s + i));
"""
@dataclass(frozen=True)
class CudaVariant:
    """One CUDA copy kernel: its loads and stores, loads in flight, launch shape."""

    load: str          # plain, ldg (read-only cache path) or ldcs (streaming)
    store: str         # plain or stcs (streaming)
    unroll: int
    blocks_per_sm: int
    threads: int

    @property
    def name(self) -> str:
        return (f"cuda_copy_{self.load}_{self.store}_u{self.unroll}_"
                f"{self.blocks_per_sm}x{self.threads}")


CUDA_VARIANTS = (
    CudaVariant("plain", "plain", 4, 8, 256),
    CudaVariant("ldcs", "stcs", 4, 8, 256),
    CudaVariant("ldcs", "stcs", 8, 4, 512),
    CudaVariant("ldg", "plain", 8, 2, 1024),
)
# float4 sums (one atomic add a warp) measured 120-217 GB/s on an H100 on 2026-12-06, a tenth of
# the copies: something in them was wrong, so they were removed (in git history, 6336bd5).


@dataclass(frozen=True)
class Bandwidth:
    """Copy bandwidths (bytes/s) by method, the best of them, and the card's datasheet figure."""

    methods: dict[str, float]
    errors: dict[str, str]
    card: str | None
    spec: float | None

    @property
    def best(self) -> float:
        return max(self.methods.values())

    @property
    def best_method(self) -> str:
        return max(self.methods, key=self.methods.__getitem__)

    def to_json(self) -> dict[str, Any]:
        return {"methods": self.methods, "errors": self.errors, "best": self.best,
                "best_method": self.best_method, "card": self.card, "spec": self.spec}


def _median_time(run: Callable[[], None], reps: int) -> float:
    times: list[float] = []
    for i in range(reps + 2):
        start = time.perf_counter()
        run()
        if i >= 2:  # two warm-ups
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def mlx_add(nbytes: int, reps: int = 10) -> float:
    """MLX's own elementwise kernel: b = a + 1 over float32 (what the floor used until 2026-12)."""
    a = mx.random.uniform(shape=(max(nbytes // 4, 1),))
    evaluate(a)

    def run() -> None:
        evaluate(a + 1.0)

    return 2 * 4 * max(nbytes // 4, 1) / _median_time(run, reps)


def mlx_sum(nbytes: int, reps: int = 10) -> float:
    """MLX's reduction over float32: reads n bytes, writes one number."""
    a = mx.random.uniform(shape=(max(nbytes // 4, 1),))
    evaluate(a)

    def run() -> None:
        evaluate(mx.sum(a))

    return 4 * max(nbytes // 4, 1) / _median_time(run, reps)


def cuda_kernel_bandwidth(variant: CudaVariant, nbytes: int, reps: int = 10) -> float:
    """One CUDA copy kernel's bandwidth (mx.fast.cuda_kernel), checked to copy its input."""
    n4 = max(nbytes // 16, 1)
    source = CUDA_COPY_SOURCE.format(n4=n4, unroll=variant.unroll, last=variant.unroll - 1,
                                     load=variant.load, store=variant.store)
    kernel: Any = mx.fast.cuda_kernel(
        name=f"omnia_bench_{variant.name}_{n4}", input_names=["src"], output_names=["dst"],
        source=source, header=CUDA_HEADER, ensure_row_contiguous=True,
    )
    a = mx.random.uniform(shape=(4 * n4,))
    evaluate(a)
    threads = _cuda_sm_count() * variant.blocks_per_sm * variant.threads

    def launch() -> mx.array:
        out = cast(list[mx.array], kernel(
            inputs=[a], output_shapes=[a.shape], output_dtypes=[mx.float32],
            grid=(threads, 1, 1), threadgroup=(variant.threads, 1, 1),
        ))
        return out[0]

    if not bool(mx.array_equal(launch(), a).item()):
        raise RuntimeError(f"{variant.name} did not copy its input")

    def run() -> None:
        evaluate(launch())

    return 2 * 16 * n4 / _median_time(run, reps)


def host_copy(nbytes: int, reps: int = 10, threads: int | None = None) -> float:
    """numpy's copy (memcpy, vectorised), split over `threads` threads (numpy releases the GIL
    while it copies): the CPU's copy bandwidth, for the CPU backend."""
    workers = threads or os.cpu_count() or 1
    n = max(nbytes // 4, workers)
    src = np.random.default_rng(0).random(n, dtype=np.float32)
    dst = np.empty_like(src)
    bounds = np.linspace(0, n, workers + 1).astype(int)
    spans = list(zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True))

    def copy(span: tuple[int, int]) -> None:
        np.copyto(dst[span[0]:span[1]], src[span[0]:span[1]])

    with ThreadPoolExecutor(workers) as pool:

        def run() -> None:
            list(pool.map(copy, spans))

        seconds = _median_time(run, reps)
    if not np.array_equal(dst, src):
        raise RuntimeError("the host copy did not copy its input")
    return 2 * 4 * n / seconds


def device_info() -> dict[str, Any]:
    """MLX's facts about the default device (name, memory, ...), {} where it has none."""
    try:
        return dict(cast(dict[str, Any], mx.device_info()))
    except (AttributeError, RuntimeError):
        return {}


def host_read(nbytes: int, reps: int = 10, threads: int | None = None) -> float:
    """numpy's sum over float32 (vectorised), split over `threads` threads: the CPU's read
    bandwidth, which a decode step (reading weights, writing little) is bound by."""
    workers = threads or os.cpu_count() or 1
    n = max(nbytes // 4, workers)
    src = np.random.default_rng(0).random(n, dtype=np.float32)
    bounds = np.linspace(0, n, workers + 1).astype(int)
    spans = list(zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True))

    def read(span: tuple[int, int]) -> float:
        return float(src[span[0]:span[1]].sum())

    with ThreadPoolExecutor(workers) as pool:

        def run() -> None:
            list(pool.map(read, spans))

        seconds = _median_time(run, reps)
    return 4 * n / seconds


def _cuda_sm_count() -> int:
    for key in ("multi_processor_count", "multiprocessor_count", "sm_count"):
        count = device_info().get(key)
        if isinstance(count, int) and count > 0:
            return count
    return 132  # an H100 SXM's; a grid-stride loop is correct for any count


def card_name() -> str | None:
    """The GPU's product name (MLX's device_info, else nvidia-smi), or None without one."""
    name = device_info().get("device_name")
    if isinstance(name, str) and name:
        return name
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True, text=True, check=True, timeout=20,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    names = [line.strip() for line in done.stdout.splitlines() if line.strip()]
    return names[0] if names else None


def spec_bandwidth(card: str | None) -> float | None:
    """The datasheet figure: $OMNIA_BENCH_SPEC_BANDWIDTH (bytes/s) if set, else by card name."""
    if given := os.environ.get(SPEC_ENV):
        return float(given)
    if card is None:
        return None
    return next((value for key, value in SPEC_BANDWIDTH if key in card), None)


def measure(nbytes: int, *, backend: str | None) -> Bandwidth:
    """Every copy method that applies to this backend; a method that fails is reported, not
    fatal, as long as one succeeds."""
    methods: dict[str, Callable[[int], float]] = {"mlx_add": mlx_add, "mlx_sum": mlx_sum}
    if backend == "cuda":
        for variant in CUDA_VARIANTS:
            methods[variant.name] = partial(cuda_kernel_bandwidth, variant)
    if backend in ("cpu", None):
        methods["host_memcpy"] = host_copy
        methods["host_sum"] = host_read
    measured: dict[str, float] = {}
    errors: dict[str, str] = {}
    for name, method in methods.items():
        try:
            measured[name] = method(nbytes)
        except Exception as e:  # a failed method is reported beside the others
            errors[name] = f"{type(e).__name__}: {e}"
        mx.clear_cache()
    if not measured:
        raise RuntimeError(f"no copy method ran: {errors}")
    card = card_name() if backend == "cuda" else None
    return Bandwidth(measured, errors, card, spec_bandwidth(card))
