"""BailingHybridConfig from config.json (transformers 5: `layer_types`, `mlp_layer_types`,
`rope_parameters`, and the names its attribute_map stores, such as num_experts and
num_experts_per_token; transformers 4 spellings and the hub's: top-level rope_theta and
rope_scaling, num_local_experts / num_experts_per_tok / n_group / n_shared_experts /
norm_topk_prob / max_position_embeddings, layer kinds from layer_group_size and
first_k_dense_replace).

`head_dim` is the linear (delta) attention's head size in a hub config; transformers then
overwrites it with qk_rope_head_dim and saves that, next to `linear_head_dim`, which wins."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from mlx_omnia.engine.core.rope import rope_parameters
from mlx_omnia.engine.errors import UnsupportedModelError

LAYER_KINDS = ("linear_attention", "full_attention")
MLP_KINDS = ("dense", "sparse")
ROPE_TYPES = ("default", "yarn")
DEFAULT_ROPE_THETA = 6_000_000.0  # transformers' default for this family


def _refuse(what: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"bailing_hybrid: {what}")


def _either(config: Mapping[str, Any], stored: str, standard: str, default: Any) -> Any:
    """A value transformers' attribute_map stores as `stored` and reads as `standard` too; the
    stored name wins where both are given (it is set last)."""
    for name in (stored, standard):
        if config.get(name) is not None:
            return config[name]
    return default


def _kinds(config: Mapping[str, Any], key: str, layers: int, known: tuple[str, ...]) -> tuple[str, ...] | None:
    given = config.get(key)
    if given is None:
        return None
    kinds = tuple(str(k) for k in cast(Sequence[Any], given))
    if len(kinds) != layers:
        raise _refuse(f"{key} names {len(kinds)} layers, num_hidden_layers is {layers}")
    unknown = sorted(set(kinds) - set(known))
    if unknown:
        raise _refuse(f"{key} {', '.join(unknown)} not supported ({', '.join(known)})")
    return kinds


def layer_types(config: Mapping[str, Any], layers: int) -> tuple[str, ...]:
    """`layer_types`, or the last layer of every layer_group_size (default 6) full attention
    and the others linear, as transformers derives them."""
    kinds = _kinds(config, "layer_types", layers, LAYER_KINDS)
    if kinds is not None:
        return kinds
    group = int(config.get("layer_group_size") or 6)
    return tuple(
        "full_attention" if (i + 1) % group == 0 else "linear_attention" for i in range(layers)
    )


def mlp_layer_types(config: Mapping[str, Any], layers: int) -> tuple[str, ...]:
    """`mlp_layer_types`, or the first first_k_dense_replace (default 2) layers dense and the
    others sparse, as transformers derives them."""
    kinds = _kinds(config, "mlp_layer_types", layers, MLP_KINDS)
    if kinds is not None:
        return kinds
    dense = int(config.get("first_k_dense_replace", 2))
    return tuple("dense" if i < dense else "sparse" for i in range(layers))


def _rope(config: Mapping[str, Any], max_positions: int) -> dict[str, Any]:
    rope = rope_parameters({"rope_theta": DEFAULT_ROPE_THETA, **config})
    rope.pop("type", None)  # transformers 4's alias of rope_type
    kind = rope["rope_type"]
    if kind not in ROPE_TYPES:
        raise _refuse(f"rope_type {kind!r} is not supported ({', '.join(ROPE_TYPES)})")
    if kind != "default":
        partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor"))
        if partial is not None and float(partial) != 1.0:
            # transformers' default rope ignores it, its yarn rotates a part of the rope dims
            raise _refuse(f"partial_rotary_factor {partial} with {kind} rope is not supported")
        top = config.get("original_max_position_embeddings")
        if top is not None:
            rope["original_max_position_embeddings"] = top
        rope.setdefault("original_max_position_embeddings", max_positions)
        if rope.get("mscale_all_dim") and "factor" not in rope:
            raise _refuse("rope scaling with mscale_all_dim but no factor")
    return rope


@dataclass(frozen=True)
class BailingHybridConfig:
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    attention_bias: bool
    linear_num_heads: int
    linear_head_dim: int
    linear_conv_kernel_dim: int
    kda_safe_gate: bool
    kda_lower_bound: float
    num_experts: int
    num_experts_per_tok: int
    num_shared_experts: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    rope: Mapping[str, Any]

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> BailingHybridConfig:
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise _refuse(f"hidden_act {act!r} is not supported (only silu)")
        if config.get("q_lora_rank") is not None:
            raise _refuse("q_lora_rank is not supported (transformers' MLA here has q_proj only)")
        layers = int(config.get("num_hidden_layers", 42))
        heads = int(config.get("num_attention_heads", 32))
        kv_heads = int(config.get("num_key_value_heads") or heads)
        if kv_heads != heads:
            raise _refuse(
                f"num_key_value_heads {kv_heads} != num_attention_heads {heads} is not supported "
                "(MLA expands its latent to every head; transformers fails on it too)"
            )
        mlp_kinds = mlp_layer_types(config, layers)
        experts = int(_either(config, "num_experts", "num_local_experts", 512))
        top_k = int(_either(config, "num_experts_per_token", "num_experts_per_tok", 8))
        n_group = int(_either(config, "num_expert_group", "n_group", 8))
        topk_group = int(config.get("topk_group", 4))
        if "sparse" in mlp_kinds:
            per_group = experts // n_group if n_group > 0 else 0
            if experts <= 0 or n_group <= 0 or experts % n_group or per_group < 2:
                raise _refuse(
                    f"{experts} experts in {n_group} groups is not supported (the router sums "
                    "each group's two best scores: groups of at least 2 experts)"
                )
            if not 0 < topk_group <= n_group or not 0 < top_k <= topk_group * per_group:
                raise _refuse(
                    f"topk_group {topk_group} of {n_group} groups with num_experts_per_tok "
                    f"{top_k} is not supported (the kept groups must hold the top-k experts)"
                )
        shared = int(_either(config, "num_shared_experts", "n_shared_experts", 1))
        if "sparse" in mlp_kinds and shared < 1:
            raise _refuse(f"num_shared_experts {shared} is not supported (at least 1, the default)")
        max_positions = int(_either(config, "model_max_length", "max_position_embeddings", 262144))
        return cls(
            hidden_size=int(config.get("hidden_size", 2560)),
            intermediate_size=int(config.get("intermediate_size", 6144)),
            moe_intermediate_size=int(config.get("moe_intermediate_size", 768)),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            kv_lora_rank=int(config.get("kv_lora_rank", 512)),
            qk_nope_head_dim=int(config.get("qk_nope_head_dim", 128)),
            qk_rope_head_dim=int(config.get("qk_rope_head_dim", 64)),
            v_head_dim=int(config.get("v_head_dim", 128)),
            attention_bias=bool(config.get("attention_bias", False)),
            linear_num_heads=int(config.get("linear_num_heads") or heads),
            linear_head_dim=int(config.get("linear_head_dim") or config.get("head_dim") or 128),
            linear_conv_kernel_dim=int(
                config.get("linear_conv_kernel_dim") or config.get("short_conv_kernel_size") or 4
            ),
            kda_safe_gate=bool(config.get("kda_safe_gate", True)),
            kda_lower_bound=float(config.get("kda_lower_bound", -5.0)),
            num_experts=experts,
            num_experts_per_tok=top_k,
            num_shared_experts=shared,
            n_group=n_group,
            topk_group=topk_group,
            norm_topk_prob=bool(_either(config, "moe_renormalize", "norm_topk_prob", True)),
            routed_scaling_factor=float(config.get("routed_scaling_factor", 2.5)),
            vocab_size=int(config.get("vocab_size", 157184)),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_positions,
            layer_types=layer_types(config, layers),
            mlp_layer_types=mlp_kinds,
            rope=_rope(config, max_positions),
        )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim
