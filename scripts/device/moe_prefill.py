"""Probe (development): ways to run one MoE block's routed experts over a prefill chunk, timed on
the GPU, each against the per-token gather (today's core reference) for agreement. Shapes are
Qwen3-30B-A3B's (128 experts, top 8, hidden 2048, intermediate 768) in affine 4-bit g64.

    python3 scripts/device/moe_prefill.py [--tokens 2048] [--experts 128] [--top 8]

Arms: `gather` (gather_qmm, a row per token and expert, unsorted); `sorted` (rows sorted by
expert, gather_qmm told so, then unsorted); `segments` (rows sorted, one quantized_matmul per
expert over its run of rows: a host read of the counts); `dequant` (every expert dequantized,
then gather_mm over sorted rows); `grouped` (core/moe.py's ExpertGroups layout: rows grouped by
expert in blocks of 16-64 rows, one gather_qmm over the blocks, M = the block's rows; the layout
made once for both matmuls); `core` (the GateUp and DownCombine declarations' core calls, as a
prefill chunk runs them: the layout made for each)."""
from __future__ import annotations

import argparse
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
from probe import timed

from mlx_omnia.engine.core.moe import DownCombine, ExpertGroups, GateUp

Arm = Callable[[mx.array, mx.array], mx.array]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    e, k, d, f, t = args.experts, args.top, args.hidden, args.inter, args.tokens
    dtype = mx.bfloat16
    mx.random.seed(0)

    def q(shape: tuple[int, ...]) -> tuple[mx.array, mx.array, mx.array]:
        w = (mx.random.normal(shape) * shape[-1] ** -0.5).astype(dtype)
        wq, s, b = mx.quantize(w, group_size=64, bits=4)
        return wq, s, b

    gu, down = q((e, 2 * f, d)), q((e, d, f))
    x = mx.random.normal((t, d)).astype(dtype)
    ids = mx.argsort(mx.random.uniform(shape=(t, e)), axis=-1)[:, :k].astype(mx.uint32)
    weights = mx.softmax(mx.random.normal((t, k)), axis=-1).astype(dtype)
    mx.eval(gu, down, x, ids, weights)

    def mlp(h: mx.array) -> mx.array:
        return nn.silu(h[..., :f]) * h[..., f:]

    def gather(x: mx.array, ids: mx.array) -> mx.array:
        h = mx.gather_qmm(x[:, None, None, :], *gu, rhs_indices=ids, transpose=True,
                          group_size=64, bits=4).squeeze(-2)
        y = mx.gather_qmm(mlp(h)[..., None, :], *down, rhs_indices=ids, transpose=True,
                          group_size=64, bits=4).squeeze(-2)
        return (y * weights[..., None]).sum(axis=-2)

    def order_of(ids: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        flat = ids.flatten()
        order = mx.argsort(flat)
        return order, flat[order], mx.argsort(order)

    def sorted_arm(x: mx.array, ids: mx.array) -> mx.array:
        order, sids, inverse = order_of(ids)
        xs = x[order // k][:, None, :]
        h = mx.gather_qmm(xs, *gu, rhs_indices=sids, transpose=True, group_size=64, bits=4,
                          sorted_indices=True)
        y = mx.gather_qmm(mlp(h), *down, rhs_indices=sids, transpose=True, group_size=64,
                          bits=4, sorted_indices=True)
        y = y.squeeze(-2)[inverse].reshape(t, k, d)
        return (y * weights[..., None]).sum(axis=-2)

    def segments(x: mx.array, ids: mx.array) -> mx.array:
        order, sids, inverse = order_of(ids)
        counts = mx.bincount(sids.astype(mx.int32), minlength=e) if hasattr(mx, "bincount") else (
            (sids[:, None] == mx.arange(e)[None, :]).sum(axis=0))
        xs = x[order // k]
        starts = [0]
        for c in counts.tolist():
            starts.append(starts[-1] + int(c))
        parts: list[mx.array] = []
        for j in range(e):
            a, b = starts[j], starts[j + 1]
            if a == b:
                continue
            h = mx.quantized_matmul(xs[a:b], gu[0][j], gu[1][j], gu[2][j], transpose=True,
                                    group_size=64, bits=4)
            parts.append(mx.quantized_matmul(mlp(h), down[0][j], down[1][j], down[2][j],
                                             transpose=True, group_size=64, bits=4))
        y = mx.concatenate(parts, axis=0)[inverse].reshape(t, k, d)
        return (y * weights[..., None]).sum(axis=-2)

    def dequant(x: mx.array, ids: mx.array) -> mx.array:
        order, sids, inverse = order_of(ids)
        wg = mx.dequantize(*gu, group_size=64, bits=4)
        wd = mx.dequantize(*down, group_size=64, bits=4)
        xs = x[order // k][:, None, :]
        h = mx.gather_mm(xs, wg.swapaxes(-1, -2), rhs_indices=sids, sorted_indices=True)
        y = mx.gather_mm(mlp(h), wd.swapaxes(-1, -2), rhs_indices=sids, sorted_indices=True)
        y = y.squeeze(-2)[inverse].reshape(t, k, d)
        return (y * weights[..., None]).sum(axis=-2)

    def grouped(x: mx.array, ids: mx.array) -> mx.array:
        groups = ExpertGroups.of(ids, e)
        h = mx.gather_qmm(groups.take(x, k), *gu, rhs_indices=groups.expert, transpose=True,
                          group_size=64, bits=4)
        blocks = mx.gather_qmm(mlp(h), *down, rhs_indices=groups.expert, transpose=True,
                               group_size=64, bits=4)
        y = groups.put_back(blocks).reshape(t, k, d)
        return (y * weights[..., None]).sum(axis=-2)

    up_decl, down_decl = GateUp(e, d, f), DownCombine(e, f, d)
    for decl, (wq, s, b) in ((up_decl, gu), (down_decl, down)):
        decl.weight, decl.scales, decl.biases = wq, s, b
        decl.bits, decl.group_size = 4, 64
    core_up, core_down = up_decl.reference(), down_decl.reference()

    def core(x: mx.array, ids: mx.array) -> mx.array:
        return core_down(core_up(x, ids), ids, weights)

    arms: dict[str, Arm] = {"gather": gather, "sorted": sorted_arm, "segments": segments,
                            "dequant": dequant, "grouped": grouped, "core": core}
    ref = gather(x, ids).astype(mx.float32)
    scale = mx.abs(ref).max().item()
    print(f"{t} tokens, {e} experts top {k}, {d}x{f}, 4-bit g64, {mx.default_device()}")
    base = None
    for name, arm in arms.items():
        try:
            diff = mx.abs(arm(x, ids).astype(mx.float32) - ref).max().item() / scale
            ms = timed(lambda arm=arm: arm(x, ids), args.runs)
        except Exception as exc:
            print(f"{name:9s} failed: {exc}")
            continue
        base = base or ms
        print(f"{name:9s} {ms:9.2f} ms  {t / ms * 1e3:10,.0f} tok/s  x{base / ms:5.2f}  "
              f"max diff {diff:.1e} (of the largest output)")


if __name__ == "__main__":
    main()
