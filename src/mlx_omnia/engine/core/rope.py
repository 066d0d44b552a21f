"""Rotary embedding parameters from config.json, in both schemas, and the Rope they declare.

transformers 4 wrote `rope_theta` and `rope_scaling` at the top level; transformers 5 writes
`rope_parameters` (a dict, or one dict per layer type). Both read to the same thing here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, cast

import mlx.core as mx
import numpy as np

from mlx_omnia.engine.core.binding import Declaration
from mlx_omnia.engine.core.layers import Rope
from mlx_omnia.engine.errors import UnsupportedModelError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_parameters(config: Mapping[str, Any], layer_type: str | None = None) -> dict[str, Any]:
    """The rope parameters of `config` as one flat dict with `rope_type` and `rope_theta`."""
    params: dict[str, Any] = {}
    new = config.get("rope_parameters")
    if isinstance(new, Mapping):
        new = cast(Mapping[str, Any], new)
        per_layer = new.get(layer_type) if layer_type is not None else None
        if isinstance(per_layer, Mapping):
            params.update(cast(Mapping[str, Any], per_layer))
        elif "rope_type" in new or "rope_theta" in new or "type" in new:
            params.update(new)
    old = config.get("rope_scaling")
    if isinstance(old, Mapping):
        for key, value in cast(Mapping[str, Any], old).items():
            params.setdefault(key, value)
    if "rope_theta" not in params:
        params["rope_theta"] = config.get("rope_theta", 10000.0)
    kind = params.get("rope_type", params.get("type")) or "default"
    params["rope_type"] = kind
    return params


def llama3_periods(dims: int, base: float, params: Mapping[str, Any]) -> np.ndarray:
    """Per-pair periods (1/inv_freq) of llama3 rope scaling, smoothing between the bands."""
    factor = float(params["factor"])
    low = float(params.get("low_freq_factor", 1.0))
    high = float(params.get("high_freq_factor", 4.0))
    old_len = float(params.get("original_max_position_embeddings", 8192))
    inv = 1.0 / (base ** (np.arange(0, dims, 2, dtype=np.float64) / dims))
    wavelen = 2 * math.pi / inv
    low_wavelen, high_wavelen = old_len / low, old_len / high
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    scaled = np.where(medium, smoothed, scaled)
    return 1.0 / scaled


def yarn_periods(dims: int, base: float, params: Mapping[str, Any]) -> tuple[np.ndarray, float]:
    """YaRN (NTK-by-parts) rope scaling: per-pair periods (1/inv_freq) blending interpolated
    (period * factor) and original periods over a linear ramp between the correction dims of
    beta_fast and beta_slow rotations (floored/ceiled unless `truncate` is false), and the
    attention factor the rotated features are multiplied by (`attention_factor`, else from
    mscale/mscale_all_dim, else 0.1 * ln(factor) + 1)."""
    if params.get("factor") is None or params.get("original_max_position_embeddings") is None:
        raise UnsupportedModelError(
            "yarn rope scaling needs factor and original_max_position_embeddings (a family fills "
            "in the latter from max_position_embeddings as transformers does, or refuses yarn)"
        )
    factor = float(params["factor"])
    original = float(params["original_max_position_embeddings"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = params.get("attention_factor")
    if attention is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = mscale(factor, float(m)) / mscale(factor, float(m_all)) if m and m_all else mscale(factor)
    fast = float(params.get("beta_fast") or 32.0)
    slow = float(params.get("beta_slow") or 1.0)

    def correction_dim(rotations: float) -> float:
        return dims * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(fast), correction_dim(slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0.0), min(high, dims - 1.0)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dims // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    periods = base ** (np.arange(0, dims, 2, dtype=np.float64) / dims)
    keep = 1.0 - ramp  # weight of the original (extrapolated) frequency
    inv = (1.0 / (factor * periods)) * ramp + (1.0 / periods) * keep
    return 1.0 / inv, float(attention)


def build_rope(dims: int, params: Mapping[str, Any], *, traditional: bool = False) -> Rope:
    """Declare the Rope for `dims` rotated features with `params` from `rope_parameters`."""
    kind = params["rope_type"]
    base = float(params["rope_theta"])
    if kind == "default":
        return Rope(dims, base=base, traditional=traditional)
    if kind == "linear":
        return Rope(dims, base=base, scale=1.0 / float(params["factor"]), traditional=traditional)
    if kind == "llama3":
        periods = llama3_periods(dims, base, params)
        return Rope(
            dims, base=base, traditional=traditional, freqs=mx.array(periods.astype(np.float32))
        )
    if kind == "yarn":
        periods, attention = yarn_periods(dims, base, params)
        return Rope(
            dims, base=base, traditional=traditional,
            freqs=mx.array(periods.astype(np.float32)), attention_factor=attention,
        )
    raise UnsupportedModelError(
        f"rope scaling type {kind!r} is not supported yet (supported: "
        f"{', '.join(SUPPORTED_ROPE_TYPES)}); please open an issue naming the checkpoint"
    )


class LongRope(Declaration):
    """LongRoPE (Phi-3 "su"/"longrope"): rotary embedding over the first `dims` features whose
    per-pair periods are base periods times `short` factors while the sequence fits in the
    pretraining length `original_max`, times `long` factors beyond it; the rotated features are
    multiplied by `attention_factor` (the features past `dims` pass through unscaled).

    Like transformers, the choice is per call: a call whose last position is past
    `original_max` uses the long periods for all of its positions. A family whose cache crosses
    that boundary must recompute the prefix itself (as transformers' generate does)."""

    def __init__(
        self,
        dims: int,
        *,
        short_periods: mx.array,
        long_periods: mx.array,
        original_max: int,
        attention_factor: float,
    ) -> None:
        super().__init__()
        self.dims = dims
        self.original_max = original_max
        self.attention_factor = attention_factor
        # Kept out of the parameter tree: derived from the config, never loaded.
        self._short = short_periods
        self._long = long_periods
        self._bound: Callable[[mx.array, int | mx.array], mx.array] = self.reference()

    def reference(self) -> Callable[[mx.array, int | mx.array], mx.array]:
        dims, factor, limit = self.dims, self.attention_factor, self.original_max
        short, long = self._short, self._long

        def rotate(x: mx.array, offset: int | mx.array, periods: mx.array) -> mx.array:
            return mx.fast.rope(
                x, dims, traditional=False, base=None, scale=1.0, offset=offset, freqs=periods
            )

        def rope(x: mx.array, offset: int | mx.array) -> mx.array:
            if factor != 1.0:
                if dims < x.shape[-1]:
                    x = mx.concatenate([x[..., :dims] * factor, x[..., dims:]], axis=-1)
                else:
                    x = x * factor
            end = offset + x.shape[-2]
            if isinstance(end, int):
                return rotate(x, offset, long if end > limit else short)
            return mx.where(end > limit, rotate(x, offset, long), rotate(x, offset, short))

        return rope

    def __call__(self, x: mx.array, offset: int | mx.array) -> mx.array:
        return self._bound(x, offset)


def longrope_factor(params: Mapping[str, Any]) -> float:
    """The attention factor of longrope `params`: `attention_factor` when given, else
    sqrt(1 + ln(factor) / ln(original_max)) with factor = `factor` or, as Phi-3 configs imply,
    max_position_embeddings / original_max_position_embeddings (1 when factor <= 1)."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    original = float(params["original_max_position_embeddings"])
    factor = params.get("factor")
    scale = float(factor) if factor is not None else float(params["max_position_embeddings"]) / original
    if scale <= 1.0:
        return 1.0
    return math.sqrt(1.0 + math.log(scale) / math.log(original))


def build_longrope(dims: int, params: Mapping[str, Any]) -> LongRope:
    """Declare the LongRope for `dims` rotated features. `params` (from `rope_parameters`, with
    `original_max_position_embeddings` and `max_position_embeddings` filled in by the family)
    carry `short_factor` and `long_factor`, one per rotated pair."""
    base = float(params["rope_theta"])
    periods = base ** (np.arange(0, dims, 2, dtype=np.int64).astype(np.float64) / dims)
    tables: list[mx.array] = []
    for key in ("short_factor", "long_factor"):
        factors = np.asarray(params[key], dtype=np.float64)
        if factors.shape != periods.shape:
            raise UnsupportedModelError(
                f"longrope {key} has {factors.size} entries, expected {periods.size} "
                f"(one per rotated pair of {dims} features)"
            )
        tables.append(mx.array((factors * periods).astype(np.float32)))
    return LongRope(
        dims,
        short_periods=tables[0],
        long_periods=tables[1],
        original_max=int(params["original_max_position_embeddings"]),
        attention_factor=longrope_factor(params),
    )
