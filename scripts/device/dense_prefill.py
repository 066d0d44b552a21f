"""Probe (development): a dense model's prefill matmuls over a chunk, bf16 weights against
4-bit affine (g64) weights run as MLX's quantized_matmul and as dequantize-then-matmul, timed on
the GPU with each arm's agreement against the bf16 product of the dequantized weights. Shapes are
Qwen3-4B's (hidden 2560, intermediate 9728, 32 query / 8 KV heads of 128, vocab 151936).

    python3 scripts/device/dense_prefill.py [--rows 512,2048,8192] [--runs 5]"""
from __future__ import annotations

import argparse
from collections.abc import Callable

import mlx.core as mx
from probe import timed

H, INTER, Q, KV, V = 2560, 9728, 4096, 1024, 151936
MATS = {"qkv": (Q + 2 * KV, H), "o": (H, Q), "gate_up": (2 * INTER, H), "down": (H, INTER), "head": (V, H)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="512,2048,8192")
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    mx.random.seed(0)
    weights: dict[str, tuple[mx.array, mx.array, mx.array, mx.array]] = {}
    for name, (n, k) in MATS.items():
        w = (mx.random.normal((n, k)) * k ** -0.5).astype(mx.bfloat16)
        wq, s, b = mx.quantize(w, group_size=64, bits=4)
        dense = mx.dequantize(wq, s, b, group_size=64, bits=4).astype(mx.bfloat16)
        mx.eval(wq, s, b, dense)
        weights[name] = (dense, wq, s, b)
    print(f"Qwen3-4B matrices, 4-bit g64, {mx.default_device()}; ms per chunk, one layer's "
          "four matrices (x36) plus the head")
    for m in (int(r) for r in args.rows.split(",")):
        totals = {"bf16": 0.0, "qmm": 0.0, "dequant+mm": 0.0}
        for name, (_, k) in MATS.items():
            dense, wq, s, b = weights[name]
            x = mx.random.normal((m, k)).astype(mx.bfloat16)
            mx.eval(x)
            arms: dict[str, Callable[[], mx.array]] = {
                "bf16": lambda x=x, dense=dense: x @ dense.T,
                "qmm": lambda x=x, wq=wq, s=s, b=b: mx.quantized_matmul(
                    x, wq, s, b, transpose=True, group_size=64, bits=4),
                "dequant+mm": lambda x=x, wq=wq, s=s, b=b: x @ mx.dequantize(
                    wq, s, b, group_size=64, bits=4).T,
            }
            ref = arms["bf16"]().astype(mx.float32)
            scale = mx.abs(ref).max().item()
            row = []
            for arm, fn in arms.items():
                ms = timed(fn, args.runs)
                diff = mx.abs(fn().astype(mx.float32) - ref).max().item() / scale
                totals[arm] += ms * (36 if name != "head" else 1)
                row.append(f"{arm} {ms:7.3f} ms (diff {diff:.1e})")
            print(f"M={m:5d} {name:8s} " + "  ".join(row))
        print(f"M={m:5d} model total: " + "  ".join(
            f"{arm} {ms:8.1f} ms ({m / ms * 1e3:9,.0f} tok/s)" for arm, ms in totals.items()))


if __name__ == "__main__":
    main()
