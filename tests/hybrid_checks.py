"""Checks shared by the hybrid families' tests (layers that carry a recurrent state)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_omnia import Batch, Generation, GenerationOptions, Model, PrefixCache
from mlx_omnia.engine.generate import loop
from tests.fixtures import parity
from tests.test_batch import drive, tokens

PROMPTS = ["one two three", "four five six seven", "eight", "nine ten eleven twelve thirteen"]
LIMITS = [20, 6, 14, 25]


def options(n: int) -> GenerationOptions:
    """n tokens, greedy, the fixture tokenizer's end tokens never chosen (answers run to n)."""
    return GenerationOptions(max_tokens=n, logit_bias={0: -100.0, parity.EOS_ID: -100.0})


def batched_equals_alone(model: Model, store: PrefixCache | None = None) -> list[Generation]:
    """Sequences join a batch while others decode and leave at different steps (the last one
    taking its row back to a Decoding of its own): each answer equals the one it gives alone,
    token for token. Returns the generations, in the order they joined."""
    alone = [model.generate(p, options(n)).token_ids for p, n in zip(PROMPTS, LIMITS, strict=True)]
    assert [len(a) for a in alone] == LIMITS
    batch = Batch(model, store)
    order: list[Generation] = []

    def join(i: int) -> Callable[[], Generation]:
        def add() -> Generation:
            order.append(batch.add(PROMPTS[i], options(LIMITS[i])))
            return order[-1]
        return add

    out, widest = drive(batch, {0: join(0), 2: join(1), 3: join(2), 5: join(3)})
    assert widest >= 3
    assert [tokens(out[g]) for g in order] == alone
    return order


WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu", "nu", "xi", "omicron", "pi", "rho", "sigma", "tau", "upsilon", "phi", "chi", "psi", "omega"]


def run_alone(batch: Batch, prompt: str, n: int) -> tuple[Generation, tuple[int, ...]]:
    generation = batch.add(prompt, options(n))
    out, _ = drive(batch, {})
    return generation, tokens(out[generation])


def prefix_resumes_recurrent_layers(model: Model, disk: Path) -> None:
    """A conversation resent with a new turn is prefilled from the last anchored block its
    cached run reaches (the recurrent layers resume from the state kept there, the attention
    layers from the blocks' rows): from memory, then (the same prompt again) from disk after a
    restart, answering what it answers uncached. Anchors come from a prompt's prefill (its last
    block end before its last token) and from decode steps (block ends the answer passes)."""
    first = " ".join(WORDS[i % len(WORDS)] for i in range(37))
    store = PrefixCache(block_tokens=8, memory_bytes=1 << 26, disk_dir=disk, disk_bytes=1 << 28)
    batch = Batch(model, store)
    turn1, answer = run_alone(batch, first, 20)
    assert turn1.cached_tokens == 0
    resent = model.tokenizer.encode(first) + list(answer)
    second = model.tokenizer.decode(resent) + " and then " + " ".join(WORDS[:9])
    want = model.generate(second, options(12)).token_ids
    turn2, got = run_alone(batch, second, 12)
    assert got == want
    assert turn2.cached_tokens >= (len(model.tokenizer.encode(first)) - 1) // 8 * 8
    assert turn2.cached_tokens % 8 == 0
    store.close()
    again = PrefixCache(block_tokens=8, memory_bytes=1 << 26, disk_dir=disk, disk_bytes=1 << 28)
    turn3, got = run_alone(Batch(model, again), second, 12)
    # the second prompt's own anchor: its last block end before its last token
    assert got == want and turn3.cached_tokens == (len(model.tokenizer.encode(second)) - 1) // 8 * 8
    assert again.stats().memory_blocks > 0  # read from disk
    again.close()


def long_prefill_equals_stepwise(model: Model, monkeypatch: pytest.MonkeyPatch,
                                 prompt: int = 200, steps: int = 8) -> None:
    """`prompt` tokens prefilled in passes of 96 rows, then `steps` tokens through the compiled
    step, against every token fed one at a time (eager): logits within 1e-4 of the largest."""
    ids = [(7 * i + 3) % 300 + 4 for i in range(prompt + steps)]
    monkeypatch.setattr(loop, "PREFILL_CHUNK", 96)
    monkeypatch.setenv("OMNIA_COMPILE", "1")
    with model.decoding() as d:
        fast = [d.feed(ids[:prompt], last_only=True)] + [d.feed([t]) for t in ids[prompt:]]
    monkeypatch.setenv("OMNIA_COMPILE", "0")
    with model.decoding() as d:
        slow = [d.feed([t]) for t in ids]
    got = np.array(mx.concatenate(fast, axis=0), dtype=np.float64)
    want = np.array(mx.concatenate(slow[prompt - 1 :], axis=0), dtype=np.float64)
    assert float(np.abs(got - want).max() / np.abs(want).max()) < 1e-4
