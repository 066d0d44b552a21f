"""How gpt2 checkpoints become a Gpt2LMHeadModel: config and tensor names.

GPT-2's projections are Conv1D modules whose weight is stored [in, out]; the network declares
them as Linear ([out, in], as every other family), so sanitize transposes them (copies). Whether a file is
in Conv1D layout is read off the one non-square projection every layer has, attn.c_attn
([n_embd, 3 n_embd] in Conv1D layout, [3 n_embd, ...] as this engine saves it, dense or
quantized), for the whole file at once (attn.c_proj is square: its own shape cannot tell).

Older hub files (openai-community/gpt2's) name tensors without the "transformer." prefix and
carry the attention's causal-mask buffers (attn.bias, attn.masked_bias): the prefix is added,
the buffers dropped."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import mlx.core as mx

from mlx_omnia.engine.errors import CheckpointError
from mlx_omnia.engine.models.gpt2.config import Gpt2Config
from mlx_omnia.engine.models.gpt2.model import Gpt2LMHeadModel

PREFIX = "transformer."
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
BUFFERS = (".attn.bias", ".attn.masked_bias")


class Gpt2Checkpoint:
    model_types = ("gpt2",)

    def build(self, config: Mapping[str, Any]) -> Gpt2LMHeadModel:
        return Gpt2LMHeadModel(Gpt2Config.from_dict(config))

    def context_length(self, config: Mapping[str, Any]) -> int:
        return Gpt2Config.from_dict(config).n_positions

    def sanitize(self, weights: dict[str, mx.array], config: Mapping[str, Any]) -> dict[str, mx.array]:
        cfg = Gpt2Config.from_dict(config)
        kept: dict[str, mx.array] = {}
        for name, value in weights.items():
            if name.endswith(BUFFERS):
                continue
            if not name.startswith((PREFIX, "lm_head.")):
                name = PREFIX + name
            kept[name] = value
        if cfg.tie_word_embeddings:
            kept = {k: v for k, v in kept.items() if not k.startswith("lm_head.")}
        probe = kept.get(f"{PREFIX}h.0.attn.c_attn.weight")
        if probe is None:
            raise CheckpointError(f"gpt2: the checkpoint has no {PREFIX}h.0.attn.c_attn.weight")
        if probe.shape == (cfg.n_embd, 3 * cfg.n_embd):
            # Row-contiguous copies: a transposed view would multiply with other rounding than
            # the same weights read back from a saved file.
            kept = {
                k: mx.contiguous(v.T) if k.endswith(CONV1D) and k.startswith(f"{PREFIX}h.") else v
                for k, v in kept.items()
            }
        return kept


CHECKPOINT = Gpt2Checkpoint()
