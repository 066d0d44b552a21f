"""Rotary embedding parameters from config.json, in both schemas, and the Rope they declare.

transformers 4 wrote `rope_theta` and `rope_scaling` at the top level; transformers 5 writes
`rope_parameters` (a dict, or one dict per layer type). Both read to the same thing here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, cast

import mlx.core as mx
import numpy as np

from mlx_omnia.engine.core.layers import Rope
from mlx_omnia.engine.errors import UnsupportedModelError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


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
    raise UnsupportedModelError(
        f"rope scaling type {kind!r} is not supported yet (supported: "
        f"{', '.join(SUPPORTED_ROPE_TYPES)}); please open an issue naming the checkpoint"
    )
