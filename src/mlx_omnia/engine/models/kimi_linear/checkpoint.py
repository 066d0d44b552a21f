"""How kimi_linear checkpoints become a KimiLinearForCausalLM: config and tensor names.

The network's names are the hub's (Moonshot's, and what transformers' save_pretrained writes),
except that a layer's feed-forward is `mlp` whatever its kind, where the hub says
`block_sparse_moe` for the experts' block (and save_pretrained for the dense MLPs too), as
transformers reads them. Routed experts come per expert (`experts.<e>.w1/w3/w2`: gate, up,
down) and are stacked at load by core.experts.stack_experts. The multi-token-prediction head
(`model.mtp.*`), which transformers does not load either, is dropped.

Also read:
  transformers 5's in-memory names (a state dict saved without save_pretrained): the forget
  gate's `self_attn.forget_gate.*`, the three convolutions fused as `self_attn.conv1d.weight`
  [3 C, 1, K] (q, k, v), the experts fused as experts.gate_up_proj / down_proj.
  mlx-lm's layout (`mlx_lm.convert`, what mlx-community publishes): the convolutions as
  `self_attn.q_conv.conv.weight` channels-last [C, K, 1], experts as switch_mlp, the router's
  bias as `mlp.e_score_correction_bias`, the router itself possibly quantized (8 bits: read
  back to floats, as transformers runs it at float32), and kv_b_proj split per head into
  `embed_q` [heads, kv_lora_rank, qk_nope] and `unembed_out` [heads, v_head_dim, kv_lora_rank]
  (read back into kv_b_proj, dequantized where quantized)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import mlx.core as mx

from mlx_omnia.engine.core.experts import ExpertKeys, stack_experts
from mlx_omnia.engine.core.mlx_layout import torch_convs
from mlx_omnia.engine.core.mxcompat import reshape
from mlx_omnia.engine.errors import CheckpointError, UnsupportedModelError
from mlx_omnia.engine.models.kimi_linear.config import KimiLinearConfig
from mlx_omnia.engine.models.kimi_linear.model import KimiLinearForCausalLM

EXPERT_KEYS = ExpertKeys(block="mlp", gate="w1", up="w3", down="w2")
CONVS = ("q_conv1d", "k_conv1d", "v_conv1d")
RENAMES = (
    (".block_sparse_moe.", ".mlp."),
    (".self_attn.forget_gate.", ".self_attn."),
    *((f".self_attn.{c[0]}_conv.conv.", f".self_attn.{c}.") for c in CONVS),  # mlx-lm
    (".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"),  # mlx-lm
)
FUSED_CONV = re.compile(r"^(?P<at>.+\.self_attn)\.conv1d\.weight$")
SPLIT_KV_B = re.compile(r"^(?P<at>.+\.self_attn)\.embed_q\.weight$")
ROUTER = re.compile(r"^(?P<at>.+\.mlp\.gate)\.scales$")


def is_conv(name: str) -> bool:
    return name.endswith(tuple(f".self_attn.{c}.weight" for c in CONVS))


def _renamed(name: str) -> str:
    for old, new in RENAMES:
        name = name.replace(old, new)
    return name


def _dense(weights: dict[str, mx.array], at: str, input_dims: int) -> mx.array:
    """The float matrix at `at` (its weight, dequantized where the checkpoint quantized it), its
    tensors taken out of `weights`."""
    weight = weights.pop(f"{at}.weight")
    scales = weights.pop(f"{at}.scales", None)
    if scales is None:
        return weight
    biases = weights.pop(f"{at}.biases", None)
    if biases is None:
        raise UnsupportedModelError(f"kimi_linear: {at} is quantized in a mode other than affine")
    group_size = input_dims // scales.shape[-1]
    bits = weight.shape[-1] * 32 // input_dims
    return mx.dequantize(weight, scales, biases, group_size=group_size, bits=bits)


def _read_back(weights: dict[str, mx.array], cfg: KimiLinearConfig) -> dict[str, mx.array]:
    """Fused convolutions split, mlx-lm's split kv_b_proj joined and its quantized routers
    dequantized."""
    out = dict(weights)
    for name in list(out):
        if m := FUSED_CONV.match(name):
            parts = mx.split(out.pop(name), 3, axis=0)
            out.update({f"{m['at']}.{c}.weight": p for c, p in zip(CONVS, parts, strict=True)})
        elif m := SPLIT_KV_B.match(name):
            at = m["at"]
            w_uk = _dense(out, f"{at}.embed_q", cfg.qk_nope_head_dim).swapaxes(-1, -2)
            w_uv = _dense(out, f"{at}.unembed_out", cfg.kv_lora_rank)
            if w_uk.shape[0] != w_uv.shape[0]:
                raise CheckpointError(f"{at}: embed_q and unembed_out disagree on the heads")
            joined = mx.concatenate([w_uk, w_uv], axis=1)  # [heads, nope + v, rank]
            out[f"{at}.kv_b_proj.weight"] = reshape(joined, -1, joined.shape[-1])
        elif m := ROUTER.match(name):
            out[f"{m['at']}.weight"] = _dense(out, m["at"], cfg.hidden_size)
    return out


class KimiLinearCheckpoint:
    model_types = ("kimi_linear",)

    def build(self, config: Mapping[str, Any]) -> KimiLinearForCausalLM:
        return KimiLinearForCausalLM(KimiLinearConfig.from_dict(config))

    def context_length(self, config: Mapping[str, Any]) -> int:
        return KimiLinearConfig.from_dict(config).max_position_embeddings

    def sanitize(self, weights: dict[str, mx.array], config: Mapping[str, Any]) -> dict[str, mx.array]:
        cfg = KimiLinearConfig.from_dict(config)
        kept = {
            _renamed(k): v for k, v in weights.items()
            if not k.startswith(("model.mtp.", "mtp.")) and not k.endswith("rotary_emb.inv_freq")
        }
        kept = _read_back(kept, cfg)
        kept, _ = torch_convs(kept, is_conv, cfg.linear_conv_kernel_dim)
        # dt_bias is one vector of heads * head_dim (mlx-lm reads a [heads, head_dim] one too)
        kept = {k: reshape(v, -1) if k.endswith(".self_attn.dt_bias") else v for k, v in kept.items()}
        return stack_experts(kept, EXPERT_KEYS)


CHECKPOINT = KimiLinearCheckpoint()
