"""Many sequences decoded together: each step runs one forward for every running sequence (the
weights are read once for all of them) and at most one chunk of a newcomer's prompt, so running
streams keep flowing while a long prompt is prefilled.

A sequence is prefilled alone (its own `Decoding`), then joins the batch: the batch's caches
(`BatchCache`, a row a sequence) take its keys and values. A lone sequence decodes on its own
`Decoding` (the compiled single-sequence step and its kernels); the batch's caches are built when
a second one joins and given back to a `Decoding` when one is left. Each sequence keeps its own
sampler (options, penalties, bias, grammar) and is sampled from its own row of logits."""

from __future__ import annotations

import os
import sys
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

import mlx.core as mx

from mlx_omnia.engine.core.cache import (
    OFFSET_SLOTS,
    PARTS,
    BatchRows,
    KVCache,
    KVFormat,
    QuantizedBatchRows,
)
from mlx_omnia.engine.core.mxcompat import evaluate, evaluate_async, int_item
from mlx_omnia.engine.core.state import RecurrentState, StaticRecurrentState
from mlx_omnia.engine.generate.loop import (
    COMPILE_ENV,
    INHERIT,
    Decoding,
    Inherit,
    LayerRows,
    Network,
    prefill_chunk,
    sequence_format,
)
from mlx_omnia.engine.generate.sampling import Sampler, SamplingParams, sample_rows

Rows = list[LayerRows]  # each layer's keys and values (or quantized PARTS) of one sequence
Layout = tuple[tuple[str, ...] | None, ...]  # per layer: None (keys/values) or its state's names
# (ids, offsets, *layer 0's arrays, *layer 1's, ...) -> [logits, *layer 0's arrays, ...]
BatchForward = Callable[..., list[mx.array]]


