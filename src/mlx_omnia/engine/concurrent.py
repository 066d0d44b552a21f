"""`Batch`: continuous batching of one model's generations. Requests join and leave at any step;
each keeps its own options (sampling, penalties, bias, stops, limits, logprobs, grammar), and a
greedy answer is the one `Model.stream` gives alone. With a prefix cache, a prompt whose first
blocks of tokens were seen before (an agent resending its conversation) is prefilled from its
first new block only."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import mlx.core as mx

from mlx_omnia.engine.core.cache import PARTS
from mlx_omnia.engine.generate.batch import BatchDecoding, BatchSequence
from mlx_omnia.engine.generate.loop import Network
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


Event = tuple[Generation, list[Piece] | Exception]


class Batch:
    """Generations of `model` sharing decode steps. `add` a request (checked at once, like
    `Model.stream`), then call `step` while `len(batch)`: each step hands out the pieces each
    generation completed, or the error that ended it; a generation whose last piece (with
    `finish_reason`) is out has left. `cancel` drops one at once."""

    def __init__(self, model: Model, prefix_cache: PrefixStore | None = None) -> None:
        network: Network = model.network
        self.model = model
        self.prefix_cache = prefix_cache
        self._decoding = BatchDecoding(
            network, None if prefix_cache is None else lambda seq: self._keep(seq, seq.prompt)
        )
        self._sequences: dict[Generation, BatchSequence] = {}
        self._ready: list[Event] = []  # answers that need no token (max_tokens 0)

    def __len__(self) -> int:
        return len(self._sequences) + len(self._ready)

    @property
    def running(self) -> int:
        """Generations decoding now (the others wait for their prefill)."""
        return len(self._decoding.running)

    def add(self, input: Chat | str, options: GenerationOptions | None = None) -> Generation:
        generation = self.model.generation(input, options)
        if not generation.needs_tokens:
            self._ready.append((generation, generation.add(None)))
            return generation

        def prefix() -> list[tuple[mx.array, ...]] | None:  # when its prefill starts
            rows = self._cached_prefix(generation.prompt)
            generation.cached_tokens = rows[0][0].shape[2] if rows else 0
            return rows

        seq = self._decoding.add(
            generation.prompt, generation.sample, generation.follow,
            prefix if self.prefix_cache is not None else None,
        )
        self._sequences[generation] = seq
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
        for seq, value in self._decoding.step():
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
        if seq.failed is None and seq in self._decoding.running:
            # the answer's tokens in the cache: a next turn that repeats them finds them
            self._keep(seq, [*seq.prompt, *seq.emitted])
        self._leave(seq)

    def _leave(self, seq: BatchSequence) -> None:
        self._decoding.remove(seq)

    @property
    def _names(self) -> tuple[str, ...]:
        """A layer's cache arrays, as blocks name them."""
        return ("keys", "values") if self.model.kv_format is None else PARTS

    @property
    def _model_key(self) -> str:
        """What the prefix cache keys this model's blocks by: what it computes with, and how it
        caches (a quantized cache's blocks are its codes)."""
        format = self.model.kv_format
        return self.model.identity + ("" if format is None else f"/kv-{format.name}")

    def _cached_prefix(self, prompt: list[int]) -> list[tuple[mx.array, ...]] | None:
        """Each layer's keys and values of the prompt's longest cached run of blocks (at least
        one prompt token is left to prefill: its logits sample the first token)."""
        if self.prefix_cache is None:
            return None
        blocks = self.prefix_cache.lookup(self._model_key, prompt[:-1])  # keyed by the format
        if not blocks:
            return None
        names = self._names
        return [
            tuple(mx.concatenate([b[i][name] for b in blocks], axis=2) for name in names)
            for i in range(len(blocks[0]))
        ]

    def _keep(self, seq: BatchSequence, tokens: list[int]) -> None:
        """Offer the sequence's whole blocks to the prefix cache (those it lacks are sliced)."""
        if self.prefix_cache is None:
            return
        rows = self._decoding.rows(seq)
        tokens = tokens[: rows[0][0].shape[2]]  # what the cache holds (the last token is not fed)
        size = self.prefix_cache.block_tokens

        names = self._names

        def state_of(i: int) -> BlockState:
            block = slice(i * size, (i + 1) * size)
            return [{n: a[:, :, block] for n, a in zip(names, layer, strict=True)} for layer in rows]

        self.prefix_cache.store(self._model_key, tokens, state_of)
