"""Probe (development): the batch's whole decode step (BatchCache.forward, compiled) for a
random-weight checkpoint at 1-16 slots, next to the single-sequence Decoding step, so the
per-step cost of batching shows; with --parts, the step's attention alone (the projections' cost
is the difference).

    python3 scripts/device/batch_step.py [--model qwen3-4b] [--quantize 4] [--context 512]
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from mlx_omnia import load
from mlx_omnia.bench.shapes import build_checkpoint
from mlx_omnia.engine.generate.batch import BatchCache, batch_forward, layout_of
from mlx_omnia.engine.generate.loop import Decoding


def timed(fn, n: int) -> float:
    for _ in range(3):
        mx.eval(fn())
    mx.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        out = fn()
        mx.async_eval(out)
    mx.eval(out)
    mx.synchronize()
    return (time.perf_counter() - t) / n * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-4b")
    p.add_argument("--quantize", type=int, default=4)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--slots", default="1,2,4,8,16")
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = build_checkpoint(args.model, Path(tmp) / args.model, dtype="bfloat16",
                                quantize=(args.quantize, 64) if args.quantize else None)
        model = load(str(path))
        network = model.network
        prompt = list(range(1, args.context + 1))
        dec = Decoding(network, ())
        dec.feed(prompt, last_only=True)
        mx.eval(dec.state())
        rows = dec.rows()
        mx.eval([a for r in rows for a in r])
        token = mx.array([[7]], dtype=mx.int32)
        print(f"{args.model} {args.quantize or 'bf16'}-bit, context {args.context}")
        one = timed(lambda: [dec.step(token), *dec.state()], args.steps)
        print(f"single Decoding step: {one:.2f} ms")
        forward = batch_forward(network)
        for slots in (int(s) for s in args.slots.split(",")):
            cache = BatchCache(rows, layout_of(network), dec.length)
            for _ in range(slots - 1):
                cache.put(rows, dec.length)
            mx.eval(cache.state())
            ids = mx.full((cache.slots, 1), 7, dtype=mx.int32)

            def step(cache: BatchCache = cache, ids: mx.array = ids) -> list[mx.array]:
                # keep the lengths where they are: the step's cost at this context
                lengths = list(cache.lengths)
                logits = cache.forward(forward, ids)
                cache.lengths = lengths
                cache._sync()  # pyright: ignore[reportPrivateUsage]
                return [logits, *cache.state()]

            ms = timed(step, args.steps)
            print(f"batch step, {cache.slots} slots ({cache.used} used), capacity {cache.capacity}: "
                  f"{ms:.2f} ms ({cache.used / ms * 1e3:.0f} tok/s; x{ms / one:.2f} the single step)")


if __name__ == "__main__":
    main()
