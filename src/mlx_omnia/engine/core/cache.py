"""Key/value caches for one attention layer.

`KVCache` is the eager cache: a host-side offset, buffers grown in fixed steps, and it hands
attention exactly the filled rows. `StaticKVCache` is what a compiled decode step runs on: the
buffers and the offset are arrays in `state` (a compiled function's implicit inputs and
outputs), so one traced step serves every position until the buffer grows; attention then sees
the whole buffer and a mask of the filled rows.

The static offset is an int32 array of OFFSET_SLOTS copies of the offset, not a 0-d array: MLX's
CUDA allocator (0.32) serves arrays of 8 bytes or less from one pool of managed memory advised
read-mostly, shared with every other scalar, so a kernel writing the next offset there
invalidates the page and a read of an offset cost 3-7 us per layer (H200, 2026-12-03,
scripts/device/attention_trace.py). 16 bytes come from ordinary device-resident buffers."""

from __future__ import annotations

from typing import Literal

import mlx.core as mx

Mask = mx.array | Literal["causal"] | None
OFFSET_SLOTS = 4  # the static offset's width: 16 bytes, past MLX's small-array pool on CUDA


def offset_array(offset: int) -> mx.array:
    """A static cache's offset: OFFSET_SLOTS int32 copies of it."""
    return mx.full((OFFSET_SLOTS,), offset, dtype=mx.int32)


def visibility(q_start: mx.array | int, queries: int, keys: int, window: int | None) -> mx.array:
    """Boolean [queries, keys]: query i (at position q_start + i) sees key j when j <= its
    position and, with a sliding window, j > position - window."""
    q_pos = mx.arange(queries)[:, None] + q_start
    k_pos = mx.arange(keys)[None, :]
    visible = k_pos <= q_pos
    if window is not None:
        visible = visible & (k_pos > q_pos - window)
    return visible


class KVCache:
    """Keys and values of one layer: [B, n_kv_heads, T, head_dim], preallocated in `step` rows."""

    step = 256

    def __init__(self) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0

    @classmethod
    def filled(cls, keys: mx.array, values: mx.array) -> KVCache:
        """A cache holding `keys`, `values` [1, H, T, D] (T rows: a prefix cache's blocks, a
        batch's row): the next update appends after them."""
        cache = cls()
        cache.keys, cache.values, cache.offset = keys, values, keys.shape[2]
        return cache

    def rows(self, start: int = 0, end: int | None = None) -> tuple[mx.array, mx.array]:
        """Keys and values of rows [start, end) (default: every filled row), views."""
        if self.keys is None or self.values is None:
            raise ValueError("the cache is empty")
        stop = self.offset if end is None else end
        return self.keys[..., start:stop, :], self.values[..., start:stop, :]

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

    def attention_mask(self, queries: int, keys: int, window: int | None) -> Mask:
        """The mask for `queries` new rows attending over the `keys` rows just fetched."""
        if window is None or (keys <= window and queries == 1):
            return "causal" if queries > 1 else None
        return visibility(keys - queries, queries, keys, window)

    def state(self) -> list[mx.array]:
        """Arrays to evaluate so the cache is materialized."""
        return [a for a in (self.keys, self.values) if a is not None]


