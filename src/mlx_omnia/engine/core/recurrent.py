"""Declarations of recurrent arithmetic shared by the hybrid and state-space families (design
rule 4): what a layer that is not attention computes from token to token, with its state in the
sequence's `RecurrentState` (core/state.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import mlx.core as mx

from mlx_omnia.engine.core.binding import Declaration
from mlx_omnia.engine.core.mxcompat import silu
from mlx_omnia.engine.core.state import RecurrentState, StaticRecurrentState

State = RecurrentState | StaticRecurrentState
Activation = Literal["silu"]


class ShortConv(Declaration):
    """Causal depthwise convolution over time: channel c of output t is

        y[t, c] = sum_j weight[c, 0, j] * x[t - (K - 1) + j, c]  (+ bias[c]), j = 0 .. K-1

    (then `activation`), where inputs before the sequence's first token are zeros. `weight` is
    [channels, 1, K] as a torch Conv1d with groups = channels stores it. The state (`name` in the
    layer's RecurrentState) holds the last K - 1 inputs [B, K - 1, channels], oldest first, so a
    chunk or a single token continues where the one before stopped."""

    weight: mx.array
    bias: mx.array

    def __init__(
        self, channels: int, kernel_size: int, *, bias: bool = False,
        activation: Activation | None = None, name: str = "conv",
    ) -> None:
        super().__init__()
        self.channels = channels
        self.kernel_size = kernel_size
        self.activation = activation
        self.name = name
        self.weight = mx.zeros((channels, 1, kernel_size))
        if bias:
            self.bias = mx.zeros((channels,))
        self._bound: Callable[[mx.array, State | None], mx.array] = self.reference()

    def reference(self) -> Callable[[mx.array, State | None], mx.array]:
        k = self.kernel_size

        def conv(x: mx.array, state: State | None) -> mx.array:
            b, length, c = x.shape
            before = state.get(self.name) if state is not None else None
            if before is None:
                before = mx.zeros((b, k - 1, c), x.dtype)
            window = mx.concatenate([before.astype(x.dtype), x], axis=1)  # [B, K-1+L, C]
            taps = self.weight[:, 0, :].astype(x.dtype)  # [C, K]
            y = window[:, 0:length] * taps[:, 0]
            for j in range(1, k):
                y = y + window[:, j : j + length] * taps[:, j]
            if "bias" in self:
                y = y + self.bias.astype(x.dtype)
            if state is not None:
                state.put(self.name, window[:, length:])
            return silu(y) if self.activation == "silu" else y

        return conv

    def __call__(self, x: mx.array, state: State | None) -> mx.array:
        return self._bound(x, state)
