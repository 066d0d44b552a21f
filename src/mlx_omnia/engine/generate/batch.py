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
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

import mlx.core as mx

from mlx_omnia.engine.core.cache import BatchRows, KVCache
from mlx_omnia.engine.core.mxcompat import evaluate, evaluate_async, int_item
from mlx_omnia.engine.generate.loop import COMPILE_ENV, Decoding, Network, prefill_chunk
from mlx_omnia.engine.generate.sampling import Sampler, SamplingParams, sample_rows

Rows = list[tuple[mx.array, mx.array]]  # each layer's keys and values of one sequence
BatchForward = Callable[..., list[mx.array]]  # (ids, offsets, k0, v0, k1, ...) -> [logits, k0, ...]


class BatchCache:
    """Every layer's keys and values for the batch: [B, H, capacity, D] a layer, row b filled
    up to lengths[b] (the same in every layer). The host reserves capacity before a step, so the
    step itself (`BatchRows`) is pure array work."""

    step = 256

    def __init__(self, layers: Rows, lengths: list[int]) -> None:
        self.layers = layers
        self.lengths = lengths
        self.offsets = mx.array(lengths, dtype=mx.int32)

    @classmethod
    def stack(cls, sequences: list[Rows]) -> BatchCache:
        """A batch of sequences, each given by its layers' keys and values [1, H, T, D]."""
        lengths = [rows[0][0].shape[2] for rows in sequences]
        capacity = _rounded(max(lengths), cls.step)
        layers = [
            (
                mx.concatenate([_padded(s[i][0], capacity) for s in sequences]),
                mx.concatenate([_padded(s[i][1], capacity) for s in sequences]),
            )
            for i in range(len(sequences[0]))
        ]
        return cls(layers, lengths)

    @property
    def capacity(self) -> int:
        return self.layers[0][0].shape[2]

    def append(self, rows: Rows) -> None:
        """Add a sequence as the last row."""
        capacity = max(self.capacity, _rounded(rows[0][0].shape[2], self.step))
        self.layers = [
            (
                mx.concatenate([_padded(k, capacity), _padded(nk, capacity)]),
                mx.concatenate([_padded(v, capacity), _padded(nv, capacity)]),
            )
            for (k, v), (nk, nv) in zip(self.layers, rows, strict=True)
        ]
        self.lengths = [*self.lengths, rows[0][0].shape[2]]
        self.offsets = mx.array(self.lengths, dtype=mx.int32)

    def keep(self, rows: list[int]) -> None:
        """Keep these rows, in this order; the buffers shrink to what they need."""
        self.lengths = [self.lengths[r] for r in rows]
        capacity = min(self.capacity, _rounded(max(self.lengths, default=0), self.step))
        index = mx.array(rows, dtype=mx.int32)
        self.layers = [(k[index, :, :capacity], v[index, :, :capacity]) for k, v in self.layers]
        self.offsets = mx.array(self.lengths, dtype=mx.int32)

    def row(self, b: int) -> Rows:
        """Row b's filled keys and values, every layer, [1, H, T_b, D] (views)."""
        n = self.lengths[b]
        return [(k[b : b + 1, :, :n], v[b : b + 1, :, :n]) for k, v in self.layers]

    def forward(self, forward: BatchForward, ids: mx.array) -> mx.array:
        """Logits [B, V] for one new token a row (ids [B, 1]), the caches extended by it."""
        if max(self.lengths) + 1 > self.capacity:
            capacity = _rounded(max(self.lengths) + 1, self.step)
            self.layers = [(_padded(k, capacity), _padded(v, capacity)) for k, v in self.layers]
        logits, *buffers = forward(ids, self.offsets, *(a for kv in self.layers for a in kv))
        self.layers = list(zip(buffers[0::2], buffers[1::2], strict=True))
        self.offsets = self.offsets + 1
        self.lengths = [n + 1 for n in self.lengths]
        return logits

    def state(self) -> list[mx.array]:
        return [self.offsets, *(a for kv in self.layers for a in kv)]


_FORWARD = "_omnia_batch_forward"  # kept on the network: every batch reuses its traces


def batch_forward(network: Network) -> BatchForward:
    """The batch's decode step as a function of arrays, compiled unless OMNIA_COMPILE=0: one
    trace per batch size and capacity, kept (with the compiled function, on the network) for
    every later batch of this network."""
    compiled = os.environ.get(COMPILE_ENV, "auto") != "0"
    kept: tuple[bool, BatchForward] | None = getattr(network, _FORWARD, None)
    if kept is not None and kept[0] == compiled:
        return kept[1]

    def forward(ids: mx.array, offsets: mx.array, *buffers: mx.array) -> list[mx.array]:
        rows = [BatchRows(k, v, offsets) for k, v in zip(buffers[0::2], buffers[1::2], strict=True)]
        logits = network(ids, cast(list[KVCache], rows))[:, -1, :]
        return [logits, *(a for r in rows for a in (r.keys, r.values))]

    made = cast(BatchForward, mx.compile(forward)) if compiled else forward
    setattr(network, _FORWARD, (compiled, made))
    return made


