"""Prefill then decode, one token at a time, with the next step queued before the current token
is handed out (the host never waits on the device between tokens)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Protocol, cast

import mlx.core as mx
import mlx.nn as nn

from mlx_omnia.engine.core.cache import KVCache, StaticKVCache
from mlx_omnia.engine.core.layers import AttentionStep
from mlx_omnia.engine.core.mxcompat import evaluate, evaluate_async, named_modules


class Network(Protocol):
    """What the loop needs of a family's model: logits for ids given a per-layer cache, for
    every position, or with `last_only` for the last one alone ([B, 1, V]: the head, a
    vocabulary-sized matmul, runs on one row; what a prompt's prefill needs)."""

    def __call__(
        self, ids: mx.array, cache: list[KVCache] | None = None, last_only: bool = False
    ) -> mx.array: ...

    def make_cache(self) -> list[KVCache]: ...


PREFILL_CHUNK = 512
PREFILL_CHUNK_GPU = 2048
COMPILE_ENV = "OMNIA_COMPILE"


def prefill_chunk() -> int:
    """Prompt rows per prefill pass: 2048 on a GPU, where a pass's matmuls are only saturated by
    long chunks (H200, Qwen3-4B, 4096-token prompt: 512-row chunks prefilled at 0.70-0.75x
    mlx-lm's 2048, 2026-12-03); 512 on the CPU, whose attention materializes its scores (a
    2048-row chunk over 4096 keys with 32 heads would hold 1 GiB of float32 scores)."""
    return PREFILL_CHUNK_GPU if mx.default_device() == mx.gpu else PREFILL_CHUNK


def prefill(network: Network, ids: list[int], cache: list[KVCache]) -> mx.array:
    """Run the prompt through the network in chunks; returns the last position's logits [V]."""
    if not ids:
        raise ValueError("cannot generate from an empty prompt")
    start, chunk = 0, prefill_chunk()
    while len(ids) - start > chunk:
        network(mx.array([ids[start : start + chunk]], dtype=mx.int32), cache)
        evaluate([a for c in cache for a in c.state()])
        start += chunk
    logits = network(mx.array([ids[start:]], dtype=mx.int32), cache, last_only=True)
    return logits[0, -1, :]


class CompiledStep:
    """One decode step, token [1, 1] -> logits [V], compiled once per cache-buffer size.

    The prefilled caches become StaticKVCaches whose buffers and offset are the compiled
    function's implicit inputs and outputs, so a step is one traced graph instead of hundreds of
    separately dispatched operations. A network keeps its CompiledStep between generations (the
    traces and compiled kernels are reused); a second generation running at the same time (two
    interleaved generators) gets its own."""

    # The idle step is kept on the network itself (nn.Module is a dict: not weak-hashable).
    _IDLE = "_omnia_idle_compiled_step"

    def __init__(self, network: Network, caches: list[KVCache]) -> None:
        self.caches = [StaticKVCache.from_cache(c) for c in caches]
        self.length = 0
        self._fits = self._capacity()
        self._network = network
        state = [c.state for c in self.caches]
        # Families take the cache through `offset` / `update_and_fetch` / `attention_mask` only,
        # which StaticKVCache provides (with an array offset).
        static = cast(list[KVCache], self.caches)

        def step(token: mx.array) -> mx.array:
            return network(token, static)[0, -1, :]

        self._step = mx.compile(step, inputs=state, outputs=state)

    @classmethod
    def acquire(cls, network: Network, caches: list[KVCache], length: int) -> CompiledStep:
        """A compiled step loaded with these prefilled caches; `release` it when done."""
        step: CompiledStep | None = getattr(network, cls._IDLE, None)
        setattr(network, cls._IDLE, None)
        if step is None or len(step.caches) != len(caches):
            step = cls(network, caches)
        else:
            for static, cache in zip(step.caches, caches, strict=True):
                static.load(cache)
            step._fits = step._capacity()
        step.length = length
        return step

    def release(self) -> None:
        """Keep this step (its traces) on the network for the next sequence; the sequence's
        cache buffers are let go now, `acquire` loads the next one's."""
        for cache in self.caches:
            cache.drop()
        self._fits = 0
        setattr(self._network, self._IDLE, self)

    def _capacity(self) -> int:
        """Rows every cache holds (the host checks this int per step, not each cache)."""
        return min((c.capacity for c in self.caches), default=0)

    def _reserve(self) -> None:
        if self.length > self._fits:
            for cache in self.caches:
                cache.reserve(self.length)
            self._fits = self._capacity()

    def __call__(self, token: mx.array) -> mx.array:
        self.length += 1
        self._reserve()
        return self._step(token)

    def feed_many(self, ids: mx.array, last_only: bool = False) -> mx.array:
        """Several tokens at once through the static caches (eager, not compiled): [L, V], or
        [1, V] with `last_only`."""
        self.length += ids.shape[1]
        self._reserve()
        return self._network(ids, cast(list[KVCache], self.caches), last_only)[0]

    def state(self) -> list[mx.array]:
        return [a for c in self.caches for a in c.state.values()]


def compile_enabled(network: Network) -> bool:
    """Whether decode runs the compiled step. OMNIA_COMPILE=1 / 0 forces it on / off. By default
    it is on for the CPU backend, and on a GPU when every AttentionStep of the network is bound
    to a kernel (which attends over the filled rows of the static buffer only): with the core
    attention, the masked attention over the whole static buffer cost more than the fusion saved
    on MLX's CUDA backend (H200, 2026-12-02: 0.88-0.91x the eager step). A family opts out with
    `compile_decode = False`."""
    choice = os.environ.get(COMPILE_ENV, "auto")
    if choice == "0" or not getattr(network, "compile_decode", True):
        return False
    if choice == "1" or mx.default_device() == mx.cpu:
        return True
    steps = [m for _, m in named_modules(cast(nn.Module, network)) if isinstance(m, AttentionStep)]
    return bool(steps) and all(m.binding != "core" for m in steps)


def generate_tokens(
    network: Network, prompt_ids: list[int], sample: Callable[[mx.array], mx.array]
) -> Iterator[int]:
    """Yield sampled token ids forever; the caller decides when to stop."""
    cache = network.make_cache()
    token = sample(prefill(network, prompt_ids, cache))
    evaluate_async(token)
    # Only caches that prefill filled can become static (a scripted test network has none).
    if compile_enabled(network) and all(c.keys is not None for c in cache):
        step = CompiledStep.acquire(network, cache, len(prompt_ids))
        try:
            while True:
                following = sample(step(token[None, None]))
                evaluate_async([following, *step.state()])
                yield int(token.item())  # pyright: ignore[reportArgumentType]  # int32 scalar
                token = following
        finally:
            step.release()
    while True:
        following = sample(network(token[None, None], cache)[0, -1, :])
        evaluate_async(following)
        yield int(token.item())  # pyright: ignore[reportArgumentType]  # int32 scalar
        token = following
