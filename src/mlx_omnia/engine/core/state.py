"""The state of one recurrent layer of one sequence: what a layer that is not attention carries
from token to token (a short convolution's last inputs, an SSM's or a delta rule's state).

Unlike a KV cache it does not grow: a step reads the state and replaces it whole. A layer asks
`get(name)` (None before the sequence's first token: the layer starts from its own zeros) and
writes `put(name, value)`. `RecurrentState` is the eager form, prefill's; `StaticRecurrentState`
the compiled decode step's, whose arrays live in `state` (the compiled function's implicit
inputs and outputs, as a StaticKVCache's buffers), so a family's layer reads and writes both
through the same two methods."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import mlx.core as mx


class RecurrentState:
    """A recurrent layer's state arrays, by the names its layer declares (`names`: a short
    convolution's window, a delta rule's state...), unset until the layer's first call."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = tuple(names)
        self.arrays: dict[str, mx.array] = {}

    @classmethod
    def filled(cls, names: Sequence[str], rows: Sequence[mx.array]) -> RecurrentState:
        """A state holding `rows` (its arrays in `names` order: a batch's row, taken back)."""
        state = cls(names)
        state.arrays = dict(zip(state.names, rows, strict=True))
        return state

    def get(self, name: str) -> mx.array | None:
        return self.arrays.get(name)

    def put(self, name: str, value: mx.array) -> None:
        if name not in self.names:
            raise KeyError(f"{name!r} is not one of this state's arrays {self.names}")
        self.arrays[name] = value

    @property
    def is_filled(self) -> bool:
        return len(self.arrays) == len(self.names)

    def rows(self) -> tuple[mx.array, ...]:
        """The state arrays [B, ...], in `names` order."""
        return tuple(self.arrays[n] for n in self.names)

    def state(self) -> list[mx.array]:
        """Arrays to evaluate so the state is materialized."""
        return list(self.arrays.values())


class StaticRecurrentState:
    """A recurrent layer's state whose arrays live in `state`: a compiled decode step's (its
    implicit inputs and outputs), or a batch step's, whose arrays hold a row a sequence. It
    never grows, so a compiled step is never traced again for its sake."""

    capacity = sys.maxsize  # rows it fits: any number (CompiledStep asks every cache)

    def __init__(self, names: Sequence[str], arrays: Sequence[mx.array]) -> None:
        self.names = tuple(names)
        self.state: dict[str, mx.array] = dict(zip(self.names, arrays, strict=True))

    @classmethod
    def from_state(cls, eager: RecurrentState) -> StaticRecurrentState:
        if not eager.is_filled:
            raise ValueError("run the layer (prefill) before making its state static")
        return cls(eager.names, eager.rows())

    def load(self, eager: RecurrentState) -> None:
        """Take over a prefilled eager state, in place (the compiled step keeps `state`)."""
        if eager.names != self.names or not eager.is_filled:
            raise ValueError("a state of other arrays than this step's")
        self.state.update(eager.arrays)

    def drop(self) -> None:
        """The sequence ended: nothing to let go of that the next `load` does not replace (the
        arrays are a token's worth of state, not a growing buffer)."""

    def reserve(self, total: int) -> None:
        """Nothing to grow."""

    def get(self, name: str) -> mx.array | None:
        return self.state.get(name)

    def put(self, name: str, value: mx.array) -> None:
        self.state[name] = value

    def rows(self, end: int = 0) -> tuple[mx.array, ...]:
        """The state arrays, in `names` order (`end`, the sequence's length, is what they
        hold: a state has no rows to cut)."""
        return tuple(self.state[n] for n in self.names)
