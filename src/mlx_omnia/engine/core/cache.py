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

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import mlx.core as mx

from mlx_omnia.engine.core.state import RecurrentState, StaticRecurrentState

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


def _filled_mask(queries: int, keys: int, window: int | None) -> Mask:
    """An eager cache's mask: `queries` new rows over the `keys` filled rows just fetched."""
    if window is None or (keys <= window and queries == 1):
        return "causal" if queries > 1 else None
    return visibility(keys - queries, queries, keys, window)


# A cache's rows grow in whole steps, and past four steps in quarters of the power of two below
# the rows wanted (1024 -> 1280 -> ... -> 2048 -> 2560 -> ... -> 16384 -> 20480): at most a
# quarter spare, and a long sequence's compiled decode step (traced once per buffer size) is
# traced again about four times per doubling of its length, not every `step` rows.
CAPACITY_PARTS = 4


def capacity_for(total: int, step: int) -> int:
    """The rows a cache holds when `total` must fit (whole steps; coarser as it grows)."""
    unit = max(step, (1 << max(0, total.bit_length() - 1)) // CAPACITY_PARTS)
    return -(-total // unit) * unit


def _reserve(state: dict[str, mx.array], names: Sequence[str], total: int, step: int) -> None:
    """Grow a static cache's buffers `names` (along rows) so `total` rows fit."""
    capacity = state[names[0]].shape[2]
    if total <= capacity:
        return
    grow = capacity_for(total, step) - capacity
    for name in names:
        buf = state[name]
        pad = mx.zeros((*buf.shape[:2], grow, buf.shape[3]), buf.dtype)
        state[name] = mx.concatenate([buf, pad], axis=2)


class KVCache:
    """Keys and values of one layer: [B, n_kv_heads, T, head_dim], preallocated as
    `capacity_for` says (whole `step`s, coarser as the sequence grows)."""

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
            grow = capacity_for(prev + n, self.step) - prev
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
        return _filled_mask(queries, keys, window)

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

    def rows(self, end: int) -> tuple[mx.array, ...]:
        """Keys and values of rows [0, end), views."""
        return self.state["keys"][:, :, :end], self.state["values"][:, :, :end]

    def reserve(self, total: int) -> None:
        """Grow the buffers (outside any compiled step) so `total` rows fit."""
        _reserve(self.state, ("keys", "values"), total, self.step)

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
        columns = _columns(start, n)
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
        return _rows_mask(self._start, queries, keys, window)


# -- quantized caches -------------------------------------------------------------------------
#
# A quantized cache keeps each layer's keys and values as affine `bits`-bit codes with a scale
# and a bias a group of `group_size` of a head's dims (mx.quantize along the last axis), K and V
# separately. A layer's state is then six arrays, each [B, H, T, *] like keys and values:
# PARTS names them. Attention reads the codes directly (`quantized_attention`).

Quantized = tuple[mx.array, mx.array, mx.array]  # codes, scales, biases
PARTS = ("keys", "keys_scales", "keys_biases", "values", "values_scales", "values_biases")
KV_BITS = (4, 8)
KV_GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class KVFormat:
    """How a KV cache stores its rows: affine `bits`-bit (8 or 4) in groups of `group_size`
    along each head's dims, keys and values alike."""

    bits: int
    group_size: int = 64

    def __post_init__(self) -> None:
        if self.bits not in KV_BITS or self.group_size not in KV_GROUP_SIZES:
            raise ValueError(
                f"a quantized KV cache takes bits {' or '.join(map(str, KV_BITS))} and group "
                f"size {', '.join(map(str, KV_GROUP_SIZES))} (got {self.bits}, {self.group_size})"
            )

    @property
    def name(self) -> str:
        """How the format is written in options, results and cache keys: "q8", "q4-g32"."""
        return f"q{self.bits}" + ("" if self.group_size == 64 else f"-g{self.group_size}")

    def quantize(self, x: mx.array) -> Quantized:
        """x [..., D] (D a multiple of group_size) as codes, scales and biases."""
        codes, scales, biases = mx.quantize(x, group_size=self.group_size, bits=self.bits)
        return codes, scales, biases

    def dequantize(self, parts: Quantized, dtype: mx.Dtype) -> mx.array:
        """The rows `quantize` gave these codes for (to rounding), in `dtype`."""
        codes, scales, biases = parts
        return mx.dequantize(
            codes, scales, biases, group_size=self.group_size, bits=self.bits
        ).astype(dtype)

    def fits(self, dims: int) -> bool:
        return dims % self.group_size == 0


class QuantizedKVCache:
    """The eager cache, quantized: a host-side offset, buffers grown as `capacity_for` says, and
    attention gets the codes of exactly the filled rows (`update_and_fetch_quantized`)."""

    step = 256

    def __init__(self, format: KVFormat) -> None:
        self.format = format
        self.parts: tuple[mx.array, ...] | None = None  # PARTS' arrays [B, H, capacity, *]
        self.offset = 0

    @classmethod
    def filled(cls, format: KVFormat, parts: Sequence[mx.array]) -> QuantizedKVCache:
        """A cache holding `parts` (PARTS' arrays [1, H, T, *]): a prefix's, a batch's row."""
        cache = cls(format)
        cache.parts, cache.offset = tuple(parts), parts[0].shape[2]
        return cache

    @property
    def keys(self) -> mx.array | None:
        """The keys' codes (None before the first update)."""
        return None if self.parts is None else self.parts[0]

    def rows(self, start: int = 0, end: int | None = None) -> tuple[mx.array, ...]:
        """PARTS' arrays of rows [start, end) (default: every filled row), views."""
        if self.parts is None:
            raise ValueError("the cache is empty")
        stop = self.offset if end is None else end
        return tuple(p[..., start:stop, :] for p in self.parts)

    def update_and_fetch_quantized(
        self, keys: mx.array, values: mx.array
    ) -> tuple[Quantized, Quantized]:
        new = (*self.format.quantize(keys), *self.format.quantize(values))
        n, prev = keys.shape[2], self.offset
        if self.parts is None or prev + n > self.parts[0].shape[2]:
            grow = capacity_for(prev + n, self.step) - prev
            pads = [mx.zeros((*p.shape[:2], grow, p.shape[3]), p.dtype) for p in new]
            if self.parts is None:
                self.parts = tuple(pads)
            else:
                self.parts = tuple(
                    mx.concatenate([p[..., :prev, :], pad], axis=2)
                    for p, pad in zip(self.parts, pads, strict=True)
                )
        self.offset += n
        for p, rows in zip(self.parts, new, strict=True):
            p[..., prev : self.offset, :] = rows
        return _split(self.rows())

    def attention_mask(self, queries: int, keys: int, window: int | None) -> Mask:
        return _filled_mask(queries, keys, window)

    def state(self) -> list[mx.array]:
        return [] if self.parts is None else list(self.parts)


class StaticQuantizedKVCache:
    """StaticKVCache's quantized counterpart, for compiled decode steps: PARTS' buffers and the
    offset are in `state`; attention sees the whole buffer and a mask of the filled rows."""

    step = 256

    def __init__(self, format: KVFormat, parts: Sequence[mx.array], length: int) -> None:
        self.format = format
        self.state: dict[str, mx.array] = dict(zip(PARTS, parts, strict=True))
        self.state["offset"] = offset_array(length)
        self._start = self.state["offset"]

    @classmethod
    def from_cache(cls, cache: QuantizedKVCache) -> StaticQuantizedKVCache:
        if cache.parts is None:
            raise ValueError("fill the cache (prefill) before making it static")
        return cls(cache.format, cache.parts, cache.offset)

    def load(self, cache: QuantizedKVCache) -> None:
        """Take over a prefilled eager cache, in place (the compiled step keeps `state`)."""
        if cache.parts is None:
            raise ValueError("fill the cache (prefill) before making it static")
        self.state.update(zip(PARTS, cache.parts, strict=True))
        self.state["offset"] = offset_array(cache.offset)
        self._start = self.state["offset"]

    def drop(self) -> None:
        """Let go of the buffers (the sequence ended); `load` gives the cache new ones."""
        for name in PARTS:
            p = self.state[name]
            self.state[name] = mx.zeros((*p.shape[:2], 0, p.shape[3]), p.dtype)

    @property
    def capacity(self) -> int:
        return self.state["keys"].shape[2]

    def rows(self, end: int) -> tuple[mx.array, ...]:
        """PARTS' arrays of rows [0, end), views."""
        return tuple(self.state[name][:, :, :end] for name in PARTS)

    def reserve(self, total: int) -> None:
        """Grow the buffers (outside any compiled step) so `total` rows fit."""
        _reserve(self.state, PARTS, total, self.step)

    @property
    def offset(self) -> mx.array:
        return self.state["offset"][0]

    def update_and_fetch_quantized(
        self, keys: mx.array, values: mx.array
    ) -> tuple[Quantized, Quantized]:
        start = self.state["offset"]
        self._start = start
        new = (*self.format.quantize(keys), *self.format.quantize(values))
        for name, rows in zip(PARTS, new, strict=True):
            self.state[name] = mx.slice_update(self.state[name], rows, start[:1], axes=(2,))
        self.state["offset"] = start + keys.shape[2]
        return _split(tuple(self.state[name] for name in PARTS))

    def attention_mask(self, queries: int, keys: int, window: int | None) -> Mask:
        return visibility(self._start[0], queries, keys, window)


class QuantizedBatchRows:
    """BatchRows' quantized counterpart: PARTS' arrays [B, H, capacity, *], row b filled at
    [0, offset[b]); an update writes every row at its own offset."""

    def __init__(self, format: KVFormat, parts: Sequence[mx.array], offsets: mx.array) -> None:
        self.format = format
        self.parts = tuple(parts)
        self._offsets = self._start = offsets

    @property
    def offset(self) -> mx.array:
        return self._offsets

    def update_and_fetch_quantized(
        self, keys: mx.array, values: mx.array
    ) -> tuple[Quantized, Quantized]:
        n = keys.shape[2]
        start = self._offsets
        columns = _columns(start, n)
        new = (*self.format.quantize(keys), *self.format.quantize(values))
        self.parts = tuple(
            mx.put_along_axis(p, mx.broadcast_to(columns, rows.shape), rows, axis=2)
            for p, rows in zip(self.parts, new, strict=True)
        )
        self._start = start
        self._offsets = start + n
        return _split(self.parts)

    def attention_mask(self, queries: int, keys: int, window: int | None) -> Mask:
        return _rows_mask(self._start, queries, keys, window)


QUANTIZED_CACHES = (QuantizedKVCache, StaticQuantizedKVCache, QuantizedBatchRows)


def _split(parts: Sequence[mx.array]) -> tuple[Quantized, Quantized]:
    return (parts[0], parts[1], parts[2]), (parts[3], parts[4], parts[5])


def _columns(start: mx.array, n: int) -> mx.array:
    """Where n new rows go in each batch row b: start[b] + [0, n), shaped [B, 1, n, 1]."""
    return start[:, None, None, None] + mx.arange(n, dtype=mx.int32)[None, None, :, None]


def _rows_mask(start: mx.array, queries: int, keys: int, window: int | None) -> mx.array:
    """Boolean [B, 1, queries, keys]: row b's queries (from start[b]) see its filled rows."""
    q_pos = start[:, None, None, None] + mx.arange(queries)[None, None, :, None]
    k_pos = mx.arange(keys)[None, None, None, :]
    visible = k_pos <= q_pos
    if window is not None:
        visible = visible & (k_pos > q_pos - window)
    return visible


def quantized_attention(
    q: mx.array, keys: Quantized, values: Quantized, format: KVFormat, *, scale: float,
    mask: Mask, sinks: mx.array | None = None, softcap: float | None = None,
) -> mx.array:
    """Attention of q [B, H, L, D] over quantized keys and values [B, Hkv, T, *] (grouped-query
    when Hkv < H), reading the codes directly: scores = q @ dequant(K).T and out = p @ dequant(V)
    as quantized matmuls, the softmax in float32. `mask` as attention_mask gives it."""
    b, heads, length, dims = q.shape
    kv_heads, total = keys[0].shape[1], keys[0].shape[2]
    repeats = heads // kv_heads
    # q head h reads kv head h // repeats: [B, Hkv, repeats, L, D] against [B, Hkv, 1, T, *]
    grouped = mx.reshape(q * scale, (b, kv_heads, repeats, length, dims))
    k = tuple(p[:, :, None] for p in keys)
    v = tuple(p[:, :, None] for p in values)
    bits, group = format.bits, format.group_size
    scores = mx.quantized_matmul(
        grouped, *k, transpose=True, group_size=group, bits=bits
    ).astype(mx.float32)
    if softcap is not None:
        scores = mx.tanh(scores / softcap) * softcap
    if mask == "causal":
        mask = visibility(total - length, length, total, None)
    if isinstance(mask, mx.array):
        visible = mask[:, :, None] if mask.ndim == 4 else mask  # a batch's [B, 1, L, T]
        scores = mx.where(visible, scores, -mx.inf)
    if sinks is not None:
        sink = mx.reshape(sinks.astype(mx.float32), (1, kv_heads, repeats, 1, 1))
        sink = mx.broadcast_to(sink, (*scores.shape[:-1], 1))
        weights = mx.softmax(mx.concatenate([sink, scores], axis=-1), axis=-1)[..., 1:]
    else:
        weights = mx.softmax(scores, axis=-1)
    out = mx.quantized_matmul(
        weights.astype(q.dtype), *v, transpose=False, group_size=group, bits=bits
    )
    return mx.reshape(out, (b, heads, length, out.shape[-1]))


# The network's KV format, set once at load (`set_kv_format`): every sequence's caches follow it.
_KV_FORMAT = "_omnia_kv_format"


def kv_format(network: object) -> KVFormat | None:
    """The KV format a network's sequences cache in (None: keys and values as computed)."""
    return getattr(network, _KV_FORMAT, None)


def set_kv_format(network: object, format: KVFormat | None) -> None:
    setattr(network, _KV_FORMAT, format)


def sequence_caches(
    made: Sequence[KVCache | RecurrentState], format: KVFormat | None
) -> list[KVCache | QuantizedKVCache | RecurrentState]:
    """A new sequence's caches: the family's (`made`), each plain KVCache quantized when the
    sequence's `format` says so (the network's, `kv_format`, or a request's own); a recurrent
    layer's state as made."""
    if format is None:
        return list(made)
    return [QuantizedKVCache(format) if type(c) is KVCache else c for c in made]


def filled_cache(format: KVFormat | None, rows: Sequence[mx.array]) -> KVCache | QuantizedKVCache:
    """An eager cache holding one layer's rows (keys and values, or PARTS when quantized)."""
    if format is None:
        return KVCache.filled(rows[0], rows[1])
    return QuantizedKVCache.filled(format, rows)


def static_cache(
    cache: KVCache | QuantizedKVCache | RecurrentState,
) -> StaticKVCache | StaticQuantizedKVCache | StaticRecurrentState:
    """The static counterpart of a prefilled eager cache, or of a recurrent layer's state (a
    compiled step's)."""
    if isinstance(cache, RecurrentState):
        return StaticRecurrentState.from_state(cache)
    if isinstance(cache, QuantizedKVCache):
        return StaticQuantizedKVCache.from_cache(cache)
    return StaticKVCache.from_cache(cache)
