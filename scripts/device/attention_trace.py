"""Where the decode attention kernel's time goes inside one launch: the kernel's source with
clock64() stamps at its phase boundaries (thread 0 of each block), run as a chain of LAYERS
launches on their own caches, evaluated together (as decode runs them); the stamps of one launch in the middle
of the chain are printed as the median time from the block's start to each mark, and the merge
(the last block of a kv head) separately.

    python3 scripts/device/attention_trace.py [KV_HEADS,... [LENGTH [CAPACITY [chained]]]]

`chained`: the attention as the second phase of project_attend (q/k/v projections, affine 4-bit
g64 from a 2048-wide input, in the same launch); "wait" is then the wait for the projections.

The instrumented source is built here by text edits of ATTENTION_DEVICE; the engine's kernel
is not changed."""

from __future__ import annotations

import os
import statistics
import sys
from typing import Any

import mlx.core as mx
import numpy as np

from mlx_omnia.engine.core.kernels import cuda_kernel
from mlx_omnia.engine.core.kernels.attention_step import cuda as att
from mlx_omnia.engine.core.kernels.cuda_common import HEADER
from mlx_omnia.engine.core.kernels.qmv.cuda import (
    QMV_HEADER,
    QmvSpec,
    blocks_of,
    chain_source,
    chain_wait,
)

LAYERS, H, D = 24, 32, 128
MARKS = [  # (text the stamp goes after, its name)
    ("  if (n <= 0) return;\n", "start"),
    ("  wait_published(wait, wait_for);\n", "rows issued, waited"),
    ("    if (r < n && t0 + r == pos) vr[u] = ld_new<CG>(reinterpret_cast<const uint4*>(v_new + kvh * D) + c);\n  }\n", "q/k issued"),
    ("  __syncthreads();\n  if (hh == 0 && pos < t0 + KPB) {", "norm+rope"),
    ("      for (int g = 0; g < GB; ++g) p[g][r] = sc[g] * scale;\n    }\n  }\n  __syncthreads();\n", "scores"),
    ("    if (lane == 0) { stat[g][0] = m; stat[g][1] = l; }\n  }\n  __syncthreads();\n", "softmax"),
    ("        dst[1] = make_float4(o[g][4], o[g][5], o[g][6], o[g][7]);\n      }\n    }\n  }\n  __syncthreads();\n", "values"),
    ("    part_ml[((size_t)split * H + kvh * G + hoff + tid) * 2 + 1] = stat[tid][1];\n  }\n", "partials stored"),
    ("  __syncthreads();\n  if (!last) return;\n", "counted"),
    ("    if (lane == 0) stat[g][1] = l;\n  }\n  __syncthreads();\n", "merge: weights"),
]
END = "    dst[2] = from_f<T>(acc[o].z / l); dst[3] = from_f<T>(acc[o].w / l);\n  }\n"
SLOTS = 16


def instrumented(chained: bool = False) -> str:
    src = att.ATTENTION_DEVICE
    src = src.replace("int block, const int* wait = nullptr, int wait_for = 0) {",
                      "int block, const int* wait = nullptr, int wait_for = 0, long long* tr = nullptr) {\n"
                      "  long long c0 = clock64();\n"
                      "  long long g0; asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(g0));\n"
                      f"  if (threadIdx.x == 0) tr[(size_t)block * {SLOTS} + {SLOTS - 2}] = g0;\n"
                      "#define GEND if (threadIdx.x == 0) { long long g1; asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(g1)); "
                      f"tr[(size_t)block * {SLOTS} + {SLOTS - 1}] = g1; }}\n"
                      f"#define ST(i) if (threadIdx.x == 0) tr[(size_t)block * {SLOTS} + (i)] = clock64() - c0;\n", 1)
    for i, (anchor, _) in enumerate(MARKS):
        assert src.count(anchor) == 1, anchor
        src = src.replace(anchor, anchor + f"  ST({i + 1});\n" + ("  GEND;\n" if i == 7 else ""))
    assert src.count(END) == 1
    src = src.replace(END, END + f"  __syncthreads();\n  ST({len(MARKS) + 1});\n  GEND;\n")
    return (QMV_HEADER if chained else HEADER) + src


