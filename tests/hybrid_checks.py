"""Checks shared by the hybrid families' tests (layers that carry a recurrent state)."""

from __future__ import annotations

from collections.abc import Callable

from mlx_omnia import Batch, Generation, GenerationOptions, Model, PrefixCache
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
