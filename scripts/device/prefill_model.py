"""Probe (development): time to first token of one long prompt through `generate`, with the
prefill bindings of issue 31 on and off, one process, one checkpoint: the MoE experts grouped by
expert (kernels/grouped_experts; off = core/moe.py GROUPED_ROWS_PER_EXPERT past any call) and
quantized Linears dequantized for many rows (kernels/dequantized_matmul; off = DEQUANTIZED_ROWS
past any call, the network bound again).

    python3 scripts/device/prefill_model.py [--model qwen3-30b-a3b] [--quantize 4] [--tokens 2048,8192]"""
from __future__ import annotations

import argparse
import time

from probe import random_model

from mlx_omnia import GenerationOptions
from mlx_omnia.engine.core import moe
from mlx_omnia.engine.core.binder import bind_layers
from mlx_omnia.engine.core.kernels import dequantized_matmul, qmv

OFF = 10**12


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-30b-a3b")
    p.add_argument("--quantize", type=int, default=4)
    p.add_argument("--tokens", default="2048,8192")
    p.add_argument("--runs", type=int, default=2)
    args = p.parse_args()
    with random_model(args.model, args.quantize) as model:
        options = GenerationOptions(max_tokens=1, temperature=0.0)
        grouped, dense_rows = moe.GROUPED_ROWS_PER_EXPERT, dequantized_matmul.DEQUANTIZED_ROWS

        def arm(group: bool, dequantize: bool) -> None:
            moe.GROUPED_ROWS_PER_EXPERT = grouped if group else OFF
            rows = dense_rows if dequantize else OFF
            dequantized_matmul.DEQUANTIZED_ROWS = qmv.DEQUANTIZED_ROWS = rows
            bind_layers(model.network)

        arms = {"both on": (True, True), "grouped off": (False, True),
                "dequantized off": (True, False), "both off": (False, False)}
        warm = model.tokenizer.decode(list(range(7, 519)))
        for n_ids in (int(t) for t in args.tokens.split(",")):
            text = model.tokenizer.decode([7 + (i * 31) % 5000 for i in range(n_ids)])
            n = len(model.encode(text))
            row = []
            for label, setting in arms.items():
                arm(*setting)
                model.generate(warm, options)
                best = float("inf")
                for _ in range(args.runs):
                    t = time.perf_counter()
                    model.generate(text, options)
                    best = min(best, time.perf_counter() - t)
                row.append(f"{label} {best * 1e3:8.1f} ms ({n / best:8,.0f} tok/s)")
            print(f"{args.model} {args.quantize or 'bf16'}-bit, prompt {n:6d}: " + "  ".join(row),
                  flush=True)


if __name__ == "__main__":
    main()
