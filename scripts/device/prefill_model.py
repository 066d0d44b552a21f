"""Probe (development): time to first token of one long prompt through `generate`, the MoE
experts grouped by expert (kernels/grouped_experts, what binds on a GPU) against a row at a time
(core/moe.py GROUPED_ROWS_PER_EXPERT raised past any call), one process, one checkpoint.

    python3 scripts/device/prefill_model.py [--model qwen3-30b-a3b] [--quantize 4] [--tokens 4096]"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from mlx_omnia import GenerationOptions, load
from mlx_omnia.bench.shapes import build_checkpoint
from mlx_omnia.engine.core import moe


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-30b-a3b")
    p.add_argument("--quantize", type=int, default=4)
    p.add_argument("--tokens", default="2048,4096")
    p.add_argument("--runs", type=int, default=2)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = build_checkpoint(args.model, Path(tmp) / "ckpt", dtype="bfloat16",
                                quantize=(args.quantize, 64) if args.quantize else None)
        model = load(path)
        options = GenerationOptions(max_tokens=1, temperature=0.0)
        grouped = moe.GROUPED_ROWS_PER_EXPERT
        for n in (int(t) for t in args.tokens.split(",")):
            text = model.tokenizer.decode([7 + (i * 31) % 5000 for i in range(n)])
            n = len(model.encode(text))
            warm = model.tokenizer.decode(list(range(7, 519)))
            row = []
            for label, rows in (("grouped", grouped), ("row at a time", 10**12)):
                moe.GROUPED_ROWS_PER_EXPERT = rows
                model.generate(warm, options)  # warm this arm
                best = float("inf")
                for _ in range(args.runs):
                    t = time.perf_counter()
                    model.generate(text, options)
                    best = min(best, time.perf_counter() - t)
                row.append(f"{label} {best * 1e3:9.1f} ms ({n / best:9,.0f} tok/s)")
            print(f"{args.model} {args.quantize or 'bf16'}-bit, prompt {n:6d}: " + "  ".join(row),
                  flush=True)


if __name__ == "__main__":
    main()
