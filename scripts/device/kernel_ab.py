"""A/B of kernel variants in one process: the same checkpoint loaded once per arm, each variant's
patch applied while its kernels are built, the arms' pipelined decode steps timed in rotating
rounds (so the GPU's and host's state drifts alike for all), medians printed.

    python3 scripts/device/kernel_ab.py VARIANT[,VARIANT...] [SHAPE [LAYERS [ROUNDS]]]   (qwen3-30b-a3b 48 8)

(V1+V2: an arm with both patches.)

VARIANT names a patch in VARIANTS (the "B" arm is the tree as it is; "A0", "A1"... the patched).
The patch must act while the kernels are built: each model's first steps (which trace its
compiled step and so build its launches) run under it, and the launchers' caches are cleared
between the models so none reuses another's kernels. TRACE=1: every model's chained
launches are stamped as scripts/device/layer_trace.py stamps them, and each arm's last step is
reported that way (GPU times, whatever the host does)."""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

STEPS = 40


def kernel_modules() -> tuple[Any, ...]:
    """The modules that build CUDA kernel sources (their headers, launchers, cuda_kernel)."""
    from mlx_omnia.engine.core.kernels.attention_step import cuda as att_cuda
    from mlx_omnia.engine.core.kernels.moe import cuda as moe_cuda
    from mlx_omnia.engine.core.kernels.qmv import cuda as qmv_cuda

    return qmv_cuda, moe_cuda, att_cuda


@contextmanager
def patched(mod: Any, name: str, value: Any) -> Any:
    """mod.name is `value` meanwhile."""
    plain = getattr(mod, name)
    setattr(mod, name, value)
    try:
        yield
    finally:
        setattr(mod, name, plain)


def no_down_l2() -> AbstractContextManager[Any]:
    """The chained experts launches without the gate/up blocks' L2 requests of the down weights."""
    from mlx_omnia.engine.core.kernels.moe import cuda as moe_cuda

    plain = moe_cuda.experts_call

    def call(spec: Any, **kwargs: Any) -> str:
        kwargs.pop("down", None)
        return plain(spec, **kwargs)

    return patched(moe_cuda, "experts_call", call)


WAIT = """    while (load_acquire(count) < n) __nanosleep(100);
    __threadfence();
"""


def header_text(old: str, new: str, count: int = 1) -> AbstractContextManager[Any]:
    """Every kernel header that has `old` (`count` times) with it replaced by `new`: the modules'
    header strings, rendered from the kernels' .cuh files at import (the wait of a chained
    launch's second phase is in common.cuh, which every header starts with; the staging in
    qmv.cuh, which the experts' header extends). Every variant here still applies: each builds
    the same kernels as before the sources moved to .cu/.cuh files (issue 27)."""
    stack = ExitStack()
    hits = 0
    for mod in kernel_modules():
        for name in ("QMV_HEADER", "MOE_HEADER", "ATTENTION_HEADER"):
            text = getattr(mod, name, None)
            if text is not None and old in text:
                assert text.count(old) == count, (mod.__name__, name)
                stack.enter_context(patched(mod, name, text.replace(old, new)))
                hits += 1
    assert hits, old
    return stack


def wait_no_fence() -> AbstractContextManager[Any]:
    """The waits without the fence after the count is seen: the acquire load already orders
    the block's later reads (after the barrier), which go to L2 (ld.global.cg) anyway."""
    return header_text(WAIT, WAIT.replace("    __threadfence();\n", ""))


def poll_32ns() -> AbstractContextManager[Any]:
    """The waits poll every ~32 ns instead of ~100 (wake-up granularity against L2 traffic)."""
    return header_text(WAIT, WAIT.replace("__nanosleep(100)", "__nanosleep(32)"))


STAGE_NORM = """  auto load_x = [x4](int i) -> uint4 {
    if constexpr (CG) return __ldcg(x4 + i); else return x4[i];
  };
  float inv = 1.f;
  if constexpr (NORM) inv = row_inv_rms<T, K, NWARPS, CG>(x, eps);
"""
STAGE_NORM_ONCE = """  // ONCE: one 16-byte piece of the row a thread, read once for the sum of squares and the
  // staging (its norm weights requested before the block-wide sum), the same sums as row_inv_rms.
  constexpr bool ONCE = NORM && XCH <= NWARPS * 32;
  uint4 x_once = make_uint4(0u, 0u, 0u, 0u), g_once = make_uint4(0u, 0u, 0u, 0u);
  auto load_x = [x4, &x_once](int i) -> uint4 {
    if constexpr (ONCE) return x_once;
    else if constexpr (CG) return __ldcg(x4 + i); else return x4[i];
  };
  auto load_g = [g4, &g_once](int i) -> uint4 {
    if constexpr (ONCE) return g_once; else return g4[i];
  };
  float inv = 1.f;
  if constexpr (ONCE) {
    __shared__ float red_once[NWARPS];
    float ss = 0.f;
    if (tid < XCH) {
      if constexpr (CG) x_once = __ldcg(x4 + tid); else x_once = x4[tid];
      g_once = g4[tid];
      float f[8];
      unpack8<T>(x_once, f);
#pragma unroll
      for (int j = 0; j < 8; ++j) ss = fmaf(f[j], f[j], ss);
    }
    ss = warp_sum(ss);
    if ((tid & 31) == 0) red_once[tid >> 5] = ss;
    __syncthreads();
    float total = 0.f;
#pragma unroll
    for (int i = 0; i < NWARPS; ++i) total += red_once[i];
    inv = rsqrtf(total / K + eps);
  } else if constexpr (NORM) {
    inv = row_inv_rms<T, K, NWARPS, CG>(x, eps);
  }
"""


