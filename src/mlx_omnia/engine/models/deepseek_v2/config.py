"""DeepseekV2Config from config.json (transformers 5 `rope_parameters`; transformers 4 and the
hub's remote-code configs: top-level rope_theta and rope_scaling {"type": "yarn", ...})."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mlx_omnia.engine.core.rope import rope_parameters
from mlx_omnia.engine.errors import UnsupportedModelError

TOPK_METHODS = ("greedy", "group_limited_greedy")


def _refuse(what: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"deepseek_v2: {what}")


def _optional_int(value: Any) -> int | None:
    return int(value) if value is not None else None


@dataclass(frozen=True)
class DeepseekV2Config:
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    topk_method: str
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    first_k_dense_replace: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    rope: Mapping[str, Any]

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> DeepseekV2Config:
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise _refuse(f"hidden_act {act!r} is not supported (only silu)")
        scoring = config.get("scoring_func", "softmax")
        if scoring != "softmax":
            raise _refuse(f"scoring_func {scoring!r} is not supported (only softmax)")
        method = config.get("topk_method") or "greedy"
        if method not in TOPK_METHODS:
            raise _refuse(f"topk_method {method!r} is not supported ({', '.join(TOPK_METHODS)})")
        if config.get("norm_topk_prob", False):
            # transformers ignores it for DeepSeek-V2 while the original code renormalizes: the
            # two disagree, and every released checkpoint sets it false.
            raise _refuse("norm_topk_prob true is not supported (released checkpoints: false)")
        if int(config.get("moe_layer_freq") or 1) != 1:
            raise _refuse(
                f"moe_layer_freq {config['moe_layer_freq']} is not supported (released "
                "checkpoints: 1, every layer from first_k_dense_replace on is sparse)"
            )
        experts = config.get("n_routed_experts", config.get("num_experts"))
        if not experts:
            raise _refuse("n_routed_experts is missing or 0 (a dense DeepSeek-V2 is not supported)")
        shared = config.get("n_shared_experts")
        if not shared:
            raise _refuse("n_shared_experts is missing or 0 (released checkpoints have 2)")
        experts = int(experts)
        n_group = int(config.get("n_group") or 1)
        topk_group = int(config.get("topk_group") or n_group)
        if method == "group_limited_greedy" and (experts % n_group or not 0 < topk_group <= n_group):
            raise _refuse(
                f"group_limited_greedy needs n_group dividing {experts} experts and "
                f"1 <= topk_group <= n_group (got n_group {n_group}, topk_group {topk_group})"
            )
        max_positions = int(config.get("max_position_embeddings", 2048))
        rope = rope_parameters(config)
        if rope["rope_type"] in ("yarn", "llama3", "longrope"):
            # transformers' standardization: a top-level value wins, else the context length.
            top = config.get("original_max_position_embeddings")
            if top is not None:
                rope["original_max_position_embeddings"] = top
            rope.setdefault("original_max_position_embeddings", max_positions)
        if rope["rope_type"] != "default" and rope.get("mscale_all_dim") and "factor" not in rope:
            raise _refuse("rope scaling with mscale_all_dim but no factor")
        return cls(
            hidden_size=int(config["hidden_size"]),
            intermediate_size=int(config["intermediate_size"]),
            moe_intermediate_size=int(config["moe_intermediate_size"]),
            n_routed_experts=experts,
            n_shared_experts=int(shared),
            num_experts_per_tok=int(config["num_experts_per_tok"]),
            topk_method=str(method),
            n_group=n_group,
            topk_group=topk_group,
            routed_scaling_factor=float(config.get("routed_scaling_factor") or 1.0),
            first_k_dense_replace=int(config.get("first_k_dense_replace") or 0),
            num_hidden_layers=int(config["num_hidden_layers"]),
            num_attention_heads=int(config["num_attention_heads"]),
            q_lora_rank=_optional_int(config.get("q_lora_rank")),
            kv_lora_rank=int(config["kv_lora_rank"]),
            qk_nope_head_dim=int(config["qk_nope_head_dim"]),
            qk_rope_head_dim=int(config["qk_rope_head_dim"]),
            v_head_dim=int(config["v_head_dim"]),
            vocab_size=int(config["vocab_size"]),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", False)),
            mlp_bias=bool(config.get("mlp_bias", False)),
            rope=rope,
        )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer` has the mixture-of-experts MLP (the first
        first_k_dense_replace layers keep a dense one)."""
        return layer >= self.first_k_dense_replace