class BatchCache:
    """Every layer's keys and values for the batch: [P, H, capacity, D] a layer (or the six
    quantized PARTS, [P, H, capacity, *]), P slots (a power of two), a sequence a slot, filled
    up to its length (the same in every layer); a recurrent layer's state arrays [P, ...] (no
    rows: a slot's state is its sequence's, whole). A free slot has no length: its row is
    computed with the others and ignored, so sequences join and leave without changing the
    step's shapes (a compiled step keeps one trace per slot count and capacity) and without
    copying the other rows. The host reserves capacity before a step, so the step itself
    (`BatchRows`) is pure array work."""

    step = 256

    def __init__(self, first: Rows, layout: Layout, length: int) -> None:
        """Two slots, the first holding `first` (each layer's arrays [1, ...]), a sequence of
        `length` tokens; `layout` says which layers are recurrent (`layout_of`)."""
        self.layout = layout
        capacity = _rounded(length, self.step)
        self.layers: Rows = [
            tuple(_slots(a if names is not None else _padded(a, capacity), 2) for a in layer)
            for layer, names in zip(first, layout, strict=True)
        ]
        self.lengths: list[int | None] = [length, None]
        self._sync()

    @property
    def capacity(self) -> int:
        """Rows every attention layer holds (any number when there is none)."""
        for layer, names in zip(self.layers, self.layout, strict=True):
            if names is None:
                return layer[0].shape[2]
        return sys.maxsize

    @property
    def slots(self) -> int:
        return len(self.lengths)

    @property
    def used(self) -> int:
        return sum(n is not None for n in self.lengths)

    def put(self, rows: Rows, length: int) -> int:
        """Place a sequence of `length` tokens in a free slot (the slots double when none is);
        returns the slot."""
        if None not in self.lengths:
            grow = self.slots
            self.layers = [tuple(_slots(a, 2 * grow) for a in layer) for layer in self.layers]
            self.lengths += [None] * grow
        slot = self.lengths.index(None)
        if length > self.capacity:
            self._reserve(length)
        for layer, new, names in zip(self.layers, rows, self.layout, strict=True):
            for a, rows_of in zip(layer, new, strict=True):
                if names is None:
                    a[slot : slot + 1, :, :length] = rows_of
                else:
                    a[slot : slot + 1] = rows_of
        self.lengths[slot] = length
        self._sync()
        return slot

    def free(self, slot: int) -> dict[int, int]:
        """Let a slot go. When a quarter or less of the slots are used, the used ones move into
        half as many: returns {old slot: new slot} for them (empty when nothing moved)."""
        self.lengths[slot] = None
        moved: dict[int, int] = {}
        if self.slots >= 4 and self.used <= self.slots // 4:
            kept = [i for i, n in enumerate(self.lengths) if n is not None]
            half = self.slots // 2
            moved = {old: new for new, old in enumerate(kept)}
            order = kept + [i for i in range(self.slots) if i not in moved][: half - len(kept)]
            index = mx.array(order, dtype=mx.int32)
            self.layers = [tuple(a[index] for a in layer) for layer in self.layers]
            self.lengths = [self.lengths[i] for i in kept] + [None] * (half - len(kept))
        self._sync()
        return moved

    def row(self, slot: int) -> Rows:
        """A slot's filled keys and values, every layer, [1, H, T, *] (views); a recurrent
        layer's state arrays [1, ...]."""
        n = self.lengths[slot] or 0
        return [
            tuple(a[slot : slot + 1, :, :n] if names is None else a[slot : slot + 1] for a in layer)
            for layer, names in zip(self.layers, self.layout, strict=True)
        ]

    def forward(self, forward: BatchForward, ids: mx.array) -> mx.array:
        """Logits [P, V] for one new token a slot (ids [P, 1]; a free slot's is ignored), each
        used slot's cache extended by its token."""
        longest = max(n for n in self.lengths if n is not None)
        if longest + 1 > self.capacity:
            self._reserve(longest + 1)
        logits, *buffers = forward(ids, self.offsets, *(a for layer in self.layers for a in layer))
        arrays = iter(buffers)
        self.layers = [tuple(next(arrays) for _ in layer) for layer in self.layers]
        self._offsets = self._offsets + self._advance
        self.lengths = [None if n is None else n + 1 for n in self.lengths]
        return logits

    @property
    def offsets(self) -> mx.array:
        """Each slot's length on the device, int32 [P] (a free slot's 0)."""
        return self._offsets[: self.slots]

    def state(self) -> list[mx.array]:
        return [self._offsets, *(a for layer in self.layers for a in layer)]

    def _reserve(self, rows: int) -> None:
        # a quarter more than needed: a long answer grows the buffers (and retraces a compiled
        # step) a few dozen times over 16k tokens, not once every 256
        capacity = _rounded(max(rows, self.capacity + self.capacity // 4), self.step)
        self.layers = [
            layer if names is not None else tuple(_padded(a, capacity) for a in layer)
            for layer, names in zip(self.layers, self.layout, strict=True)
        ]

    def _sync(self) -> None:
        """The device's offsets (a free slot's stays 0) from the host's lengths: at least
        OFFSET_SLOTS of them (16 bytes, past MLX's managed small-array pool on CUDA: core/cache.py),
        `offsets` the first P."""
        pad = [0] * max(0, OFFSET_SLOTS - self.slots)
        self._offsets = mx.array([n or 0 for n in self.lengths] + pad, dtype=mx.int32)
        self._advance = mx.array([int(n is not None) for n in self.lengths] + pad, dtype=mx.int32)


_FORWARD = "_omnia_batch_forward"  # kept on the network: every batch reuses its traces


def batch_forward(
    network: Network, format: KVFormat | Inherit | None = INHERIT
) -> BatchForward:
    """The batch's decode step as a function of arrays for caches in `format` (by default the
    network's), compiled unless OMNIA_COMPILE=0: one trace per batch size and capacity, kept
    (with the compiled function, on the network, one a format) for every later batch of this
    network."""
    compiled = os.environ.get(COMPILE_ENV, "auto") != "0"
    format = sequence_format(network, format)
    kept: dict[tuple[bool, KVFormat | None], BatchForward] = getattr(network, _FORWARD, None) or {}
    if (compiled, format) in kept:
        return kept[compiled, format]

    layout = layout_of(network)

    def forward(ids: mx.array, offsets: mx.array, *buffers: mx.array) -> list[mx.array]:
        arrays = iter(buffers)
        caches: list[BatchRows | QuantizedBatchRows | StaticRecurrentState] = []
        for names in layout:
            if names is not None:  # a recurrent layer: its state arrays, a row a slot
                caches.append(StaticRecurrentState(names, [next(arrays) for _ in names]))
            elif format is None:
                caches.append(BatchRows(next(arrays), next(arrays), offsets))
            else:
                caches.append(QuantizedBatchRows(format, [next(arrays) for _ in PARTS], offsets))
        logits = network(ids, cast(list[KVCache], caches))[:, -1, :]
        out = [logits]
        for cache in caches:
            if isinstance(cache, StaticRecurrentState):
                out.extend(cache.rows())
            elif isinstance(cache, BatchRows):
                out.extend((cache.keys, cache.values))
            else:
                out.extend(cache.parts)
        return out

    made = cast(BatchForward, mx.compile(forward)) if compiled else forward
    setattr(network, _FORWARD, {**kept, (compiled, format): made})
    return made


def _greedy(seq: BatchSequence) -> int | None:
    """The vocabulary rows whose argmax is the sequence's next token, when that is all its
    sampler does (`Sampler.argmax_rows`)."""
    return getattr(seq.sample, "argmax_rows", None)


def _rounded(n: int, step: int) -> int:
    return max(step, (n + step - 1) // step * step)


def _slots(x: mx.array, slots: int) -> mx.array:
    """x [B, H, T, D] with zero rows appended along B up to `slots`."""
    extra = slots - x.shape[0]
    if extra <= 0:
        return x
    return mx.concatenate([x, mx.zeros((extra, *x.shape[1:]), x.dtype)])


def _padded(x: mx.array, capacity: int) -> mx.array:
    """x [B, H, T, D] with zero rows appended up to `capacity`, or cut to it."""
    extra = capacity - x.shape[2]
    if extra <= 0:
        return x[:, :, :capacity] if extra < 0 else x
    return mx.concatenate([x, mx.zeros((*x.shape[:2], extra, x.shape[3]), x.dtype)], axis=2)


def batchable(network: Network) -> bool:
    """Whether sequences of this network can share a step: its caches are the plain KVCache or
    a recurrent layer's state (the batch's rows take theirs over) and the family does not opt
    out (`batchable = False`)."""
    return getattr(network, "batchable", True) and all(
        type(c) is KVCache or type(c) is RecurrentState for c in network.make_cache()
    )


def layout_of(network: Network) -> Layout:
    """Each layer's cache kind: None for keys and values, a recurrent layer's state names."""
    return tuple(c.names if isinstance(c, RecurrentState) else None for c in network.make_cache())


@dataclass(eq=False)  # a sequence is itself: found in the batch by identity
class BatchSequence:
    """One sequence: its prompt, how it samples, and where it stands."""

    prompt: list[int]
    sample: Callable[[mx.array], mx.array]
    follow: Callable[[int], None] | None = None
    fed: int = 0  # prompt tokens in the cache (a prefix cache's, then prefilled)
    decoding: Decoding | None = None  # while prefilling, or decoding alone
    token: mx.array | None = None  # sampled, not yet handed out
    emitted: list[int] = field(default_factory=list[int])
    failed: Exception | None = None  # its sampler or grammar failed: it takes no more steps
    prefix: Callable[[], tuple[Rows, int] | None] | None = None  # a cached prefix: rows, length
    slot: int = 0  # its row in the batch's caches and logits
    # the recurrent layers' state after the last whole block the sequence passed (its length
    # then, the rows; an attention layer's: ()), for the prefix cache's anchors
    anchor: tuple[int, Rows] | None = None


class BatchDecoding:
    """The sequences being decoded together, caching keys and values in one `format` (by default
    the network's). `add` a sequence (optionally with a cached prefix of its prompt), call `step`
    for tokens, `remove` a sequence when its consumer is done with it."""

    def __init__(
        self, network: Network, on_join: Callable[[BatchSequence], None] | None = None,
        format: KVFormat | Inherit | None = INHERIT, anchor_every: int | None = None,
    ) -> None:
        self._network = network
        self._layout = layout_of(network)
        # keep each sequence's recurrent state at every multiple of this many tokens (a prefix
        # cache's block): a prompt's prefill stops there, decode steps look
        self.anchor_every = anchor_every if any(n is not None for n in self._layout) else None
        self.format = sequence_format(network, format)
        self._on_join = on_join  # told of each sequence whose prompt is in (a prefix cache)
        self.waiting: deque[BatchSequence] = deque()
        self.running: list[BatchSequence] = []
        self._caches: BatchCache | None = None
        self._forward_batch = batch_forward(network, self.format)
        self._idle = mx.zeros((), dtype=mx.int32)  # a free slot's token (its row is ignored)
        # sequences of a network that cannot batch run one after another
        self.limit = None if batchable(network) else 1

    def add(
        self,
        prompt: Sequence[int],
        sample: Callable[[mx.array], mx.array],
        follow: Callable[[int], None] | None = None,
        prefix: Callable[[], tuple[Rows, int] | None] | None = None,
    ) -> BatchSequence:
        """Queue a sequence. `prefix`, called when its prefill starts (so it sees what the
        sequences before it left), gives its prompt's first tokens' keys and values, if known;
        at least one prompt token must be left to prefill."""
        if not prompt:
            raise ValueError("cannot generate from an empty prompt")
        seq = BatchSequence(list(prompt), sample, follow, prefix=prefix)
        self.waiting.append(seq)
        return seq

    def remove(self, seq: BatchSequence) -> None:
        """Drop a sequence (finished or cancelled), wherever it is."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.running:
            self.running.remove(seq)
            if self._caches is not None:
                moved = self._caches.free(seq.slot)
                for other in self.running:
                    other.slot = moved.get(other.slot, other.slot)
                if len(self.running) == 1:
                    self._go_alone()
        if seq.decoding is not None:
            seq.decoding.close()
            seq.decoding = None

    def length(self, seq: BatchSequence) -> int:
        """Tokens in a running sequence's cache."""
        if seq.decoding is not None:
            return seq.decoding.length
        if self._caches is None or seq not in self.running:
            raise ValueError("the sequence is not decoding")
        return cast(int, self._caches.lengths[seq.slot])

    def rows(self, seq: BatchSequence) -> Rows:
        """A running sequence's keys and values so far (views), e.g. for a prefix cache."""
        if seq.decoding is not None:
            return seq.decoding.rows()
        if self._caches is None or seq not in self.running:
            raise ValueError("the sequence is not decoding")
        return self._caches.row(seq.slot)

    def step(self) -> list[tuple[BatchSequence, int | Exception]]:
        """One step: the running sequences' next forward is queued, then the tokens sampled at
        the last step are read and handed out (a grammar follows each before its next sample);
        then waiting sequences are prefilled, in order, up to `prefill_chunk()` prompt tokens
        (a long prompt over several steps, short ones several a step). A sequence whose sampler or
        grammar fails gets the error instead of a token (the others go on): remove it."""
        out: list[tuple[BatchSequence, int | Exception]] = []
        running = [s for s in self.running if s.failed is None]
        if running:
            logits = self._forward()
            if self.anchor_every is not None:
                for seq in running:
                    if self.length(seq) % self.anchor_every == 0:
                        self._keep_anchor(seq)
            # each token was evaluated on its own (evaluate_async at the last step): reading it
            # waits for that sample only, not for the forward just queued (a stack of them
            # would be a new operation behind the forward, and the host would wait for it)
            values = [int_item(cast(mx.array, s.token)) for s in running]
            sampled: list[mx.array] = []
            greedy = self._argmax(logits)
            together = self._sample_together(logits, running)
            for seq, value in zip(running, values, strict=True):
                seq.emitted.append(value)
                out.append((seq, value))
                try:
                    if seq.follow is not None:
                        seq.follow(value)
                    row = seq.slot
                    if seq in together:
                        seq.token = together[seq]
                    elif greedy is not None and _greedy(seq):
                        seq.token = greedy[row]
                    else:
                        seq.token = seq.sample(logits[row])
                    sampled.append(seq.token)
                except Exception as e:  # this sequence's grammar or sampler: it alone stops
                    seq.failed = e
                    out.append((seq, e))
            evaluate_async(sampled)
        budget = prefill_chunk()  # prompt tokens a step prefills: short prompts join together
        while self.waiting and budget > 0 and (
            self.limit is None or len(self.running) < self.limit
        ):
            seq = self.waiting[0]
            try:
                budget -= self._prefill_chunk(seq, budget)
            except Exception as e:  # its sampler or grammar failed on the first token
                seq.failed = e
                self.remove(seq)
                out.append((seq, e))
                continue
            if self.waiting and self.waiting[0] is seq:
                break  # its prompt took the step's budget
        return out

    # -- internals ---------------------------------------------------------------------------
    def _argmax(self, logits: mx.array) -> mx.array | None:
        """Every row's greedy token in one operation, when some running sequence samples
        greedily with nothing else (one launch for them all, not one sampler call each)."""
        rows = [r for s in self.running if (r := _greedy(s)) is not None]
        if not rows:
            return None
        return mx.argmax(logits[:, : rows[0]].astype(mx.float32), axis=-1).astype(mx.int32)

    def _sample_together(
        self, logits: mx.array, running: list[BatchSequence]
    ) -> dict[BatchSequence, mx.array]:
        """Tokens of the sequences that sample with nothing but a setting and a key, one call
        for all that share a setting (`sample_rows`: each row as its own sampler would); their
        samplers' keys move on."""
        groups: dict[tuple[SamplingParams, int], list[tuple[int, BatchSequence, Sampler]]] = {}
        for seq in running:
            sampler = seq.sample
            if isinstance(sampler, Sampler) and sampler.row_setting is not None:
                groups.setdefault(sampler.row_setting, []).append((seq.slot, seq, sampler))
        out: dict[BatchSequence, mx.array] = {}
        for (setting, vocab), members in groups.items():
            if len(members) < 2:
                continue
            rows = mx.array([row for row, _, _ in members], dtype=mx.int32)
            keys = mx.stack([sampler.key for _, _, sampler in members])
            tokens, keys = sample_rows(setting, vocab)(logits[rows], keys)
            for i, (_, seq, sampler) in enumerate(members):
                out[seq] = tokens[i]
                sampler.key = keys[i]
        return out

    def _forward(self) -> mx.array:
        """Logits [B, V] for the running sequences' last tokens (queued on the device)."""
        if len(self.running) == 1 and self.running[0].decoding is not None:
            seq = self.running[0]
            decoding = seq.decoding
            assert decoding is not None
            logits = decoding.step(cast(mx.array, seq.token)[None, None])[None]
            evaluate_async([logits, *decoding.state()])
            return logits
        caches = cast(BatchCache, self._caches)
        tokens = [self._idle] * caches.slots
        for seq in self.running:
            tokens[seq.slot] = cast(mx.array, seq.token)
        logits = caches.forward(self._forward_batch, mx.stack(tokens)[:, None])
        evaluate_async([logits, *caches.state()])
        return logits

    def _prefill_chunk(self, seq: BatchSequence, budget: int) -> int:
        """Prefill up to `budget` more prompt tokens of `seq`; it joins once its prompt is in.
        Returns the tokens fed."""
        if seq.decoding is None:
            found = seq.prefix() if seq.prefix is not None else None
            rows, length = found if found is not None else ((), 0)
            seq.decoding = Decoding(self._network, rows, self.format, length=length)
            seq.fed = seq.decoding.length
            if seq.fed >= len(seq.prompt):
                raise ValueError("a cached prefix must leave a prompt token to prefill")
        start = seq.fed
        end = min(len(seq.prompt), start + budget)
        # the anchor a lookup of this very prompt reaches: the last block end before its last
        # token (a lookup leaves that token to prefill); a chunk stops there
        every = self.anchor_every
        boundary = (len(seq.prompt) - 1) // every * every if every is not None else 0
        if start < boundary < end:
            end = boundary
        logits = seq.decoding.feed(seq.prompt[start:end], last_only=True)
        seq.fed = end
        if end == boundary:
            self._keep_anchor(seq)
        if end < len(seq.prompt):
            evaluate(seq.decoding.state())
            return end - start
        seq.token = seq.sample(logits[-1])
        self.waiting.popleft()
        evaluate_async(seq.token)
        self._join(seq)
        if self._on_join is not None:
            self._on_join(seq)
        return end - start

    def _keep_anchor(self, seq: BatchSequence) -> None:
        """Remember the sequence's recurrent states now, at a block's end (own copies: a batch
        row's view would keep the whole batch's arrays alive)."""
        rows = self.rows(seq)
        kept: Rows = [() if names is None else tuple(mx.array(a) for a in layer)
                      for layer, names in zip(rows, self._layout, strict=True)]
        evaluate_async([a for layer in kept for a in layer])
        seq.anchor = (self.length(seq), kept)

    def _join(self, seq: BatchSequence) -> None:
        """A prefilled sequence joins the running ones."""
        self.running.append(seq)
        if len(self.running) == 1:
            seq.slot = 0  # alone: it decodes on its Decoding, its logits the one row
            return
        decoding = seq.decoding
        assert decoding is not None
        if self._caches is None:  # the one decoding alone hands its rows to the batch
            first = self.running[0]
            assert first.decoding is not None
            self._caches = BatchCache(
                first.decoding.rows(), layout_of(self._network), first.decoding.length
            )
            first.slot = 0
            first.decoding.close()
            first.decoding = None
        seq.slot = self._caches.put(decoding.rows(), decoding.length)
        evaluate(self._caches.state())
        decoding.close()
        seq.decoding = None

    def _go_alone(self) -> None:
        """One sequence is left: it takes its row back to a Decoding of its own."""
        alone = self.running[0]
        caches = cast(BatchCache, self._caches)
        rows = caches.row(alone.slot)
        evaluate([a for r in rows for a in r])
        alone.decoding = Decoding(
            self._network, rows, self.format, length=cast(int, caches.lengths[alone.slot])
        )
        alone.slot = 0  # its logits are the one row of its own step's
        self._caches = None
