"""`Batch`: continuous batching of one model's generations. Requests join and leave at any step;
each keeps its own options (sampling, penalties, bias, stops, limits, logprobs, grammar), and a
greedy answer is the one `Model.stream` gives alone. With a prefix cache, a prompt whose first
blocks of tokens were seen before (an agent resending its conversation) is prefilled from its
first new block only. A model with recurrent layers resumes them from an anchor, their state
after a whole block (kept as a sequence passes block ends): its prompt is prefilled from the
last anchored block its cached run reaches."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import mlx.core as mx

from mlx_omnia.engine.core.cache import PARTS, KVFormat
from mlx_omnia.engine.generate.batch import BatchDecoding, BatchSequence, Layout, Rows, layout_of
from mlx_omnia.engine.model import Generation, Model
from mlx_omnia.engine.types import Chat, GenerationOptions, Piece

LayerState = dict[str, mx.array]
BlockState = list[LayerState]


class PrefixStore(Protocol):
    """What a batch needs of a prefix cache (`PrefixCache`): blocks of `block_tokens` tokens'
    per-layer state, addressed by the model and every token up to the block's end."""

    @property
    def block_tokens(self) -> int: ...

    def lookup(self, model_key: str, tokens: Sequence[int]) -> list[BlockState]: ...

    def store(
        self, model_key: str, tokens: Sequence[int], state_of: Callable[[int], BlockState]
    ) -> int: ...

    def store_anchor(self, model_key: str, tokens: Sequence[int], state: BlockState) -> bool: ...

    def anchor(self, model_key: str, tokens: Sequence[int]) -> tuple[int, BlockState] | None: ...


Event = tuple[Generation, list[Piece] | Exception]


