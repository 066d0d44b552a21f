"""Probe (development): what a new KV-cache capacity costs a request. An agent's turns each
resend a longer prompt; each new buffer size traces the compiled decode step again. Times
`generate` (first token, then a few steps) for prompts growing by --added tokens, each length
twice (the second run reuses the step's traces), with the cache's capacity policy
(core/cache.py CAPACITY_PARTS) as it is and as it was (whole 256-row steps), and counts the
kernels compiled into MLX_PTX_CACHE_DIR meanwhile.

    python3 scripts/device/capacity_trace.py [--model qwen3-4b] [--quantize 4] [--start 3000]"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from probe import random_model

from mlx_omnia import GenerationOptions
from mlx_omnia.engine.core import cache as kv


def kernels_cached() -> int:
    where = os.environ.get("MLX_PTX_CACHE_DIR")
    return sum(1 for _ in Path(where).rglob("*")) if where and Path(where).is_dir() else -1


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-4b")
    p.add_argument("--quantize", type=int, default=4)
    p.add_argument("--start", type=int, default=3000)
    p.add_argument("--added", type=int, default=755)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--tokens", type=int, default=8)
    args = p.parse_args()
    with random_model(args.model, args.quantize) as model:
        options = GenerationOptions(max_tokens=args.tokens, temperature=0.0,
                                    logit_bias=dict.fromkeys(sorted(model.tokenizer.eos_token_ids), -100.0))
        model.generate(model.tokenizer.decode(list(range(7, 519))), options)  # warm
        for parts, label in ((10**9, "256-row steps (before)"), (kv.CAPACITY_PARTS, "quarters")):
            kv.CAPACITY_PARTS = parts
            print(f"-- capacity policy: {label}")
            base = args.start + (0 if parts > 100 else args.turns * args.added + 512)
            for turn in range(args.turns):
                ids = [7 + (i * 31 + turn) % 5000 for i in range(base + turn * args.added)]
                text = model.tokenizer.decode(ids)
                row = []
                for _ in range(2):
                    before = kernels_cached()
                    t = time.perf_counter()
                    model.generate(text, options)
                    ms = (time.perf_counter() - t) * 1e3
                    row.append(f"{ms:8.1f} ms (+{kernels_cached() - before} kernels)")
                print(f"prompt {len(model.encode(text)):6d}: first {row[0]}  again {row[1]}")


if __name__ == "__main__":
    main()