class StaticKVCache:
    """A cache whose buffers and offset live in `state`, for compiled decode steps.

    The host calls `reserve(total)` before a step that would outgrow the buffer (growing it is a
    shape change, so the compiled step is traced again for the new size)."""

    step = 256

    def __init__(self, keys: mx.array, values: mx.array, length: int) -> None:
        self.state: dict[str, mx.array] = {
            "keys": keys,
            "values": values,
            "offset": offset_array(length),
        }
        self._start = self.state["offset"]

    @classmethod
    def from_cache(cls, cache: KVCache) -> StaticKVCache:
        if cache.keys is None or cache.values is None:
            raise ValueError("fill the cache (prefill) before making it static")
        return cls(cache.keys, cache.values, cache.offset)

    def load(self, cache: KVCache) -> None:
        """Take over a prefilled eager cache, in place (the compiled step keeps `state`)."""
        if cache.keys is None or cache.values is None:
            raise ValueError("fill the cache (prefill) before making it static")
        self.state["keys"], self.state["values"] = cache.keys, cache.values
        self.state["offset"] = offset_array(cache.offset)
        self._start = self.state["offset"]

    def drop(self) -> None:
        """Let go of the buffers (the sequence ended); `load` gives the cache new ones."""
        keys, values = self.state["keys"], self.state["values"]
        self.state["keys"] = mx.zeros((*keys.shape[:2], 0, keys.shape[3]), keys.dtype)
        self.state["values"] = mx.zeros((*values.shape[:2], 0, values.shape[3]), values.dtype)

    @property
    def capacity(self) -> int:
        return self.state["keys"].shape[2]

    def reserve(self, total: int) -> None:
        """Grow the buffers (outside any compiled step) so `total` rows fit."""
        if total <= self.capacity:
            return
        grow = ((total - self.capacity + self.step - 1) // self.step) * self.step
        for name in ("keys", "values"):
            buf = self.state[name]
            pad = mx.zeros((*buf.shape[:2], grow, buf.shape[3]), buf.dtype)
            self.state[name] = mx.concatenate([buf, pad], axis=2)

    @property
    def offset(self) -> mx.array:
        """The offset, 0-d (a view of the state's first slot)."""
        return self.state["offset"][0]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        start = self.state["offset"]
        self._start = start
        self.state["keys"] = mx.slice_update(self.state["keys"], keys, start[:1], axes=(2,))
        self.state["values"] = mx.slice_update(self.state["values"], values, start[:1], axes=(2,))
        self.state["offset"] = start + keys.shape[2]
        return self.state["keys"], self.state["values"]

    def attention_mask(self, queries: int, keys: int, window: int | None) -> Mask:
        return visibility(self._start[0], queries, keys, window)

    def advance(self, start: mx.array, following: mx.array | None = None) -> None:
        """Record one row written at `start` (the state's offset array) by a kernel that updates
        the buffers in place; `following` is start + 1 when the kernel computed it (every slot)."""
        self._start = start
        self.state["offset"] = start + 1 if following is None else following

    def arrays(self) -> list[mx.array]:
        return list(self.state.values())


class BatchRows:
    """One layer's keys and values for a batch of sequences of different lengths, as a decode
    step sees them: row b holds its sequence's rows at [0, offset[b]) of [B, H, capacity, D],
    and an update writes every row at its own offset (`offset` is the [B] array a rope takes).
    Attention sees the whole buffer and a mask of each row's filled part. Pure array work (no
    host state), so a compiled step can run on it; the capacity is the host's to reserve."""

    def __init__(self, keys: mx.array, values: mx.array, offsets: mx.array) -> None:
        self.keys, self.values = keys, values
        self._offsets = self._start = offsets

    @property
    def offset(self) -> mx.array:
        """Each row's length, int32 [B]."""
        return self._offsets

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        n = keys.shape[2]
        start = self._offsets
        columns = start[:, None, None, None] + mx.arange(n, dtype=mx.int32)[None, None, :, None]
        self.keys = mx.put_along_axis(
            self.keys, mx.broadcast_to(columns, keys.shape), keys, axis=2
        )
        self.values = mx.put_along_axis(
            self.values, mx.broadcast_to(columns, values.shape), values, axis=2
        )
        self._start = start
        self._offsets = start + n
        return self.keys, self.values

    def advance(self) -> None:
        """Record one row a sequence written at each offset by a kernel that updates the buffers
        in place."""
        self._start = self._offsets
        self._offsets = self._offsets + 1

    def attention_mask(self, queries: int, keys: int, window: int | None) -> Mask:
        """Boolean [B, 1, queries, keys]: each row's queries see its own filled rows only."""
        q_pos = self._start[:, None, None, None] + mx.arange(queries)[None, None, :, None]
        k_pos = mx.arange(keys)[None, None, None, :]
        visible = k_pos <= q_pos
        if window is not None:
            visible = visible & (k_pos > q_pos - window)
        return visible
