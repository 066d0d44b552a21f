"""Key/value cache for one attention layer, grown in fixed steps to avoid a copy per token."""

from __future__ import annotations

import mlx.core as mx


class KVCache:
    """Keys and values of one layer: [B, n_kv_heads, T, head_dim], preallocated in `step` rows."""

    step = 256

    def __init__(self) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        n = keys.shape[2]
        prev = self.offset
        if self.keys is None or self.values is None or prev + n > self.keys.shape[2]:
            b, h, _, dk = keys.shape
            dv = values.shape[3]
            grow = ((n + self.step - 1) // self.step) * self.step
            new_k = mx.zeros((b, h, grow, dk), keys.dtype)
            new_v = mx.zeros((b, h, grow, dv), values.dtype)
            if self.keys is not None and self.values is not None:
                self.keys = mx.concatenate([self.keys[..., :prev, :], new_k], axis=2)
                self.values = mx.concatenate([self.values[..., :prev, :], new_v], axis=2)
            else:
                self.keys, self.values = new_k, new_v
        self.offset += n
        self.keys[..., prev : self.offset, :] = keys
        self.values[..., prev : self.offset, :] = values
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    def state(self) -> list[mx.array]:
        """Arrays to evaluate so the cache is materialized."""
        return [a for a in (self.keys, self.values) if a is not None]
