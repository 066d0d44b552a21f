"""The timeline of a decode step's chained launches (globaltimer stamps, ns): for each launch of
project_attend / project_route / experts_chain / chained_qmv, when its blocks started, when the
second phase's blocks were released by the wait, when they ended, and the gaps between
launches. The engine's decode step runs as the bench runs it (compiled, pipelined one step
ahead); the stamps of the last step are printed.

    python3 scripts/device/layer_trace.py [SHAPE [LAYERS [FMT]]]   (qwen3-30b-a3b 12 q4)

How: this script replaces chain_source (qmv/cuda.py, used by every chained launch) with one that
stamps each block's start, release (the wait's end, recorded by a patched wait_published) and
end into the launch's counters array past its 4 counter slots, which it enlarges: the
counters are the binding's own in-place array, so the stamps survive the compiled step. The
engine's kernels are not changed."""

from __future__ import annotations

import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

MAX_BLOCKS = 2048
STEPS = 40
TRACED: list[tuple[str, mx.array]] = []

STAMP = 'asm volatile("mov.u64 %0, %%globaltimer;" : "=l"({}));'
WAIT_OLD = """    while (load_acquire(count) < n) __nanosleep(100);
    __threadfence();
"""
WAIT_NEW = WAIT_OLD + "    " + STAMP.format("omnia_released") + "\n"


def traced_header(header: str) -> str:
    assert header.count(WAIT_OLD) == 1
    anchor = "__device__ __forceinline__ void wait_published("
    return header.replace(WAIT_OLD, WAIT_NEW).replace(
        anchor, "__shared__ long long omnia_released;\n" + anchor, 1)


def traced_chain_source(nb1: int, first: str, second: str, nb2: int) -> str:
    from mlx_omnia.engine.core.kernels.qmv.cuda import chain_wait

    assert chain_wait(nb1) in second
    return (
        "long long omnia_t0; " + STAMP.format("omnia_t0") + "\n"
        "__shared__ int ticket;\n"
        "int* count = const_cast<int*>(counters);\n"
        "if (threadIdx.x == 0) { ticket = atomicAdd(count, 1); omnia::omnia_released = -1; }\n"
        "__syncthreads();\n"
        "const int t = ticket;\n"
        "long long* omnia_tr = reinterpret_cast<long long*>(count + 4) + (size_t)t * 3;\n"
        f"if (t < {nb1}) {{\n{first}"
        "  __threadfence();\n  __syncthreads();\n"
        "  if (threadIdx.x == 0) { atomicAdd(count + 1, 1); long long e; " + STAMP.format("e")
        + " omnia_tr[0] = omnia_t0; omnia_tr[1] = 0; omnia_tr[2] = e; }\n"
        "  return;\n"
        "}\n"
        f"{second}"
        "__syncthreads();\n"
        "if (threadIdx.x == 0) { long long e; " + STAMP.format("e")
        + " omnia_tr[0] = omnia_t0; omnia_tr[1] = omnia::omnia_released; omnia_tr[2] = e; }\n"
        f"if (threadIdx.x == 0 && atomicAdd(count + 2, 1) == {nb2 - 1}) {{\n"
        "  count[0] = 0;\n  count[1] = 0;\n  count[2] = 0;\n}\n"
    )


