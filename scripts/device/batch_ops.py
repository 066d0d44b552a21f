"""Probe (development): where a batched decode step's time goes on the GPU: MLX's quantized
matmul at M = 1..16 rows for Qwen3-4B's matrices, the batch cache's scatter and masked attention."""
from __future__ import annotations

import time

import mlx.core as mx


def bench(fn, n=50):
    for _ in range(5):
        mx.eval(fn())
    mx.synchronize()
    t = time.perf_counter()
    outs = [fn() for _ in range(n)]
    mx.eval(outs)
    mx.synchronize()
    return (time.perf_counter() - t) / n * 1e3


H, I, Q, KV, V, L = 2560, 9728, 4096, 1024, 151936, 36
mats = {"qkv": (H, Q + 2 * KV), "o": (Q, H), "gate_up": (H, 2 * I), "down": (I, H), "head": (H, V)}
qw = {}
for name, (k, n) in mats.items():
    w = mx.random.normal((n, k), dtype=mx.bfloat16) * 0.02
    qw[name] = mx.quantize(w, group_size=64, bits=4)
    mx.eval(qw[name])
print("quantized_matmul ms per call (bf16 x, 4-bit g64 W); per-step total = 36 layers x (qkv,o,gate_up,down) + head")
for m in (1, 2, 4, 8, 16):
    total = 0.0
    row = []
    for name, (k, n) in mats.items():
        x = mx.random.normal((m, k), dtype=mx.bfloat16)
        wq, s, b = qw[name]
        ms = bench(lambda x=x, wq=wq, s=s, b=b: mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=64, bits=4))
        row.append(f"{name} {ms:.3f}")
        total += ms * (1 if name == "head" else L)
    print(f"M={m:2d}: " + "  ".join(row) + f"  -> step {total:.2f} ms")
# dequantized bf16 matmul for comparison at M=8,16
for m in (8, 16):
    total = 0.0
    for name, (k, n) in mats.items():
        x = mx.random.normal((m, k), dtype=mx.bfloat16)
        w = mx.dequantize(*qw[name], group_size=64, bits=4)
        mx.eval(w)
        ms = bench(lambda x=x, w=w: x @ w.T)
        total += ms * (1 if name == "head" else L)
    print(f"bf16 dense M={m}: step {total:.2f} ms")
for b in (2, 8, 16):
    for cap in (256, 2048):
        keys = mx.random.normal((b, 8, cap, 128), dtype=mx.bfloat16)
        vals = mx.random.normal((b, 8, cap, 128), dtype=mx.bfloat16)
        k1 = mx.random.normal((b, 8, 1, 128), dtype=mx.bfloat16)
        q = mx.random.normal((b, 32, 1, 128), dtype=mx.bfloat16)
        off = mx.array([cap // 2 + i for i in range(b)], dtype=mx.int32)
        mx.eval(keys, vals, k1, q, off)
        cols = mx.broadcast_to(off[:, None, None, None], k1.shape)
        scatter = bench(lambda: mx.put_along_axis(keys, cols, k1, axis=2))
        mask = mx.arange(cap)[None, None, None, :] <= off[:, None, None, None]
        sdpa = bench(lambda: mx.fast.scaled_dot_product_attention(q, keys, vals, scale=0.088, mask=mask))
        sdpa_nomask = bench(lambda: mx.fast.scaled_dot_product_attention(q, keys, vals, scale=0.088))
        print(f"B={b:2d} cap={cap}: scatter {scatter:.3f} ms  sdpa+mask {sdpa:.3f} ms  sdpa no mask {sdpa_nomask:.3f} ms  (x36 layers x2 scatters: {36 * (2 * scatter + sdpa):.2f} ms)")
