"""Prefill then decode, one token at a time, with the next step queued before the current token
is handed out (the host never waits on the device between tokens)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

import mlx.core as mx

from mlx_omnia.engine.core.cache import KVCache
from mlx_omnia.engine.core.mxcompat import evaluate, evaluate_async


class Network(Protocol):
    """What the loop needs of a family's model: logits for ids given a per-layer cache."""

    def __call__(self, ids: mx.array, cache: list[KVCache] | None = None) -> mx.array: ...

    def make_cache(self) -> list[KVCache]: ...


PREFILL_CHUNK = 512


def prefill(network: Network, ids: list[int], cache: list[KVCache]) -> mx.array:
    """Run the prompt through the network in chunks; returns the last position's logits [V]."""
    if not ids:
        raise ValueError("cannot generate from an empty prompt")
    start = 0
    while len(ids) - start > PREFILL_CHUNK:
        network(mx.array([ids[start : start + PREFILL_CHUNK]], dtype=mx.int32), cache)
        evaluate([a for c in cache for a in c.state()])
        start += PREFILL_CHUNK
    logits = network(mx.array([ids[start:]], dtype=mx.int32), cache)
    return logits[0, -1, :]


def generate_tokens(
    network: Network, prompt_ids: list[int], sample: Callable[[mx.array], mx.array]
) -> Iterator[int]:
    """Yield sampled token ids forever; the caller decides when to stop."""
    cache = network.make_cache()
    token = sample(prefill(network, prompt_ids, cache))
    evaluate_async(token)
    while True:
        following = sample(network(token[None, None], cache)[0, -1, :])
        evaluate_async(following)
        yield int(token.item())  # pyright: ignore[reportArgumentType]  # int32 scalar
        token = following