def project_attend(spec: att.AttentionStepSpec, header: str) -> tuple[Any, int, Any]:
    """The traced project_attend kernel, its grid (blocks) and a maker of one layer's q/k/v
    inputs (x, weights, norm weight); the attention's trace rows are its own blocks' (ticket -
    the q/k/v blocks)."""
    hkv = spec.n_kv_heads
    qkv = QmvSpec(dtype=mx.bfloat16, k=2048, rows=(H * D, hkv * D, hkv * D), bits=4,
                  group_size=64, norm_eps=1e-6)
    first = att.attend_qkv_spec(qkv)
    nb1, nb2 = blocks_of(first), att.blocks(spec)
    att_inputs = [n for n in spec.input_names() if n not in ("q", "k_new", "v_new", "counters")]
    names = ("x", *first.input_names()[1:], *att_inputs, "heads", "counters")
    second = att.attention_call(spec, block=f"t - {nb1}", coherent=True, wait=chain_wait(nb1),
                                names={"k_new": "k", "v_new": "v", "counters": "heads"})
    assert second.endswith(");\n")
    source = chain_source(nb1, first.source(block="t", names={"y0": "q", "y1": "k", "y2": "v"}),
                          second[:-3] + ", trace);\n", nb2)
    kernel = cuda_kernel(f"omnia_project_attend_trace_{spec.tag()}", names,
                         ("q", "k", "v", "part_o", "part_ml", "out", "next_pos", "trace"), source,
                         header)

    def inputs() -> list[mx.array]:
        made = [(mx.random.normal((1, 1, 2048)) * 2).astype(mx.bfloat16)]
        for n in first.rows:
            w = (mx.random.normal((n, 2048)) * 0.05).astype(mx.bfloat16)
            made += list(mx.quantize(w, group_size=64, bits=4))
        made.append((1 + 0.1 * mx.random.normal((2048,))).astype(mx.bfloat16))
        return made

    return kernel, nb1 + nb2, inputs