def _greedy(seq: BatchSequence) -> int | None:
    """The vocabulary rows whose argmax is the sequence's next token, when that is all its
    sampler does (`Sampler.argmax_rows`)."""
    return getattr(seq.sample, "argmax_rows", None)


def _rounded(n: int, step: int) -> int:
    return max(step, (n + step - 1) // step * step)


def _padded(x: mx.array, capacity: int) -> mx.array:
    """x [B, H, T, D] with zero rows appended up to `capacity`, or cut to it."""
    extra = capacity - x.shape[2]
    if extra <= 0:
        return x[:, :, :capacity] if extra < 0 else x
    return mx.concatenate([x, mx.zeros((*x.shape[:2], extra, x.shape[3]), x.dtype)], axis=2)


def batchable(network: Network) -> bool:
    """Whether sequences of this network can share a step: its caches are the plain KVCache
    (the batch's rows take theirs over) and the family does not opt out (`batchable = False`)."""
    return getattr(network, "batchable", True) and all(
        type(c) is KVCache for c in network.make_cache()
    )


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
    prefix: Callable[[], Rows | None] | None = None


class BatchDecoding:
    """The sequences being decoded together. `add` a sequence (optionally with a cached prefix of
    its prompt), call `step` for tokens, `remove` a sequence when its consumer is done with it."""

    def __init__(
        self, network: Network, on_join: Callable[[BatchSequence], None] | None = None
    ) -> None:
        self._network = network
        self._on_join = on_join  # told of each sequence whose prompt is in (a prefix cache)
        self.waiting: deque[BatchSequence] = deque()
        self.running: list[BatchSequence] = []
        self._caches: BatchCache | None = None
        self._forward_batch = batch_forward(network)
        # sequences of a network that cannot batch run one after another
        self.limit = None if batchable(network) else 1

    def add(
        self,
        prompt: Sequence[int],
        sample: Callable[[mx.array], mx.array],
        follow: Callable[[int], None] | None = None,
        prefix: Callable[[], Rows | None] | None = None,
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
            index = self.running.index(seq)
            self.running.pop(index)
            if self._caches is not None:
                self._caches.keep([i for i in range(len(self.running) + 1) if i != index])
                if len(self.running) == 1:
                    self._go_alone()
        if seq.decoding is not None:
            seq.decoding.close()
            seq.decoding = None

    def rows(self, seq: BatchSequence) -> Rows:
        """A running sequence's keys and values so far (views), e.g. for a prefix cache."""
        if seq.decoding is not None:
            return seq.decoding.rows()
        if self._caches is None or seq not in self.running:
            raise ValueError("the sequence is not decoding")
        return self._caches.row(self.running.index(seq))

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
                    row = self.running.index(seq)
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
                groups.setdefault(sampler.row_setting, []).append(
                    (self.running.index(seq), seq, sampler)
                )
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
        ids = mx.stack([cast(mx.array, s.token) for s in self.running])[:, None]
        logits = caches.forward(self._forward_batch, ids)
        evaluate_async([logits, *caches.state()])
        return logits

    def _prefill_chunk(self, seq: BatchSequence, budget: int) -> int:
        """Prefill up to `budget` more prompt tokens of `seq`; it joins once its prompt is in.
        Returns the tokens fed."""
        if seq.decoding is None:
            rows = seq.prefix() if seq.prefix is not None else None
            seq.decoding = Decoding(self._network, rows or ())
            seq.fed = seq.decoding.length
            if seq.fed >= len(seq.prompt):
                raise ValueError("a cached prefix must leave a prompt token to prefill")
        start = seq.fed
        end = min(len(seq.prompt), start + budget)
        logits = seq.decoding.feed(seq.prompt[start:end], last_only=True)
        seq.fed = end
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

    def _join(self, seq: BatchSequence) -> None:
        """A prefilled sequence joins the running ones."""
        self.running.append(seq)
        if len(self.running) == 1:
            return  # alone: it decodes on its Decoding
        decoding = seq.decoding
        assert decoding is not None
        if self._caches is None:  # the one decoding alone hands its rows to the batch
            first = self.running[0]
            assert first.decoding is not None
            self._caches = BatchCache.stack([first.decoding.rows(), decoding.rows()])
            first.decoding.close()
            first.decoding = None
        else:
            self._caches.append(decoding.rows())
        evaluate(self._caches.state())
        decoding.close()
        seq.decoding = None

    def _go_alone(self) -> None:
        """One sequence is left: it takes its row back to a Decoding of its own."""
        rows = cast(BatchCache, self._caches).row(0)
        evaluate([a for r in rows for a in r])
        self.running[0].decoding = Decoding(self._network, rows)
        self._caches = None