def norm_once() -> AbstractContextManager[Any]:
    """The norm prologue (stage_rows with NORM) reads the row once: where the row has no more
    16-byte pieces than the block has threads, each thread keeps its piece (and its norm weights)
    in registers from the sum of squares to the staging (one dependent read of x fewer)."""
    stack = ExitStack()
    stack.enter_context(header_text(STAGE_NORM, STAGE_NORM_ONCE))
    stack.enter_context(header_text("rms_scale8<T>(f, g4[i], inv)", "rms_scale8<T>(f, load_g(i), inv)", 2))
    return stack


def all_chunks(spec: Any) -> Any:
    """spec's launch with every chunk of a lane (up to 4 a row) requested before the input is
    staged: the sums keep their order (dc04482 and 6b1ba4f, backed out unmeasured)."""
    from dataclasses import replace

    cfg = spec.config
    chunks = spec.k // (8 if spec.bits is None else 128 // spec.bits)
    return replace(spec, launch=replace(cfg, prefetch=cfg.prefetch or min(4, -(-chunks // cfg.lanes))))


def qkv_prefetch_all() -> AbstractContextManager[Any]:
    """project_attend's quantized q/k/v phase requests all of a lane's chunks before staging
    (its 4-warp blocks, 4 an SM, keep one chunk a row in flight until then)."""
    from mlx_omnia.engine.core.kernels.attention_step import cuda as att_cuda

    plain = att_cuda.attend_qkv_spec

    def spec(qkv: Any) -> Any:
        got = plain(qkv)
        return all_chunks(got) if qkv.bits is not None and got.config.rows == 2 else got

    return patched(att_cuda, "attend_qkv_spec", spec)


def project_prefetch_all() -> AbstractContextManager[Any]:
    """RouteExperts' projection phase requests all of a lane's chunks before staging."""
    from mlx_omnia.engine.core.kernels import moe
    from mlx_omnia.engine.core.kernels.moe import cuda as moe_cuda

    plain = moe_cuda.route_experts_project
    return patched(moe, "route_experts_project", lambda project: all_chunks(plain(project)))


def heads_in_one_block() -> AbstractContextManager[Any]:
    """The attention's query heads of a slice in one block (head_split 1), the geometry before
    the split over two blocks became the default (2026-12-05: 1.124x at Qwen3-30B-A3B's
    shape here, bit-equal)."""
    from dataclasses import replace

    from mlx_omnia.engine.core.kernels import attention_step

    plain = attention_step.attention_spec
    return patched(attention_step, "attention_spec", lambda *a: replace(plain(*a), head_split=1))


def router_routes() -> AbstractContextManager[Any]:
    """RouteExperts whose last router block routes and publishes the ids (`local_route`
    False), as before every expert block routing the logits itself became the default
    (2026-12-05: 1.061x here, bit-equal)."""
    from functools import partial

    from mlx_omnia.engine.core.kernels import moe
    from mlx_omnia.engine.core.kernels.moe import cuda as moe_cuda

    return patched(moe, "route_experts_launcher",
                   partial(moe_cuda.route_experts_launcher, local_route=False))


def down_two_rows() -> AbstractContextManager[Any]:
    """RouteExperts' down phase at two output rows a warp: half the down blocks (Qwen3-30B-A3B:
    128 instead of 256), all resident beside the gate/up blocks; the same sums a row."""
    from mlx_omnia.engine.core.kernels.moe import cuda as moe_cuda

    return patched(moe_cuda, "ROUTE_EXPERTS_DOWN_ROWS", 2)


VARIANTS: dict[str, Callable[[], AbstractContextManager[Any]]] = {
    "heads_in_one_block": heads_in_one_block, "router_routes": router_routes,
    "no_down_l2": no_down_l2, "qkv_prefetch_all": qkv_prefetch_all,
    "project_prefetch_all": project_prefetch_all, "wait_no_fence": wait_no_fence,
    "poll_32ns": poll_32ns, "norm_once": norm_once, "down_two_rows": down_two_rows}


@contextmanager
def tagged(tag: str) -> Any:
    """Kernel names suffixed with `tag` while an arm builds: an MLX that keys its compiled
    modules by name alone (before it hashed the source into the name) would otherwise hand the
    second arm the first arm's kernel of the same name."""
    with ExitStack() as stack:
        for mod in kernel_modules():
            build = mod.cuda_kernel
            stack.enter_context(patched(mod, "cuda_kernel", lambda name, *a, _b=build, **k:
                                        _b(f"{name}_{tag}", *a, **k)))
        yield


def combined(spec: str) -> Callable[[], AbstractContextManager[Any]]:
    """A variant by name, or several joined by "+" applied together."""
    parts = [VARIANTS[name] for name in spec.split("+")]

    @contextmanager
    def all_of() -> Any:
        with ExitStack() as stack:
            for part in parts:
                stack.enter_context(part())
            yield

    return all_of


def clear_launchers() -> None:
    for mod in kernel_modules():
        for value in vars(mod).values():
            if callable(value) and hasattr(value, "cache_clear"):
                value.cache_clear()


LAST: dict[int, Any] = {}  # id(seq) -> its last step's logits row


def timed_round(seq: Any, first: int) -> float:
    """Median-free wall time a step over STEPS pipelined steps (one queued ahead)."""
    pending: Any = None
    start = time.perf_counter()
    for t in range(STEPS):
        row = seq.feed([first + t])[-1]
        mx.async_eval(row)
        if pending is not None:
            mx.eval(pending)
        pending = row
    mx.eval(pending)
    LAST[id(seq)] = pending
    return (time.perf_counter() - start) / STEPS


def main() -> None:
    variant = sys.argv[1]
    shape = sys.argv[2] if len(sys.argv) > 2 else "qwen3-30b-a3b"
    layers = int(sys.argv[3]) if len(sys.argv) > 3 else 48
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 8
    trace: Any = None
    if os.environ.get("TRACE") == "1":
        from scripts.device import layer_trace as trace

        trace.patch()
    import mlx_omnia
    from mlx_omnia.bench import shapes

    short = f"{shape}-ab"
    shapes.SHAPES[short] = dict(shapes.SHAPES[shape], num_hidden_layers=layers)
    arms: dict[str, Any] = {}
    bounds = [0]
    with tempfile.TemporaryDirectory() as tmp:
        path = shapes.build_checkpoint(short, Path(tmp) / "m", dtype="bfloat16", quantize=(4, 64))
        mx.clear_cache()  # the build's buffers: each arm holds a whole model
        named = [(f"A{i} {v}", combined(v)) for i, v in enumerate(variant.split(","))]
        for arm, ctx in (*named, ("B tree", nullcontext)):
            clear_launchers()
            tag = arm.split()[0].lower()
            try:
                with ctx(), (tagged(tag) if tag != "b" else nullcontext()):
                    model = mlx_omnia.load(str(path), dtype="bfloat16")
                    seq = model.decoding()
                    mx.eval(seq.feed(list(range(1, 513))), seq.state())
                    timed_round(seq, 7)  # traces the compiled step: builds the launches
            except Exception as exc:  # a variant that cannot build: the others still run
                print(f"{arm}: skipped ({type(exc).__name__}: {exc})")
                if trace is not None:
                    del trace.TRACED[bounds[-1]:]
                continue
            arms[arm] = seq
            if trace is not None:
                bounds.append(len(trace.TRACED))
        times: dict[str, list[float]] = {arm: [] for arm in arms}
        pos = 600
        for r in range(rounds):
            order = list(arms)[r % len(arms):] + list(arms)[:r % len(arms)]
            for arm in order:
                times[arm].append(timed_round(arms[arm], pos))
            pos += STEPS
        if trace is not None:
            snap = [arr * 1 for _, arr in trace.TRACED]
            mx.eval(snap)
            for i, arm in enumerate(arms):
                print(f"== {arm}: the last step's chained launches")
                trace.PHASE_ROWS.clear()
                trace.TOP_ENDS.clear()
                part = range(bounds[i], bounds[i + 1])
                trace.report([(trace.TRACED[j][0], np.array(snap[j])) for j in part], layers)
    ref = np.array(LAST[id(arms["B tree"])].astype(mx.float32))
    same: set[str] = set()
    for arm, seq in arms.items():  # every arm was fed the same tokens
        got = np.array(LAST[id(seq)].astype(mx.float32))
        if np.array_equal(got, ref):
            same.add(arm)
        print(f"{arm:24s} last logits: {'the same bits' if arm in same else 'DIFFER'}"
              f" as the tree's (max |diff| {float(np.abs(got - ref).max()):.3g})")
    b = statistics.median(times["B tree"])
    for arm, v in times.items():
        print(f"{arm:24s} step median {statistics.median(v) * 1e6:8.1f} us  "
              f"rounds {' '.join(f'{x * 1e6:.0f}' for x in v)}")
    for arm, v in times.items():
        if arm != "B tree":
            print(f"B / {arm.split()[0]} step time {b / statistics.median(v):.4f}")
    print(f"({shape}, {layers} layers, {rounds} rounds of {STEPS} steps, arms rotated)")
    # The fastest arm that gives the tree's bits and beats it by more than WIN (for a script
    # that goes on with it, e.g. run.sh X's bench): "none" where no arm does.
    win = float(os.environ.get("WIN", "1.02"))
    fast = [(statistics.median(v), arm) for arm, v in times.items()
            if arm in same and arm != "B tree" and b / statistics.median(v) > win]
    print(f"WINNER: {min(fast)[1].split(maxsplit=1)[1] if fast else 'none'}")


if __name__ == "__main__":
    main()
