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

import mlx.core as mx


class RecurrentState:
    """A recurrent layer's named state arrays, empty until the layer's first call."""

    def __init__(self) -> None:
        self.arrays: dict[str, mx.array] = {}

    def get(self, name: str) -> mx.array | None:
        return self.arrays.get(name)

    def put(self, name: str, value: mx.array) -> None:
        self.arrays[name] = value

    @property
    def filled(self) -> bool:
        return bool(self.arrays)

    def rows(self) -> tuple[mx.array, ...]:
        """The state arrays, in name order."""
        return tuple(self.arrays[n] for n in sorted(self.arrays))

    def state(self) -> list[mx.array]:
        """Arrays to evaluate so the state is materialized."""
        return list(self.arrays.values())


class StaticRecurrentState:
    """A recurrent layer's state for compiled decode steps: the arrays live in `state`. It never
    grows, so a compiled step built on it is never traced again for its sake."""

    capacity = sys.maxsize  # rows it fits: any number (CompiledStep asks every cache)

    def __init__(self, arrays: dict[str, mx.array]) -> None:
        self.state: dict[str, mx.array] = dict(arrays)

    @classmethod
    def from_state(cls, eager: RecurrentState) -> StaticRecurrentState:
        if not eager.filled:
            raise ValueError("run the layer (prefill) before making its state static")
        return cls(eager.arrays)

    def load(self, eager: RecurrentState) -> None:
        """Take over a prefilled eager state, in place (the compiled step keeps `state`)."""
        if set(eager.arrays) != set(self.state):
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

    def rows(self, end: int) -> tuple[mx.array, ...]:
        """The state arrays, in name order (`end`, the sequence's length, is what they hold)."""
        return tuple(self.state[n] for n in sorted(self.state))