def main() -> None:
    kvs = [int(v) for v in sys.argv[1].split(",")] if len(sys.argv) > 1 else [4, 8]
    length = int(sys.argv[2]) if len(sys.argv) > 2 else 600
    cap = int(sys.argv[3]) if len(sys.argv) > 3 else 768
    chained = len(sys.argv) > 4 and sys.argv[4] == "chained"
    header = instrumented(chained)
    for hkv in kvs:
        spec = att.AttentionStepSpec(dtype=mx.bfloat16, n_heads=H, n_kv_heads=hkv, head_dim=D,
                                     capacity=cap, scale=D ** -0.5, q_eps=1e-6, k_eps=1e-6)
        nb = att.blocks(spec)
        # the engine's launches keep the partials in a shared scratch; here they are outputs
        parts = [(spec.slices, H, D), (spec.slices, H, 2)]
        body = att.attention_call(spec).replace("blockIdx.x);", "blockIdx.x, nullptr, 0, trace);")
        if chained:
            kernel, grid_blocks, make = project_attend(spec, header)
            qkv_inputs = [make() for _ in range(LAYERS)]  # per layer: weights not left in L2
            shapes = [(1, 1, H * D), (1, 1, hkv * D), (1, 1, hkv * D), *parts,
                      *att.output_shapes(spec, (1, 1)), (nb, SLOTS)]
            dtypes = [mx.bfloat16] * 3 + [mx.float32, mx.float32, *att.output_dtypes(spec), mx.int64]
            chain_counters = [mx.zeros((4,), dtype=mx.int32) for _ in range(LAYERS)]
            mx.eval(qkv_inputs, chain_counters)
        else:
            kernel = cuda_kernel(f"omnia_attention_trace_{spec.tag()}", spec.input_names(),
                                 ("part_o", "part_ml", "out", "next_pos", "trace"), body, header)
            grid_blocks, qkv_inputs, chain_counters = nb, [], []
            shapes = [*parts, *att.output_shapes(spec, (1, 1)), (nb, SLOTS)]
            dtypes = [mx.float32, mx.float32, *att.output_dtypes(spec), mx.int64]
        qw = (1 + 0.1 * mx.random.normal((D,))).astype(mx.bfloat16)
        inv_freq = 1.0 / (1e6 ** (mx.arange(0, D, 2, dtype=mx.float32) / D))
        caches = [(mx.random.normal((1, hkv, cap, D)).astype(mx.bfloat16),
                   mx.random.normal((1, hkv, cap, D)).astype(mx.bfloat16)) for _ in range(LAYERS)]
        counters = [mx.zeros((hkv,), dtype=mx.int32) for _ in range(LAYERS)]
        # POS: "host" (a 0-d array made on the host: MLX's CUDA allocator serves arrays of <= 8
        # bytes from a pool of managed memory), "gpu" (0-d, computed by a GPU op: the same pool),
        # "wide" (a (4,) array: device memory)
        mode = os.environ.get("POS", "wide")
        pos = {"host": lambda: mx.array(length, dtype=mx.int32),
               "gpu": lambda: mx.array(length - 1, dtype=mx.int32) + 1,
               "wide": lambda: mx.array([length, 0, 0, 0], dtype=mx.int32)}[mode]()
        mx.eval(caches, counters, qw, inv_freq)

        def step(q: mx.array, k: mx.array, v: mx.array) -> list[mx.array]:
            traces = []
            acc = q
            for i, ((kc, vc), cnt) in enumerate(zip(caches, counters, strict=True)):
                if chained:
                    ins = [*qkv_inputs[i], qw, qw, inv_freq, kc, vc, pos, cnt, chain_counters[i]]
                else:
                    ins = [acc, k, v, qw, qw, inv_freq, kc, vc, pos, cnt]
                outs = kernel(inputs=ins, output_shapes=shapes, output_dtypes=dtypes,
                              grid=(grid_blocks * att.THREADS, 1, 1),
                              threadgroup=(att.THREADS, 1, 1), init_value=0)
                acc = outs[-3]
                traces.append(outs[-1])
            return [acc, *traces]

        q = mx.random.normal((1, 1, H * D)).astype(mx.bfloat16)
        k = mx.random.normal((1, 1, hkv * D)).astype(mx.bfloat16)
        v = mx.random.normal((1, 1, hkv * D)).astype(mx.bfloat16)
        for _ in range(5):
            out = step(q, k, v)
            mx.eval(out)
        tr = np.array(out[1 + LAYERS // 2])
        slices = spec.slices
        active = (length + spec.keys_per_block) // spec.keys_per_block
        rows = [tr[kvh * slices + s] for kvh in range(hkv) for s in range(active)]
        print(f"{'project_attend, ' if chained else ''}pos {mode}: kv {hkv}, {length} rows, capacity {cap}: {nb} blocks, {hkv * active} active "
              f"(clock64 cycles from the block's start, median / max over active blocks; "
              f"1 us = 1,980 cycles at the H200's clock)")
        starts = [int(r[SLOTS - 2]) for r in rows]
        ends = [int(r[SLOTS - 1]) for r in rows]
        print(f"  launch span (globaltimer, first active start to last end): "
              f"{(max(ends) - min(starts)) / 1e3:.2f} us; starts spread {(max(starts) - min(starts)) / 1e3:.2f} us")
        names = [name for _, name in MARKS] + ["merge: done"]
        for i, name in enumerate(names, start=1):
            vals = [int(r[i]) for r in rows if r[i] > 0]
            if vals:
                print(f"  {name:20s} {statistics.median(vals):9,.0f} {max(vals):9,.0f}  ({len(vals)} blocks)")


if __name__ == "__main__":
    main()
