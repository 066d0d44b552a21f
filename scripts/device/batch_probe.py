"""Probe (development): aggregate decode tok/s of Batch at several stream counts, compiled step
on/off, against mlx-lm's BatchGenerator, on a random checkpoint of a bench shape."""
from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from mlx_omnia import Batch, GenerationOptions, load
from mlx_omnia.bench.shapes import build_checkpoint

shape = sys.argv[1]
quant = int(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2] != "0" else None
streams = [int(x) for x in (sys.argv[3] if len(sys.argv) > 3 else "1,2,4,8,16").split(",")]
gen_tokens = int(os.environ.get("GEN", "128"))
prompt_len = int(os.environ.get("PROMPT", "128"))
work = Path(tempfile.mkdtemp())
path = build_checkpoint(shape, work / shape, dtype="bfloat16",
                        quantize=(quant, 64) if quant else None)
model = load(path, dtype="bfloat16")
vocab = int(model.config["vocab_size"])
ban = {i: -100.0 for i in model.tokenizer.eos_token_ids}


def prompts(n: int) -> list[list[int]]:
    key = mx.random.key(n)
    return [mx.random.randint(300, vocab - 300, (prompt_len,), key=mx.random.split(key, n)[i]).tolist() for i in range(n)]


def omnia(n: int, compiled: bool) -> float:
    os.environ["OMNIA_COMPILE"] = "auto" if compiled else "0"
    batch = Batch(model)
    opts = GenerationOptions(max_tokens=gen_tokens, logit_bias=ban)
    for p in prompts(n):
        batch.add(model.tokenizer.decode(p), opts)
    t0, toks = None, 0
    while len(batch):
        events = batch.step()
        if t0 is None:
            if batch.running == n:
                mx.synchronize(); t0 = time.perf_counter()
            continue
        toks += sum(len(pc.token_ids) for _, ev in events if not isinstance(ev, Exception) for pc in ev)
    return toks / (time.perf_counter() - t0)


def mlx_lm(n: int) -> float:
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.utils import load_model
    global lm
    if "lm" not in globals():
        lm, _ = load_model(path)
    gen = BatchGenerator(lm, max_tokens=gen_tokens, stop_tokens=[], completion_batch_size=max(32, n), prefill_batch_size=n)
    gen.insert(prompts(n), [gen_tokens] * n)
    t0, toks, seen = None, 0, set()
    while responses := gen.next_generated():
        if t0 is None:
            seen.update(r.uid for r in responses)
            if len(seen) == n:
                mx.synchronize(); t0 = time.perf_counter()
            continue
        toks += len(responses)
    return toks / (time.perf_counter() - t0)


print(f"{shape} q{quant} prompt {prompt_len} gen {gen_tokens} device {mx.default_device()}")
for n in streams:
    for rep in range(2):
        a = omnia(n, True); b = omnia(n, False); c = mlx_lm(n)
        print(f"streams {n:3d} rep {rep}: omnia compiled {a:8.1f}  eager {b:8.1f}  mlx-lm {c:8.1f} tok/s  ratio {max(a, b) / c:.2f}", flush=True)