def patch() -> None:
    from mlx_omnia.engine.core.kernels import attention_step, moe, qmv
    from mlx_omnia.engine.core.kernels.attention_step import cuda as att_cuda
    from mlx_omnia.engine.core.kernels.moe import cuda as moe_cuda
    from mlx_omnia.engine.core.kernels.qmv import cuda as qmv_cuda

    for mod in (qmv_cuda, att_cuda, moe_cuda):
        mod.chain_source = traced_chain_source  # type: ignore[attr-defined]
        for name in ("QMV_HEADER", "MOE_HEADER"):
            if hasattr(mod, name):
                setattr(mod, name, traced_header(getattr(mod, name)))

    plain_counters = qmv.launch_counters

    def counters(n: int) -> mx.array:
        # the chained launches' counters (3, 4 or 6 slots; their stamps go past 4 slots, or 6
        # for RouteExperts); the attention's per-head counters (n_kv_heads x MAX_HEAD_SPLIT:
        # 8 or 16 at the benched shapes) are left as they are: with the heads split over two
        # blocks they use slots past 4, which were read as stamps (2026-12-05)
        if n not in (3, 4, 6):
            return plain_counters(n)
        arr = mx.zeros((max(n, 4) + 2 * 3 * MAX_BLOCKS,), dtype=mx.int32)
        TRACED.append((sys._getframe(1).f_code.co_name.removesuffix("_build"), arr))
        return arr

    for mod in (qmv, moe, attention_step):
        mod.launch_counters = counters  # type: ignore[attr-defined]
    plain_kernel = moe_cuda.cuda_kernel

    def kernel(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("omnia_route_experts"):
            args = (*args[:2], traced_route_experts(args[2]), *args[3:])
        return plain_kernel(name, *args, **kwargs)

    moe_cuda.cuda_kernel = kernel  # type: ignore[attr-defined]


# RouteExperts (OMNIA_ROUTE_EXPERTS=0 leaves it out): its own four-phase body, stamped the same way past its
# 6 counter slots; its phases' first tickets, read from the source
PHASES: list[int] = []
OFFSET = {"route_experts": 6}


def traced_route_experts(source: str) -> str:
    import re

    PHASES[:] = [0, *(int(n) for n in re.findall(r"^if \(t < (\d+)\)", source, re.M))]
    end = ("if (threadIdx.x == 0) { long long e; " + STAMP.format("e")
           + " omnia_tr[0] = omnia_t0; omnia_tr[1] = omnia::omnia_released; omnia_tr[2] = e; }\n")
    first = "if (threadIdx.x == 0) ticket = atomicAdd(count, 1);\n"
    last = "if (threadIdx.x == 0 && atomicAdd(count + 2, 1)"
    assert source.count(first) == 1 and source.count(last) == 1 and len(PHASES) == 4
    return (
        "long long omnia_t0; " + STAMP.format("omnia_t0") + "\n"
        + source.replace(first, "if (threadIdx.x == 0) { ticket = atomicAdd(count, 1); "
                                "omnia::omnia_released = 0; }\n")
        .replace("const int t = ticket;\n", "const int t = ticket;\nlong long* omnia_tr = "
                 "reinterpret_cast<long long*>(count + 6) + (size_t)t * 3;\n")
        .replace("  return;\n", end + "  return;\n")
        .replace(last, "__syncthreads();\n" + end + last)
    )


def main() -> None:
    shape = sys.argv[1] if len(sys.argv) > 1 else "qwen3-30b-a3b"
    layers = int(sys.argv[2]) if len(sys.argv) > 2 else 12
    fmt = sys.argv[3] if len(sys.argv) > 3 else "q4"
    patch()
    import mlx_omnia
    from mlx_omnia.bench import shapes

    short = f"{shape}-trace"
    shapes.SHAPES[short] = dict(shapes.SHAPES[shape], num_hidden_layers=layers)
    with tempfile.TemporaryDirectory() as tmp:
        written = None if fmt == "bf16" else (4, 64)
        path = shapes.build_checkpoint(short, Path(tmp) / "m", dtype="bfloat16", quantize=written)
        model = mlx_omnia.load(str(path), dtype="bfloat16")
        seq = model.decoding()
        out = seq.feed(list(range(1, 513)))
        mx.eval(out, seq.state())
        pending: Any = None
        host: list[float] = []
        for _rep in range(2):  # the second round is timed
            start = time.perf_counter()
            for t in range(STEPS):
                h0 = time.perf_counter()
                row = seq.feed([7 + t])[-1]
                mx.async_eval(row)
                host.append(time.perf_counter() - h0)
                if pending is not None:
                    mx.eval(pending)
                pending = row
            wall = (time.perf_counter() - start) / STEPS
        enqueue = statistics.median(host[STEPS:])
        print(f"pipelined step {wall * 1e6:.1f} us, host time to queue a step (feed + async_eval, "
              f"median) {enqueue * 1e6:.1f} us ({layers} layers)")
        snap = [a * 1 for _, a in TRACED]
        mx.eval(pending, snap)
    report([(name, np.array(s)) for (name, _), s in zip(TRACED, snap, strict=True)], layers)


PHASE_ROWS: dict[str, list[list[float]]] = {}
TOP_ENDS: dict[str, list[list[float]]] = {}


def report_phases(name: str, tr: np.ndarray) -> None:
    """Per phase of a four-phase launch: when its blocks started, were released, ended (us
    from the launch's first start); the medians over the step's launches print at the end."""
    tr = tr[: int(np.nonzero(tr[:, 2] > 0)[0].max()) + 1] if (tr[:, 2] > 0).any() else tr[:0]
    if not len(tr):
        return
    start = int(tr[:, 0].min())
    bounds = [*PHASES, len(tr)]
    row: list[float] = []
    for p in range(4):
        ph = tr[bounds[p]:bounds[p + 1]]
        rel = ph[ph[:, 1] > 0]
        row += [(int(ph[:, 0].max()) - start) / 1e3,
                (statistics.median(rel[:, 1].tolist()) - start) / 1e3 if len(rel) else 0.0,
                (int(ph[:, 2].max()) - start) / 1e3]
    PHASE_ROWS.setdefault(name, []).append(row)


def report(traced: list[tuple[str, np.ndarray]], layers: int) -> None:
    launches = []
    for name, arr in traced:
        tr = arr[OFFSET.get(name, 4):][: 2 * 3 * MAX_BLOCKS].view(np.int64).reshape(-1, 3)
        if name in OFFSET:  # A: the projection; B: the three phases after it
            report_phases(name, tr)
        tr = tr[tr[:, 2] > 0]
        if len(tr):
            launches.append((name, tr))
    launches.sort(key=lambda nt: int(nt[1][:, 0].min()))
    if not launches:
        print("no chained launches were stamped (no CUDA kernel bound?)")
        return
    t0 = int(launches[0][1][:, 0].min())
    us = 1e-3
    print(f"{len(launches)} chained launches in the last step ({layers} layers); times in us from "
          f"the first block's start of each launch (A: first phase, B: second phase)")
    per_kind: dict[str, list[list[float]]] = {}
    prev_end = None
    for i, (name, tr) in enumerate(launches):
        start = int(tr[:, 0].min())
        end = int(tr[:, 2].max())
        a = tr[tr[:, 1] == 0]
        b = tr[tr[:, 1] != 0]
        rel = b[b[:, 1] > 0]
        gap = (start - prev_end) * us if prev_end is not None else float("nan")
        row = [
            gap, (end - start) * us, len(a), len(b),
            (int(a[:, 0].max()) - start) * us if len(a) else 0.0,
            statistics.median((a[:, 2] - a[:, 0]).tolist()) * us if len(a) else 0.0,
            (int(a[:, 2].max()) - start) * us if len(a) else 0.0,
            (int(b[:, 0].min()) - start) * us if len(b) else 0.0,
            (int(b[:, 0].max()) - start) * us if len(b) else 0.0,
            (statistics.median(rel[:, 1].tolist()) - start) * us if len(rel) else 0.0,
            (int(rel[:, 1].max()) - start) * us if len(rel) else 0.0,
            statistics.median((b[:, 2] - np.maximum(b[:, 1], b[:, 0])).tolist()) * us if len(b) else 0.0,
            (statistics.median(b[:, 2].tolist()) - start) * us if len(b) else 0.0,
        ]
        # the B blocks' last 8 ends (the merging blocks end last), us from the launch's start
        ends = sorted(((b[:, 2] - start) * us).tolist(), reverse=True)[:8] if len(b) else []
        TOP_ENDS.setdefault(name, []).append(ends + [float("nan")] * (8 - len(ends)))
        per_kind.setdefault(name, []).append(row)
        if i < 8 or i >= len(launches) - 2:
            print(f"  @{(start - t0) * us:8.1f} {name:16s} gap {row[0]:5.1f} span {row[1]:5.1f} | "
                  f"A {row[2]:3d} blocks, last start {row[4]:5.1f}, median run {row[5]:5.1f}, last end "
                  f"{row[6]:5.1f} | B {row[3]:3d}, starts {row[7]:5.1f}-{row[8]:5.1f}, released "
                  f"median {row[9]:5.1f} max {row[10]:5.1f}, median run after release {row[11]:5.1f}")
        prev_end = end
    print(f"step span (first chained start to last chained end): "
          f"{(max(int(t[:, 2].max()) for _, t in launches) - t0) * us:.1f} us")
    cols = ["gap before", "span", "A blocks", "B blocks", "A last start", "A median run",
            "A last end", "B first start", "B last start", "B released med", "B released max",
            "B run after release", "B end median"]
    print("medians over the step's launches of each kind (us):")
    for name, rows in per_kind.items():
        med = [statistics.median(r[j] for r in rows if r[j] == r[j]) if any(r[j] == r[j] for r in rows)
               else float("nan") for j in range(len(cols))]
        print(f"  {name} ({len(rows)} launches)")
        for c, v in zip(cols, med, strict=True):
            print(f"    {c:22s} {v:8.1f}")
    for name, rows in TOP_ENDS.items():
        med = [statistics.median(r[j] for r in rows) for j in range(8)]
        print(f"  {name}: B blocks' last 8 ends (medians by rank) {' '.join(f'{v:.1f}' for v in med)}")
    for name, rows in PHASE_ROWS.items():
        print(f"  {name} by phase (medians of {len(rows)} launches; us from the launch's start): "
              f"blocks {[b - a for a, b in itertools.pairwise(PHASES)]} + the rest")
        for p, phase in enumerate(("projection", "router+route", "gate/up", "down")):
            m = [statistics.median(r[3 * p + j] for r in rows) for j in range(3)]
            print(f"    {phase:14s} last start {m[0]:6.1f}  released median {m[1]:6.1f}  "
                  f"last end {m[2]:6.1f}")


if __name__ == "__main__":
    main()
