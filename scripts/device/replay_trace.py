"""Probe (development): where a cached turn's time to first token goes. An agent resends its
conversation, longer by --added tokens each turn, up to --context tokens; each turn runs uncached
(a Batch without a prefix cache) and from the memory tier (a Batch on one PrefixCache), timed from
`add` to the step that hands out the first token (as `omnia-bench agent-replay` times it, but on
raw text: no chat template). The last turn runs once more from memory with each phase evaluated
and timed on its own (the evaluations serialize what overlaps otherwise: the sum is an upper
bound of the plain run).

    python3 scripts/device/replay_trace.py [--model qwen3-4b] [--quantize 4] [--context 16384]"""
from __future__ import annotations

import argparse
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from mlx_omnia import Batch, GenerationOptions, Model, PrefixCache  # first: it picks the BLAS

import mlx.core as mx  # noqa: I001
from probe import random_model

from mlx_omnia.engine.generate import loop
from mlx_omnia.engine.model import Model as EngineModel

Phases = dict[str, float]


def first_token(batch: Batch, text: str, options: GenerationOptions) -> tuple[float, int]:
    """Seconds from `add` to the step that hands out the first token; the cached tokens."""
    start = time.perf_counter()
    generation = batch.add(text, options)
    first: float | None = None
    while len(batch):
        for _, event in batch.step():
            if isinstance(event, Exception):
                raise event
            if first is None and any(p.token_ids for p in event):
                first = time.perf_counter() - start
    assert first is not None
    return first, generation.cached_tokens


def _flatten(value: Any) -> list[mx.array]:
    if isinstance(value, mx.array):
        return [value]
    if isinstance(value, (list, tuple)):
        return [a for v in value for a in _flatten(v)]
    return []


@contextmanager
def phases(into: Phases) -> Iterator[None]:
    """Time the cached turn's phases, each evaluated before the clock stops."""
    patched: list[tuple[Any, str, Any]] = []

    def wrap(owner: Any, name: str, label: Callable[[tuple[Any, ...]], str | None],
             result_of: Callable[[Any, tuple[Any, ...]], list[mx.array]]) -> None:
        original = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            what = label(args)
            if what is None:
                return original(*args, **kwargs)
            mx.synchronize()
            t = time.perf_counter()
            out = original(*args, **kwargs)
            mx.eval(result_of(out, args))
            mx.synchronize()
            into[what] += time.perf_counter() - t
            return out

        patched.append((owner, name, original))
        setattr(owner, name, timed)

    wrap(EngineModel, "generation", lambda a: "generation (tokens, checks)", lambda o, a: [])
    wrap(PrefixCache, "lookup", lambda a: "lookup (hash chain, memory)", lambda o, a: [])
    wrap(Batch, "_cached_prefix", lambda a: "prefix rows (lookup + concatenate)",
         lambda o, a: _flatten(o))
    wrap(loop.Decoding, "__init__", lambda a: "Decoding(rows) (cache filled)",
         lambda o, a: a[0].state())
    wrap(loop.Decoding, "feed", lambda a: "prefill (new tokens)" if len(a[1]) > 1 else None,
         lambda o, a: [o, *a[0].state()])
    wrap(Batch, "_keep", lambda a: "store (blocks copied)", lambda o, a: [])
    wrap(loop.Decoding, "step", lambda a: "decode step(s)", lambda o, a: [o, *a[0].state()])
    try:
        yield
    finally:
        for owner, name, original in reversed(patched):
            setattr(owner, name, original)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-4b")
    p.add_argument("--quantize", type=int, default=4)
    p.add_argument("--context", type=int, default=16384)
    p.add_argument("--added", type=int, default=755)
    p.add_argument("--turns", type=int, default=20)
    p.add_argument("--block", type=int, default=256)
    args = p.parse_args()
    with random_model(args.model, args.quantize) as model:
        run(model, args)


def run(model: Model, args: argparse.Namespace) -> None:
    eos = sorted(model.tokenizer.eos_token_ids)
    options = GenerationOptions(max_tokens=2, temperature=0.0, logit_bias=dict.fromkeys(eos, -100.0))
    cache = PrefixCache(block_tokens=args.block, memory_bytes=1 << 40)
    first = args.context - (args.turns - 1) * args.added
    ids = [7 + (i * 31) % 5000 for i in range(args.context + 64)]
    text_of = model.tokenizer.decode
    first_token(Batch(model), text_of(ids[:600]), options)  # warm
    for turn in range(args.turns):
        text = text_of(ids[: first + turn * args.added])
        uncached, _ = first_token(Batch(model), text, options)
        memory, hit = first_token(Batch(model, cache), text, options)
        again, _ = first_token(Batch(model, cache), text, options)
        print(f"turn {turn + 1:2d} prompt ~{first + turn * args.added:6d}: uncached "
              f"{uncached * 1e3:8.1f} ms, memory {memory * 1e3:8.1f} ms ({hit} cached; "
              f"{uncached / memory:5.2f}x), same prompt again {again * 1e3:8.1f} ms", flush=True)
    text = text_of(ids[: first + args.turns * args.added])
    first_token(Batch(model, cache), text_of(ids[: first + (args.turns - 1) * args.added]), options)
    plain, hit = first_token(Batch(model, cache), text, options)
    spent: Phases = defaultdict(float)
    with phases(spent):
        start = time.perf_counter()
        _, hit2 = first_token(Batch(model, cache), text + text_of(ids[:3]), options)
        total = time.perf_counter() - start
    print(f"-- a turn past the last ({hit} then {hit2} tokens cached): plain {plain * 1e3:.1f} ms;"
          f" phases evaluated one by one, {total * 1e3:.1f} ms in all:")
    for name, seconds in spent.items():
        print(f"   {name:40s} {seconds * 1e3:8.1f} ms")
    inner = sum(s for name, s in spent.items() if not name.startswith("lookup"))  # nested
    print(f"   {'(other: host, sampling, detokenizer)':40s} {(total - inner) * 1e3:8.1f} ms")


if __name__ == "__main__":
    main()
