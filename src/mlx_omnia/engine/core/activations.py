"""The activations a family's forward applies between declarations, as the binding pass can
trace them (core/trace.py): `self.down_proj(silu(self.gate_proj(x)) * self.up_proj(x))`."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from mlx_omnia.engine.core import mxcompat
from mlx_omnia.engine.core.layers import Gate
from mlx_omnia.engine.core.trace import traceable

silu = traceable(mxcompat.silu)
gelu_tanh = traceable(mxcompat.gelu_tanh)

# What a gated Projections computes for each activation: act(gate) * up (core/fusion.py).
GATES: dict[Callable[[mx.array], mx.array], Gate] = {
    mxcompat.silu: "silu", mxcompat.gelu_tanh: "gelu_tanh",
}
