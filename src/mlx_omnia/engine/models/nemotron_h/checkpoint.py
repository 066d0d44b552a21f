"""How nemotron_h checkpoints become a NemotronHForCausalLM: config and tensor names.

Names are the hub's (`backbone.*`, what transformers 5 save_pretrained writes too); transformers
5's in-memory `model.*` is read as `backbone.*`. The routed experts come per expert
(`mixer.experts.<e>.{up,down}_proj.weight`), fused (transformers 5's `mixer.experts.up_proj`
without `.weight`), or as mlx-community's `mixer.switch_mlp.fc1` / `fc2`; all are stacked into
`mixer.experts.up_proj` / `down_proj`. mlx-community's conv1d weights [C, K, 1] (MLX's
convolution layout) are read as torch's [C, 1, K]. The multi-token-prediction head (`mtp.*`,
which transformers does not load either) is not part of this network: its tensors are
dropped."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import mlx.core as mx

from mlx_omnia.engine.core.mlx_layout import torch_convs
from mlx_omnia.engine.errors import CheckpointError
from mlx_omnia.engine.models.nemotron_h.config import NemotronHConfig
from mlx_omnia.engine.models.nemotron_h.model import NemotronHForCausalLM

_KIND = r"(?P<kind>weight|scales|biases)"
PER_EXPERT = re.compile(
    rf"^(?P<at>.+\.mixer\.experts)\.(?P<expert>\d+)\.(?P<proj>up_proj|down_proj)\.{_KIND}$"
)
FUSED = re.compile(r"^.+\.mixer\.experts\.(?:up_proj|down_proj)$")
SWITCH = re.compile(rf"^(?P<at>.+\.mixer)\.switch_mlp\.(?P<proj>fc1|fc2)\.{_KIND}$")
SWITCH_NAMES = {"fc1": "up_proj", "fc2": "down_proj"}


def stack_experts(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Per-expert, fused and switch_mlp expert tensors as experts.{up,down}_proj.<kind>; every
    other tensor keeps its name."""
    out: dict[str, mx.array] = {}
    per_expert: dict[str, dict[int, mx.array]] = {}  # stacked name -> expert -> tensor
    for name, tensor in weights.items():
        if m := PER_EXPERT.match(name):
            stacked = f"{m['at']}.{m['proj']}.{m['kind']}"
            per_expert.setdefault(stacked, {})[int(m["expert"])] = tensor
        elif FUSED.match(name):
            out[f"{name}.weight"] = tensor
        elif m := SWITCH.match(name):
            out[f"{m['at']}.experts.{SWITCH_NAMES[m['proj']]}.{m['kind']}"] = tensor
        else:
            out[name] = tensor
    for stacked, experts in per_expert.items():
        if sorted(experts) != list(range(len(experts))):
            raise CheckpointError(f"{stacked}: some experts are missing (found {sorted(experts)})")
        out[stacked] = mx.stack([experts[e] for e in range(len(experts))])
    return out


class NemotronHCheckpoint:
    model_types = ("nemotron_h",)

    def build(self, config: Mapping[str, Any]) -> NemotronHForCausalLM:
        return NemotronHForCausalLM(NemotronHConfig.from_dict(config))

    def context_length(self, config: Mapping[str, Any]) -> int:
        return NemotronHConfig.from_dict(config).max_position_embeddings

    def sanitize(self, weights: dict[str, mx.array], config: Mapping[str, Any]) -> dict[str, mx.array]:
        kept = {
            re.sub(r"^model\.", "backbone.", k): v
            for k, v in weights.items() if not k.startswith("mtp.")
        }
        kernel = NemotronHConfig.from_dict(config).conv_kernel
        kept, _ = torch_convs(kept, lambda k: k.endswith(".conv1d.weight"), kernel)
        return stack_experts(kept)


CHECKPOINT = NemotronHCheckpoint()