class Batch:
    """Generations of `model` sharing decode steps. `add` a request (checked at once, like
    `Model.stream`), then call `step` while `len(batch)`: each step hands out the pieces each
    generation completed, or the error that ended it; a generation whose last piece (with
    `finish_reason`) is out has left. `cancel` drops one at once."""

    def __init__(self, model: Model, prefix_cache: PrefixStore | None = None) -> None:
        self.model = model
        self.prefix_cache = prefix_cache
        self._layout: Layout = layout_of(model.network)
        self._recurrent = any(names is not None for names in self._layout)
        # one group of sequences a KV format (a request may ask for its own: `kv_bits`); each
        # group steps on its own (its caches and compiled step are of its format)
        self._groups: dict[KVFormat | None, BatchDecoding] = {}
        self._sequences: dict[Generation, BatchSequence] = {}
        self._group_of: dict[BatchSequence, BatchDecoding] = {}
        self._ready: list[Event] = []  # answers that need no token (max_tokens 0)

    def __len__(self) -> int:
        return len(self._sequences) + len(self._ready)

    @property
    def running(self) -> int:
        """Generations decoding now (the others wait for their prefill)."""
        return sum(len(group.running) for group in self._groups.values())

    def add(self, input: Chat | str, options: GenerationOptions | None = None) -> Generation:
        generation = self.model.generation(input, options)
        if not generation.needs_tokens:
            self._ready.append((generation, generation.add(None)))
            return generation

        format = generation.kv_format

        def prefix() -> tuple[Rows, int] | None:  # when its prefill starts
            found = self._cached_prefix(generation.prompt, format)
            generation.cached_tokens = found[1] if found else 0
            return found

        group = self._group(format)
        seq = group.add(
            generation.prompt, generation.sample, generation.follow,
            prefix if self.prefix_cache is not None else None,
        )
        self._sequences[generation] = seq
        self._group_of[seq] = group
        return generation

    def cancel(self, generation: Generation) -> None:
        """Stop a generation now (a client went away); the others go on."""
        seq = self._sequences.pop(generation, None)
        if seq is not None:
            self._leave(seq)
        self._ready = [(g, e) for g, e in self._ready if g is not generation]

    def step(self) -> list[Event]:
        events, self._ready = self._ready, []
        if not self._sequences:
            return events
        by_seq = {seq: g for g, seq in self._sequences.items()}
        pieces: dict[Generation, list[Piece]] = {}
        stepped = [group.step() for group in list(self._groups.values())
                   if group.running or group.waiting]
        for seq, value in (out for outs in stepped for out in outs):
            generation = by_seq[seq]
            if generation not in self._sequences:
                continue  # ended earlier in this step
            if isinstance(value, Exception):
                events.append((generation, value))
                self._end(generation)
                continue
            try:
                pieces.setdefault(generation, []).extend(generation.add(value))
            except Exception as e:  # this answer's detokenizer, parser...: it alone ends
                events.append((generation, e))
                pieces.pop(generation, None)
                self._end(generation)
                continue
            if generation.done:
                self._end(generation)
        events.extend(pieces.items())
        return events

    # -- internals ---------------------------------------------------------------------------
    def _end(self, generation: Generation) -> None:
        seq = self._sequences.pop(generation)
        if seq.failed is None and seq in self._group_of[seq].running:
            # the answer's tokens in the cache: a next turn that repeats them finds them
            self._keep(seq, [*seq.prompt, *seq.emitted])
        self._leave(seq)

    def _leave(self, seq: BatchSequence) -> None:
        group = self._group_of.pop(seq)
        group.remove(seq)
        if not (group.running or group.waiting):
            del self._groups[group.format]

    def _group(self, format: KVFormat | None) -> BatchDecoding:
        group = self._groups.get(format)
        if group is None:
            keep: Callable[[BatchSequence], None] | None = None
            if self.prefix_cache is not None:
                keep = self._keep_prompt
            anchors = None
            if self.prefix_cache is not None and self._recurrent:
                anchors = self.prefix_cache.block_tokens
            group = self._groups[format] = BatchDecoding(
                self.model.network, keep, format, anchor_every=anchors
            )
        return group

    @staticmethod
    def _names(format: KVFormat | None) -> tuple[str, ...]:
        """A layer's cache arrays, as blocks name them."""
        return ("keys", "values") if format is None else PARTS

    def _model_key(self, format: KVFormat | None) -> str:
        """What the prefix cache keys this model's blocks by: what it computes with, and how its
        sequence caches (a quantized cache's blocks are its codes)."""
        return self.model.identity + ("" if format is None else f"/kv-{format.name}")

    def _cached_prefix(self, prompt: list[int], format: KVFormat | None) -> tuple[Rows, int] | None:
        """Each layer's keys and values (in `format`) of the prompt's longest cached run of
        blocks, and how many tokens that is (at least one prompt token is left to prefill: its
        logits sample the first token); with recurrent layers, the run up to its last anchor,
        whose states they resume from."""
        if self.prefix_cache is None:
            return None
        key = self._model_key(format)
        blocks = self.prefix_cache.lookup(key, prompt[:-1])
        anchored: BlockState = []
        if blocks and self._recurrent:
            found = self.prefix_cache.anchor(key, prompt[: len(blocks) * self.prefix_cache.block_tokens])
            n, anchored = found if found is not None else (0, [])
            blocks = blocks[:n]
        if not blocks:
            return None
        names = self._names(format)
        rows: Rows = [
            tuple(anchored[i][n] for n in state) if state is not None
            else tuple(mx.concatenate([b[i][name] for b in blocks], axis=2) for name in names)
            for i, state in enumerate(self._layout)
        ]
        return rows, len(blocks) * self.prefix_cache.block_tokens

    def _keep_prompt(self, seq: BatchSequence) -> None:
        self._keep(seq, seq.prompt)

    def _keep(self, seq: BatchSequence, tokens: list[int]) -> None:
        """Offer the sequence's whole blocks to the prefix cache (those it lacks are sliced)."""
        if self.prefix_cache is None:
            return
        group = self._group_of[seq]
        rows = group.rows(seq)
        tokens = tokens[: group.length(seq)]  # what the cache holds (the last token is not fed)
        size = self.prefix_cache.block_tokens
        key = self._model_key(group.format)
        names = self._names(group.format)

        def state_of(i: int) -> BlockState:  # a recurrent layer's rows are no block's
            block = slice(i * size, (i + 1) * size)
            return [{} if state is not None else
                    {n: a[:, :, block] for n, a in zip(names, layer, strict=True)}
                    for layer, state in zip(rows, self._layout, strict=True)]

        self.prefix_cache.store(key, tokens, state_of)
        if seq.anchor is not None and 0 < seq.anchor[0] <= len(tokens):
            at, states = seq.anchor
            self.prefix_cache.store_anchor(key, tokens[:at], [
                {} if state is None else dict(zip(state, layer, strict=True))
                for layer, state in zip(states, self._layout, strict=True)
            ])
