"""NemotronHConfig from config.json: transformers 5 (`layers_block_type`, or `layer_types`, its
alias) and the hub's / transformers 4 spellings (`hybrid_override_pattern` "M*-E",
`attention_head_dim`, the `mamba_*` aliases of the Mamba fields, `num_experts` or
`num_local_experts` for `n_routed_experts`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from mlx_omnia.engine.errors import UnsupportedModelError

MAMBA, ATTENTION, MLP, MOE = "linear_attention", "full_attention", "mlp", "moe"
LAYER_KINDS = (MAMBA, ATTENTION, MLP, MOE)
# hybrid_override_pattern's letters, as transformers reads them
PATTERN = {"M": MAMBA, "*": ATTENTION, "-": MLP, "E": MOE}
# the older names transformers still reads for these fields (NemotronHConfig.__post_init__)
ALIASES = {
    "n_groups": "mamba_n_groups",
    "conv_kernel": "mamba_d_conv",
    "time_step_min": "mamba_dt_min",
    "time_step_limit": "mamba_dt_limit",
    "use_conv_bias": "mamba_conv_bias",
    "chunk_size": "mamba_chunk_size",
}


def _refuse(what: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"nemotron_h: {what}")


def _get(config: Mapping[str, Any], name: str, default: Any) -> Any:
    """A field under its name, else under its older alias, else `default`."""
    if name in config:
        return config[name]
    return config.get(ALIASES.get(name, name), default)


def _float(value: Any) -> float:
    """A number as config.json holds it: transformers 5 writes infinity as
    {"__float__": "Infinity"}, older configs as the bare token Infinity."""
    if isinstance(value, Mapping):
        return float(cast(Mapping[str, Any], value)["__float__"])
    return float(value)


def layer_types(config: Mapping[str, Any]) -> tuple[str, ...]:
    """Each layer's kind: `layers_block_type` (or `layer_types`), else the letters of
    `hybrid_override_pattern`. As in transformers, the list decides the number of layers
    (num_hidden_layers, where a config still has it, is not read)."""
    given = config.get("layers_block_type", config.get("layer_types"))
    if given is not None:
        kinds = tuple(str(k) for k in cast(Sequence[Any], given))
    elif "hybrid_override_pattern" in config:
        pattern = str(config["hybrid_override_pattern"])
        unknown = sorted(set(pattern) - set(PATTERN))
        if unknown:
            raise _refuse(f"hybrid_override_pattern letters {', '.join(unknown)} not supported "
                          f"({', '.join(PATTERN)})")
        kinds = tuple(PATTERN[c] for c in pattern)
    else:
        raise _refuse("config.json names no layers (layers_block_type or hybrid_override_pattern)")
    unknown = sorted(set(kinds) - set(LAYER_KINDS))
    if unknown:
        raise _refuse(f"layer kinds {', '.join(unknown)} not supported ({', '.join(LAYER_KINDS)})")
    return kinds


@dataclass(frozen=True)
class NemotronHConfig:
    hidden_size: int
    vocab_size: int
    layer_types: tuple[str, ...]
    layer_norm_epsilon: float
    max_position_embeddings: int
    # attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    # MLP
    intermediate_size: int
    mlp_bias: bool
    # Mamba-2
    mamba_num_heads: int
    mamba_head_dim: int
    ssm_state_size: int
    n_groups: int
    conv_kernel: int
    use_conv_bias: bool
    use_bias: bool
    chunk_size: int
    time_step_min: float
    # mixture of experts
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    moe_shared_expert_intermediate_size: int
    moe_latent_size: int | None
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float

    @property
    def mamba_intermediate_size(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> NemotronHConfig:
        kinds = layer_types(config)
        hidden = int(config["hidden_size"])
        for name, want in (("mamba_hidden_act", "silu"), ("mlp_hidden_act", "relu2")):
            act = config.get(name, want)
            if act != want:
                raise _refuse(f"{name} {act!r} is not supported (only {want})")
        if config.get("residual_in_fp32", False):
            raise _refuse("residual_in_fp32 true is not supported (transformers keeps the "
                          "residual in the model's dtype)")
        if config.get("attention_bias", False):
            raise _refuse("attention_bias true is not supported (transformers' attention has "
                          "no biases)")
        if config.get("sliding_window") is not None:
            raise _refuse(f"sliding_window {config['sliding_window']} is not supported "
                          "(full attention only)")
        limit = cast(Sequence[Any], _get(config, "time_step_limit", None) or (0.0, math.inf))
        if (_float(limit[0]), _float(limit[1])) != (0.0, math.inf):
            # transformers reads no time_step_limit here (its prefill clamps at time_step_min)
            raise _refuse(f"time_step_limit {[_float(v) for v in limit]} is not supported "
                          "(only (0, inf): released checkpoints)")
        heads = int(config.get("num_attention_heads", 32))
        mamba_heads = int(config.get("mamba_num_heads", 128))
        groups = int(_get(config, "n_groups", 8))
        if MAMBA in kinds and mamba_heads % groups:
            raise _refuse(f"mamba_num_heads {mamba_heads} is not a multiple of n_groups {groups}")
        experts = int(config.get("n_routed_experts",
                                 config.get("num_local_experts", config.get("num_experts", 8))))
        n_group, topk_group = int(config.get("n_group") or 1), int(config.get("topk_group") or 1)
        top_k = int(config.get("num_experts_per_tok", 2))
        if MOE in kinds:
            if experts % n_group or experts // n_group < 2:
                raise _refuse(f"n_routed_experts {experts} in n_group {n_group}: the router "
                              "scores a group by its two best experts")
            if not 0 < topk_group <= n_group:
                raise _refuse(f"topk_group {topk_group} is not in 1..n_group {n_group}")
            if not 0 < top_k <= topk_group * (experts // n_group):
                raise _refuse(f"num_experts_per_tok {top_k} exceeds the experts of "
                              f"topk_group {topk_group} groups")
        latent = config.get("moe_latent_size")
        head_dim = config.get("head_dim") or config.get("attention_head_dim") or 128
        return cls(
            hidden_size=hidden,
            vocab_size=int(config["vocab_size"]),
            layer_types=kinds,
            layer_norm_epsilon=float(config.get("layer_norm_epsilon", 1e-5)),
            max_position_embeddings=int(config.get("max_position_embeddings") or 4096),
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            intermediate_size=int(config.get("intermediate_size", 21504)),
            mlp_bias=bool(config.get("mlp_bias", False)),
            mamba_num_heads=mamba_heads,
            mamba_head_dim=int(config.get("mamba_head_dim", 64)),
            ssm_state_size=int(config.get("ssm_state_size", 128)),
            n_groups=groups,
            conv_kernel=int(_get(config, "conv_kernel", 4)),
            use_conv_bias=bool(_get(config, "use_conv_bias", True)),
            use_bias=bool(config.get("use_bias", False)),
            chunk_size=int(_get(config, "chunk_size", 128)),
            time_step_min=_float(_get(config, "time_step_min", 0.001)),
            n_routed_experts=experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=int(config.get("moe_intermediate_size", 7688)),
            moe_shared_expert_intermediate_size=int(
                config.get("moe_shared_expert_intermediate_size", 7688)
            ),
            moe_latent_size=int(latent) if latent is not None else None,
            n_group=n_group,
            topk_group=topk_group,
            norm_topk_prob=bool(config.get("norm_topk_prob", True)),
            routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
        )
