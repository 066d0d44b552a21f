"""JambaConfig from config.json. Transformers 4 and 5 write the same fields (Jamba has no rope):
each layer's kind comes from attn_layer_period / attn_layer_offset and its MLP's from
expert_layer_period / expert_layer_offset, as transformers derives them; `num_experts` may be
spelled `num_local_experts` (transformers 5's alias), `mamba_dt_rank` "auto" is
ceil(hidden_size / 16)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from mlx_omnia.engine.errors import UnsupportedModelError

ATTENTION, MAMBA = "attention", "mamba"
# transformers 5's layer_types spelling of the same kinds (a property there, never read)
LAYER_TYPES = {"full_attention": ATTENTION, "linear_attention": MAMBA}


def _refuse(what: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"jamba: {what}")


def _periodic(layers: int, period: int, offset: int, what: str) -> tuple[bool, ...]:
    """Which layers i have i % period == offset (transformers refuses offset >= period)."""
    if not 0 <= offset < period:
        raise _refuse(f"{what}_layer_offset {offset} must be in 0..{what}_layer_period - 1 "
                      f"({period - 1})")
    return tuple(i % period == offset for i in range(layers))


def layers_block_type(config: Mapping[str, Any], layers: int) -> tuple[str, ...]:
    """Each layer's kind, attention every attn_layer_period-th layer from attn_layer_offset
    (defaults 8 and 4), Mamba elsewhere. A `layer_types` in config.json (which transformers
    cannot set, and so ignores) must agree."""
    period, offset = int(config.get("attn_layer_period", 8)), int(config.get("attn_layer_offset", 4))
    kinds = tuple(ATTENTION if a else MAMBA for a in _periodic(layers, period, offset, "attn"))
    given = config.get("layer_types")
    if given is not None:
        named = [str(k) for k in cast(Sequence[Any], given)]
        if tuple(LAYER_TYPES.get(k, k) for k in named) != kinds:
            raise _refuse(f"layer_types {named} disagrees with attn_layer_period {period} / "
                          f"attn_layer_offset {offset}, which transformers follows")
    return kinds


@dataclass(frozen=True)
class JambaConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int
    num_experts_per_tok: int
    mamba_d_state: int
    mamba_d_conv: int
    mamba_inner: int
    mamba_dt_rank: int
    mamba_conv_bias: bool
    mamba_proj_bias: bool
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    layers_block_type: tuple[str, ...]
    layers_sparse: tuple[bool, ...]

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> JambaConfig:
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise _refuse(f"hidden_act {act!r} is not supported (only silu)")
        window = config.get("sliding_window")
        if window is not None:
            # transformers 5 ignores it; transformers 4 applied it under flash attention alone,
            # so a config that sets one names no single model (released Jamba configs: null)
            raise _refuse(f"sliding_window {window} is not supported (only null)")
        layers = int(config["num_hidden_layers"])
        hidden = int(config["hidden_size"])
        heads = int(config.get("num_attention_heads", 32))
        kv_heads = int(config.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise _refuse(f"num_attention_heads {heads} is not a multiple of "
                          f"num_key_value_heads {kv_heads}")
        experts = int(config.get("num_experts", config.get("num_local_experts", 16)))
        top_k = int(config.get("num_experts_per_tok", 2))
        sparse = tuple(
            s and experts > 1
            for s in _periodic(layers, int(config.get("expert_layer_period", 2)),
                               int(config.get("expert_layer_offset", 1)), "expert")
        )
        if any(sparse) and not 0 < top_k <= experts:
            raise _refuse(f"num_experts_per_tok {top_k} must be in 1..num_experts ({experts})")
        rank = config.get("mamba_dt_rank", "auto")
        return cls(
            hidden_size=hidden,
            intermediate_size=int(config.get("intermediate_size", 14336)),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=int(config.get("head_dim") or hidden // heads),
            num_experts=experts,
            num_experts_per_tok=top_k,
            mamba_d_state=int(config.get("mamba_d_state", 16)),
            mamba_d_conv=int(config.get("mamba_d_conv", 4)),
            mamba_inner=int(config.get("mamba_expand", 2)) * hidden,
            mamba_dt_rank=math.ceil(hidden / 16) if rank in (None, "auto") else int(rank),
            mamba_conv_bias=bool(config.get("mamba_conv_bias", True)),
            mamba_proj_bias=bool(config.get("mamba_proj_bias", False)),
            vocab_size=int(config["vocab_size"]),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(config.get("max_position_embeddings", 262144)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            layers_block_type=layers_block_type(config, layers),
            layers_sparse=sparse,
        )
