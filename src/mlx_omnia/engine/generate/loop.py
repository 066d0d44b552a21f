"""The decode driver: one `Decoding` a sequence, shared by generation (`generate_tokens`, under
`Model.stream`) and teacher forcing (`Model.decoding`). It prefills in chunks, then decodes
through the compiled step where `compile_enabled` says so; generation queues each step before
the previous token is handed out (the host never waits on the device between tokens)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Generator, Sequence
from typing import Protocol, cast, runtime_checkable

import mlx.core as mx
import mlx.nn as nn

from mlx_omnia.engine.core.cache import (
    KVCache,
    KVFormat,
    QuantizedKVCache,
    StaticKVCache,
    StaticQuantizedKVCache,
    filled_cache,
    kv_format,
    sequence_caches,
    static_cache,
)
from mlx_omnia.engine.core.layers import AttentionStep
from mlx_omnia.engine.core.mxcompat import evaluate, evaluate_async, int_item, named_modules
from mlx_omnia.engine.core.state import RecurrentState, StaticRecurrentState


@runtime_checkable
class Network(Protocol):
    """What the loop needs of a family's model: logits for ids given a per-layer cache, for
    every position, or with `last_only` for the last one alone ([B, 1, V]: the head, a
    vocabulary-sized matmul, runs on one row; what a prompt's prefill needs)."""

    def __call__(
        self, ids: mx.array, cache: list[KVCache] | None = None, last_only: bool = False
    ) -> mx.array: ...

    def make_cache(self) -> Sequence[KVCache | RecurrentState]: ...


PREFILL_CHUNK = 512
PREFILL_CHUNK_GPU = 2048
COMPILE_ENV = "OMNIA_COMPILE"
LayerRows = tuple[mx.array, ...]
"""One layer's cache rows of one sequence: keys and values [1, H, T, D], or the six PARTS arrays
[1, H, T, *] of a quantized cache (core/cache.py)."""


def prefill_chunk() -> int:
    """Prompt rows per prefill pass: 2048 on a GPU, where a pass's matmuls are only saturated by
    long chunks; 512 on the CPU, whose attention materializes its scores (a 2048-row chunk over
    4096 keys with 32 heads would hold 1 GiB of float32 scores). Figures: docs/kernels.md."""
    return PREFILL_CHUNK_GPU if mx.default_device() == mx.gpu else PREFILL_CHUNK


EagerCache = KVCache | QuantizedKVCache | RecurrentState
"""A sequence's cache of one layer, as prefill fills it (a recurrent layer's: its state)."""
StaticCache = StaticKVCache | StaticQuantizedKVCache | StaticRecurrentState


def _rows_length(caches: Sequence[EagerCache], rows: Sequence[LayerRows]) -> int:
    """How many tokens rows of a sequence hold: an attention layer's row count (a recurrent
    layer's state does not say)."""
    for cache, r in zip(caches, rows, strict=True):
        if not isinstance(cache, RecurrentState):
            return r[0].shape[2]
    raise ValueError("rows of recurrent states alone: give the sequence's length")


def _filled(cache: EagerCache) -> bool:
    if isinstance(cache, RecurrentState):
        return cache.is_filled
    return cache.keys is not None


def prefill(network: Network, ids: list[int], caches: Sequence[EagerCache]) -> mx.array:
    """Run the prompt through the network in chunks; returns the last position's logits [V]."""
    if not ids:
        raise ValueError("cannot generate from an empty prompt")
    # families take any cache through `offset` / `update_and_fetch` / `attention_mask` (a
    # quantized one is read by the AttentionStep itself)
    cache = cast(list[KVCache], list(caches))
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

    def __init__(self, network: Network, caches: Sequence[EagerCache]) -> None:
        self.caches: list[StaticCache] = [static_cache(c) for c in caches]
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
    def acquire(cls, network: Network, caches: Sequence[EagerCache], length: int) -> CompiledStep:
        """A compiled step loaded with these prefilled caches; `release` it when done."""
        step: CompiledStep | None = getattr(network, cls._IDLE, None)
        setattr(network, cls._IDLE, None)
        if step is None or not step.takes(caches):
            step = cls(network, caches)
        else:
            for static, cache in zip(step.caches, caches, strict=True):
                if isinstance(static, StaticQuantizedKVCache):
                    static.load(cast(QuantizedKVCache, cache))
                elif isinstance(static, StaticRecurrentState):
                    static.load(cast(RecurrentState, cache))
                else:
                    static.load(cast(KVCache, cache))
            step._fits = step._capacity()
        step.length = length
        return step

    def takes(self, caches: Sequence[EagerCache]) -> bool:
        """Whether these caches fit this step's (as many, each in the same format)."""
        return len(caches) == len(self.caches) and all(
            _format(c) == _format(s)
            and isinstance(c, RecurrentState) == isinstance(s, StaticRecurrentState)
            for c, s in zip(caches, self.caches, strict=True)
        )

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


def _format(cache: object) -> KVFormat | None:
    return cache.format if isinstance(cache, QuantizedKVCache | StaticQuantizedKVCache) else None


def compile_enabled(network: Network) -> bool:
    """Whether decode runs the compiled step. OMNIA_COMPILE=1 / 0 forces it on / off. By default
    it is on for the CPU backend, and on a GPU when every AttentionStep of the network is bound
    to a kernel (which attends over the filled rows of the static buffer only): with the core
    attention, the masked attention over the whole static buffer costs more than the fusion
    saves on MLX's CUDA backend (docs/kernels.md). A family opts out with
    `compile_decode = False`."""
    choice = os.environ.get(COMPILE_ENV, "auto")
    if choice == "0" or not getattr(network, "compile_decode", True):
        return False
    if choice == "1" or mx.default_device() == mx.cpu:
        return True
    steps = [m for _, m in named_modules(cast(nn.Module, network)) if isinstance(m, AttentionStep)]
    return bool(steps) and all(m.binding != "core" for m in steps)


class Inherit:
    """A sequence's KV format not given: the network's (`kv_format`, set at load)."""


INHERIT = Inherit()


def sequence_format(network: Network, format: KVFormat | Inherit | None) -> KVFormat | None:
    """The KV format a sequence caches in: `format`, or the network's where it is INHERIT."""
    return kv_format(network) if isinstance(format, Inherit) else format


class Decoding:
    """One sequence being decoded: `feed` (teacher forcing) and `step` (generation) run ids
    through the network, extending the sequence's cache (in `format`: by default the network's;
    None keeps keys and values as computed).

    A prompt fed `last_only` is prefilled in chunks of `prefill_chunk()` rows. Single tokens
    after the first feed run the compiled decode step where `compile_enabled`. `close` hands the
    compiled step (its traces) back to the network for the next sequence; a Decoding dropped
    without `close` hands it back then (otherwise every new sequence would trace it again)."""

    def __init__(
        self, network: Network, rows: Sequence[LayerRows] = (),
        format: KVFormat | Inherit | None = INHERIT, length: int = 0,
    ) -> None:
        self._network = network
        self.format = sequence_format(network, format)
        self._cache: list[EagerCache] = sequence_caches(network.make_cache(), self.format)
        self._step: CompiledStep | None = None
        self._compile = compile_enabled(network)
        self.length = 0
        if rows:  # a sequence taken over with its keys and values (a prefix, a batch's row)
            self._cache = [
                RecurrentState.filled(made.names, r) if isinstance(made, RecurrentState)
                else filled_cache(self.format, r)
                for made, r in zip(self._cache, rows, strict=True)
            ]
            self.length = length or _rows_length(self._cache, rows)

    def rows(self) -> list[LayerRows]:
        """Each layer's keys and values [1, H, length, D] so far, or their PARTS when the cache
        is quantized, or a recurrent layer's state arrays (views; what `Decoding(network, rows,
        length=)` takes over)."""
        if self._step is not None:
            return [c.rows(self._step.length) for c in self._step.caches]
        return [c.rows() for c in self._cache]

    def feed(self, ids: Sequence[int], last_only: bool = False) -> mx.array:
        """Logits [len(ids), V] for `ids` following everything fed so far (lazy: evaluate them);
        with `last_only`, [1, V] for the last id alone: several ids are then prefilled as
        generation prefills a prompt (chunks of `prefill_chunk()` rows, each chunk's cache
        evaluated, the head run on the last row only)."""
        if not ids:
            raise ValueError("feed at least one token id")
        batch = mx.array([list(ids)], dtype=mx.int32)
        if len(ids) == 1 and self.length > 0:
            return self.step(batch)[None]
        self.length += len(ids)
        if self._step is not None:
            return self._step.feed_many(batch, last_only)
        if last_only and len(ids) > 1:
            return prefill(self._network, list(ids), self._cache)[None]
        return self._network(batch, cast(list[KVCache], self._cache), last_only)[0]

    def step(self, token: mx.array) -> mx.array:
        """Logits [V] for one token [1, 1] (int32; it may still be lazy, as a token generation
        has just sampled) after at least one `feed`."""
        if (
            self._step is None
            and self._compile
            and self.length > 0
            and all(_filled(c) for c in self._cache)
        ):
            self._step = CompiledStep.acquire(self._network, self._cache, self.length)
        self.length += 1
        if self._step is not None:
            return self._step(token)
        return self._network(token, cast(list[KVCache], self._cache))[0, -1, :]

    def queue(self, token: mx.array) -> None:
        """Start evaluating a sampled token, with the caches the compiled step wrote, while the
        host goes on to build the next step."""
        if self._step is not None:
            evaluate_async([token, *self._step.state()])
        else:
            evaluate_async(token)

    def state(self) -> list[mx.array]:
        """The cache arrays, to evaluate together with the logits."""
        if self._step is not None:
            return self._step.state()
        return [a for c in self._cache for a in c.state()]

    def close(self) -> None:
        if self._step is not None:
            self._step.release()
            self._step = None

    def __enter__(self) -> Decoding:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit MLX may be gone already
            self.close()


def generate_tokens(
    network: Network,
    prompt_ids: list[int],
    sample: Callable[[mx.array], mx.array],
    follow: Callable[[int], None] | None = None,
    format: KVFormat | Inherit | None = INHERIT,
) -> Generator[int]:
    """Yield sampled token ids forever (the caller decides when to stop): the prompt is
    prefilled, then each step is queued before the token before it is handed out. The
    sequence caches in `format` (Decoding's).

    `follow` (a constrained sampler's): called with each token before the next is sampled, which
    then depends on the token's value; the next forward runs on the device meanwhile."""
    if follow is not None:
        yield from _generate_followed(network, prompt_ids, sample, follow, format)
        return
    with Decoding(network, (), format) as sequence:
        token = sample(sequence.feed(prompt_ids, last_only=True)[-1])
        evaluate_async(token)
        while True:
            following = sample(sequence.step(token[None, None]))
            sequence.queue(following)
            yield int_item(token)
            token = following


def _generate_followed(
    network: Network,
    prompt_ids: list[int],
    sample: Callable[[mx.array], mx.array],
    follow: Callable[[int], None],
    format: KVFormat | Inherit | None,
) -> Generator[int]:
    """generate_tokens when sampling token t + 1 needs token t's value on the host (a grammar's
    mask): the forward for t + 1 is queued behind the (lazy) sample of t before the host waits
    for t's value, so the device goes on to it at once; `follow(t)` and the consumer's handling
    of t run while it computes; then t + 1 is sampled under the mask that follows t."""
    with Decoding(network, (), format) as sequence:
        token = sample(sequence.feed(prompt_ids, last_only=True)[-1])
        evaluate_async(token)
        while True:
            logits = sequence.step(token[None, None])
            evaluate_async([logits, *sequence.state()])
            value = int_item(token)  # its own evaluation: waits for the sample, not the forward
            follow(value)
            yield value
            token = sample(logits)
            evaluate_async(token)
