"""How gpt_oss checkpoints become a GptOssForCausalLM: config and tensor names.

The experts are stacked at load into the module tree's experts.gate_up_proj.{weight,bias}
([experts, 2 * intermediate, hidden]: all gate rows, then all up rows) and
experts.down_proj.{weight,bias} ([experts, hidden, intermediate]), from the layouts
checkpoints use:

    mlp.experts.gate_up_proj_blocks / _scales   MXFP4 as openai ships gpt-oss: uint8 blocks
    mlp.experts.down_proj_blocks / _scales      [experts, out, in / 32, 16] (two e2m1 values a
                                                byte, low nibble first) and uint8 e8m0 scales
                                                [experts, out, in / 32]; kept quantized, as
                                                MLX's mxfp4 (the bytes read as little-endian
                                                uint32 are MLX's packing)
    mlp.experts.gate_up_proj / down_proj        dense [experts, in, out] (transformers' layout,
                                                bf16 conversions, save_pretrained)
    mlp.experts.{gate_up,down}_proj_bias        [experts, out]
    mlp.experts.{gate_up,down}_proj.{weight,scales,biases,bias}   as this engine saves

transformers interleaves gate and up along the output (gate j is output 2j, up j is 2j + 1);
rows are reordered to [gate; up] here, which is exact for MXFP4 too (its groups run along the
input dimension).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import mlx.core as mx

from mlx_omnia.engine.core.mxcompat import reshape
from mlx_omnia.engine.errors import CheckpointError
from mlx_omnia.engine.models.gpt_oss.config import GptOssConfig
from mlx_omnia.engine.models.gpt_oss.model import GptOssForCausalLM

SHIPPED = re.compile(
    r"^(?P<block>.+\.mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)(?P<kind>|_blocks|_scales|_bias)$"
)


def _deinterleave(x: mx.array, axis: int) -> mx.array:
    """[..., 2n (gate, up, gate, up, ...), ...] -> [..., 2n (n gates, then n ups), ...]."""
    index = mx.concatenate([mx.arange(0, x.shape[axis], 2), mx.arange(1, x.shape[axis], 2)])
    return mx.take(x, index, axis=axis)


def _packed(blocks: mx.array) -> mx.array:
    """MXFP4 blocks [e, out, in / 32, 16] uint8 -> MLX's packing [e, out, in / 8] uint32."""
    if blocks.dtype != mx.uint8 or blocks.ndim != 4 or blocks.shape[-1] != 16:
        raise CheckpointError(f"MXFP4 blocks must be uint8 [experts, out, groups, 16], got "
                              f"{blocks.dtype} {tuple(blocks.shape)}")
    e, out, groups, _ = blocks.shape
    return reshape(blocks, e, out, groups * 16).view(mx.uint32)


def _convert(name: str, proj: str, kind: str, tensor: mx.array) -> tuple[str, mx.array]:
    gate_up = proj == "gate_up_proj"
    if kind == "_bias":
        return f"{name}.bias", _deinterleave(tensor, 1) if gate_up else tensor
    if kind == "_blocks":
        packed = _packed(tensor)
        return f"{name}.weight", _deinterleave(packed, 1) if gate_up else packed
    if kind == "_scales":
        if tensor.dtype != mx.uint8:
            raise CheckpointError(f"{name}_scales: MXFP4 scales must be uint8, got {tensor.dtype}")
        return f"{name}.scales", _deinterleave(tensor, 1) if gate_up else tensor
    dense = tensor.swapaxes(-1, -2)  # [e, in, out] -> [e, out, in]
    return f"{name}.weight", _deinterleave(dense, 1) if gate_up else dense


class GptOssCheckpoint:
    model_types = ("gpt_oss",)

    def build(self, config: Mapping[str, Any]) -> GptOssForCausalLM:
        return GptOssForCausalLM(GptOssConfig.from_dict(config))

    def context_length(self, config: Mapping[str, Any]) -> int:
        return GptOssConfig.from_dict(config).max_position_embeddings

    def sanitize(self, weights: dict[str, mx.array], config: Mapping[str, Any]) -> dict[str, mx.array]:
        """Stack the experts' tensors (see the module docstring); drop tensors that are derived,
        not learned (rotary inv_freq) and, when tied, a saved copy of the embedding as lm_head."""
        kept = {k: v for k, v in weights.items() if not k.endswith("rotary_emb.inv_freq")}
        if config.get("tie_word_embeddings", False):
            kept = {k: v for k, v in kept.items() if not k.startswith("lm_head.")}
        out: dict[str, mx.array] = {}
        for name, tensor in kept.items():
            if m := SHIPPED.match(name):
                key, value = _convert(f"{m['block']}.{m['proj']}", m["proj"], m["kind"], tensor)
                out[key] = value
            else:
                out[name] = tensor
        return out


CHECKPOINT = GptOssCheckpoint()
