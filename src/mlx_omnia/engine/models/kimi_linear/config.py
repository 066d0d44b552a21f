"""KimiLinearConfig from config.json, in either spelling transformers reads:

    transformers 5   layer_types, mlp_layer_types, linear_head_dim / linear_num_heads /
                     linear_conv_kernel_dim, and its stored names model_max_length,
                     moe_renormalize, num_expert_group, num_experts, num_experts_per_token,
                     num_shared_experts (or their aliases max_position_embeddings, norm_topk_prob,
                     n_group, num_local_experts, num_experts_per_tok, n_shared_experts)
    the hub's        (Moonshot's remote code, what transformers 4 ran) linear_attn_config
                     {kda_layers, full_attn_layers (1-indexed), head_dim, num_heads,
                     short_conv_kernel_size} and first_k_dense_replace

There is no rope: the latent attention is NoPE (transformers ignores rope_theta and
rope_scaling), so a config that asks for positions there (mla_use_nope false) is refused."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from mlx_omnia.engine.errors import UnsupportedModelError

LINEAR, FULL = "linear_attention", "full_attention"
LAYER_KINDS = (LINEAR, FULL)
DENSE, SPARSE = "dense", "sparse"
MLP_KINDS = (DENSE, SPARSE)


def _refuse(what: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"kimi_linear: {what}")


def _get(config: Mapping[str, Any], names: Sequence[str], default: Any) -> Any:
    """The first of `names` config.json sets (not null), else `default`."""
    for name in names:
        if config.get(name) is not None:
            return config[name]
    return default


def _kinds(value: Any) -> tuple[str, ...]:
    return tuple(str(k) for k in cast(Sequence[Any], value))


def linear_attn_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    given = config.get("linear_attn_config")
    return cast(Mapping[str, Any], given) if isinstance(given, Mapping) else {}


def layer_types(config: Mapping[str, Any], layers: int) -> tuple[str, ...]:
    """`layer_types`, else the hub's 1-indexed kda_layers / full_attn_layers, else transformers'
    default (every fourth layer from layer 4, 0-indexed, full attention)."""
    given = config.get("layer_types")
    hub = linear_attn_config(config)
    if given is not None:
        kinds = _kinds(given)
    elif "full_attn_layers" in hub and "kda_layers" in hub:
        slots: list[str | None] = [None] * layers
        for kind, key in ((FULL, "full_attn_layers"), (LINEAR, "kda_layers")):
            for number in cast(Sequence[Any], hub[key]):
                if not 1 <= int(number) <= layers:
                    raise _refuse(f"linear_attn_config {key} names layer {number} of {layers}")
                slots[int(number) - 1] = kind
        unnamed = [i + 1 for i, kind in enumerate(slots) if kind is None]
        if unnamed:
            raise _refuse(f"linear_attn_config names no kind for layers {unnamed} (1-indexed)")
        kinds = tuple(cast(list[str], slots))
    else:
        kinds = tuple(FULL if i and i % 4 == 0 else LINEAR for i in range(layers))
    if len(kinds) != layers:
        raise _refuse(f"layer_types names {len(kinds)} layers, num_hidden_layers is {layers}")
    unknown = sorted(set(kinds) - set(LAYER_KINDS))
    if unknown:
        raise _refuse(f"layer_types {', '.join(unknown)} not supported ({', '.join(LAYER_KINDS)})")
    return kinds


def mlp_layer_types(config: Mapping[str, Any], layers: int) -> tuple[str, ...]:
    """`mlp_layer_types`, else dense for the first first_k_dense_replace layers (default 1) and
    sparse after, as transformers derives them."""
    given = config.get("mlp_layer_types")
    if given is not None:
        kinds = _kinds(given)
    else:
        if int(config.get("moe_layer_freq") or 1) != 1:
            # the remote code made every moe_layer_freq-th layer sparse; transformers makes
            # every layer from first_k_dense_replace on sparse: the two disagree
            raise _refuse(f"moe_layer_freq {config['moe_layer_freq']} is not supported "
                          "(released checkpoints: 1)")
        dense = int(_get(config, ("first_k_dense_replace",), 1))
        kinds = tuple(DENSE if i < dense else SPARSE for i in range(layers))
    if len(kinds) != layers:
        raise _refuse(f"mlp_layer_types names {len(kinds)} layers, num_hidden_layers is {layers}")
    unknown = sorted(set(kinds) - set(MLP_KINDS))
    if unknown:
        raise _refuse(f"mlp_layer_types {', '.join(unknown)} not supported ({', '.join(MLP_KINDS)})")
    return kinds


@dataclass(frozen=True)
class KimiLinearConfig:
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_hidden_layers: int
    rms_norm_eps: float
    max_position_embeddings: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    # latent attention (full_attention layers)
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    attention_bias: bool
    # Kimi Delta Attention (linear_attention layers)
    linear_num_heads: int
    linear_head_dim: int
    linear_conv_kernel_dim: int
    # experts (sparse layers)
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    norm_topk_prob: bool
    n_group: int
    topk_group: int
    routed_scaling_factor: float

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> KimiLinearConfig:
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise _refuse(f"hidden_act {act!r} is not supported (only silu)")
        if config.get("mla_use_nope") is False:
            raise _refuse("mla_use_nope false is not supported (transformers' attention takes no "
                          "positions: NoPE, as released checkpoints set)")
        scoring = config.get("moe_router_activation_func", "sigmoid")
        if scoring != "sigmoid":
            raise _refuse(f"moe_router_activation_func {scoring!r} is not supported (only sigmoid)")
        layers = int(config["num_hidden_layers"])
        heads = int(config.get("num_attention_heads", 32))
        kv_heads = int(config.get("num_key_value_heads") or heads)
        if kv_heads != heads:
            raise _refuse(f"num_key_value_heads {kv_heads} != num_attention_heads {heads} is not "
                          "supported (the latent attention expands a key and value per head)")
        hub = linear_attn_config(config)
        kinds, mlp_kinds = layer_types(config, layers), mlp_layer_types(config, layers)
        experts = int(_get(config, ("num_experts", "num_local_experts"), 256))
        top_k = int(_get(config, ("num_experts_per_token", "num_experts_per_tok"), 8))
        n_group = int(_get(config, ("num_expert_group", "n_group"), 1))
        topk_group = int(_get(config, ("topk_group",), 1))
        shared = int(_get(config, ("num_shared_experts", "n_shared_experts"), 1))
        if SPARSE in mlp_kinds:
            if n_group < 1 or experts % n_group or experts // n_group < 2:
                raise _refuse(f"{experts} experts in num_expert_group {n_group} groups: the groups "
                              "must divide the experts, two or more each (a group scores its best two)")
            if not 1 <= topk_group <= n_group:
                raise _refuse(f"topk_group {topk_group} is not in 1..num_expert_group {n_group}")
            if not 1 <= top_k <= topk_group * (experts // n_group):
                raise _refuse(f"num_experts_per_token {top_k} is not in 1..{topk_group * (experts // n_group)}"
                              " (the experts of the topk_group chosen groups)")
            if shared < 1:
                raise _refuse("num_shared_experts 0 is not supported (released checkpoints: 1)")
        q_lora = config.get("q_lora_rank")
        return cls(
            hidden_size=int(config.get("hidden_size", 2304)),
            intermediate_size=int(config.get("intermediate_size", 9216)),
            vocab_size=int(config["vocab_size"]),
            num_hidden_layers=layers,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
            max_position_embeddings=int(
                _get(config, ("model_max_length", "max_position_embeddings"), 1048576)
            ),
            layer_types=kinds,
            mlp_layer_types=mlp_kinds,
            num_attention_heads=heads,
            q_lora_rank=int(q_lora) if q_lora is not None else None,
            kv_lora_rank=int(config.get("kv_lora_rank", 512)),
            qk_nope_head_dim=int(config.get("qk_nope_head_dim", 128)),
            qk_rope_head_dim=int(config.get("qk_rope_head_dim", 64)),
            v_head_dim=int(_get(config, ("v_head_dim",), 128)),
            attention_bias=bool(config.get("attention_bias", False)),
            linear_num_heads=int(_get(hub, ("num_heads",), config.get("linear_num_heads", 32))),
            linear_head_dim=int(_get(hub, ("head_dim",), config.get("linear_head_dim", 128))),
            linear_conv_kernel_dim=int(
                _get(hub, ("short_conv_kernel_size",), config.get("linear_conv_kernel_dim", 4))
            ),
            moe_intermediate_size=int(config.get("moe_intermediate_size", 1024)),
            num_experts=experts,
            num_experts_per_tok=top_k,
            n_shared_experts=shared,
            norm_topk_prob=bool(_get(config, ("moe_renormalize", "norm_topk_prob"), True)),
            n_group=n_group,
            topk_group=topk_group,
            routed_scaling_factor=float(_get(config, ("routed_scaling_factor",), 2.446)),
        )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim
