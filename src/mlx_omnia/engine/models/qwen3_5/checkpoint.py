"""How qwen3_5 checkpoints become a Qwen3_5ForCausalLM: config and tensor names.

The image-text checkpoints (model_type qwen3_5 / qwen3_5_moe) hold the text model under
`model.language_model.*` beside the vision tower's `model.visual.*`: the text model's tensors
are renamed to this network's `model.*`, the vision tower's are not read (images are not an
input of this family yet). Routed experts are stacked by core.experts.stack_experts; the
multi-token-prediction head (`mtp.*`) is dropped.

mlx-lm's layout (what `mlx_lm.convert` and mlx-community publish, float or quantized) nests the
text model as `language_model.model.*` and `language_model.lm_head.*` (a vision tower, where
kept, as `vision_tower.*`), stores the DeltaNet's conv1d weight channels-last [C, K, 1] (the
hub's is [C, 1, K]) and the (1 + weight) norms as 1 + weight; all of it is undone here. mlx-lm's
sanitize shifts the norms exactly when it moves the convolution, so the convolution's shape
tells the layouts apart (for K > 1)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import mlx.core as mx

from mlx_omnia.engine.core.experts import stack_experts
from mlx_omnia.engine.core.mlx_layout import torch_convs, zero_centred
from mlx_omnia.engine.models.qwen3_5.config import Qwen3_5Config
from mlx_omnia.engine.models.qwen3_5.model import Qwen3_5ForCausalLM

# The text model's prefix -> this network's, as the hub nests it and as mlx-lm does.
TEXT_PREFIXES = {
    "model.language_model.": "model.",
    "language_model.model.": "model.",
    "language_model.lm_head.": "lm_head.",
}
DROPPED = ("model.visual.", "vision_tower.", "mtp.")
# The OffsetRmsNorm weights: every layer's two norms, attention's q/k norms, the final norm (not
# the DeltaNet's gated `norm`, which scales by its weight in both layouts).
OFFSET_NORMS = (
    ".input_layernorm.weight", ".post_attention_layernorm.weight",
    ".self_attn.q_norm.weight", ".self_attn.k_norm.weight",
)
FINAL_NORM = "model.norm.weight"


def is_conv(name: str) -> bool:
    return name.endswith(".linear_attn.conv1d.weight")


def is_offset_norm(name: str) -> bool:
    return name == FINAL_NORM or name.endswith(OFFSET_NORMS)


def text_name(name: str) -> str:
    for prefix, ours in TEXT_PREFIXES.items():
        if name.startswith(prefix):
            return ours + name.removeprefix(prefix)
    return name


class Qwen3_5Checkpoint:
    model_types = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")

    def build(self, config: Mapping[str, Any]) -> Qwen3_5ForCausalLM:
        return Qwen3_5ForCausalLM(Qwen3_5Config.from_dict(config))

    def context_length(self, config: Mapping[str, Any]) -> int:
        return Qwen3_5Config.from_dict(config).max_position_embeddings

    def sanitize(self, weights: dict[str, mx.array], config: Mapping[str, Any]) -> dict[str, mx.array]:
        cfg = Qwen3_5Config.from_dict(config)
        kept = {
            text_name(name): tensor for name, tensor in weights.items()
            if not name.startswith(DROPPED) and not name.endswith("rotary_emb.inv_freq")
        }
        if cfg.tie_word_embeddings:
            kept = {k: v for k, v in kept.items() if not k.startswith("lm_head.")}
        kept, mlx_lm = torch_convs(kept, is_conv, cfg.linear_conv_kernel_dim)
        if mlx_lm:
            kept = {k: zero_centred(v) if is_offset_norm(k) else v for k, v in kept.items()}
        return stack_experts(kept)


CHECKPOINT = Qwen3_5Checkpoint()
