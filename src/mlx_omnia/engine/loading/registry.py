"""model_type -> the family package whose CHECKPOINT builds it (one door, like vLLM's registry).

Families are imported on first use, so loading one never imports the others."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any, Protocol, cast

import mlx.core as mx
import mlx.nn as nn

from mlx_omnia.engine.errors import UnsupportedModelError


class FamilyCheckpoint(Protocol):
    """What loading needs of a family package's CHECKPOINT."""

    model_types: tuple[str, ...]

    def build(self, config: Mapping[str, Any]) -> nn.Module: ...

    def context_length(self, config: Mapping[str, Any]) -> int: ...

    def sanitize(
        self, weights: dict[str, mx.array], config: Mapping[str, Any]
    ) -> dict[str, mx.array]: ...


FAMILIES: dict[str, str] = {
    "llama": "mlx_omnia.engine.models.llama",
    "qwen2": "mlx_omnia.engine.models.qwen2",
    "qwen3": "mlx_omnia.engine.models.qwen3",
    "qwen3_moe": "mlx_omnia.engine.models.qwen3_moe",
    "mixtral": "mlx_omnia.engine.models.mixtral",
    "olmoe": "mlx_omnia.engine.models.olmoe",
    "qwen2_moe": "mlx_omnia.engine.models.qwen2_moe",
    "mistral": "mlx_omnia.engine.models.mistral",
    "phi3": "mlx_omnia.engine.models.phi3",
    "granite": "mlx_omnia.engine.models.granite",
    "olmo2": "mlx_omnia.engine.models.olmo2",
    "smollm3": "mlx_omnia.engine.models.smollm3",
    "starcoder2": "mlx_omnia.engine.models.starcoder2",
    "gemma": "mlx_omnia.engine.models.gemma",
    "gemma2": "mlx_omnia.engine.models.gemma2",
    "gemma3_text": "mlx_omnia.engine.models.gemma3_text",
    "cohere": "mlx_omnia.engine.models.cohere",
    "glm4": "mlx_omnia.engine.models.glm4",
    "gpt_oss": "mlx_omnia.engine.models.gpt_oss",
    "deepseek_v2": "mlx_omnia.engine.models.deepseek_v2",
    "kimi_linear": "mlx_omnia.engine.models.kimi_linear",
    "exaone4": "mlx_omnia.engine.models.exaone4",
    "gpt2": "mlx_omnia.engine.models.gpt2",
    "lfm2": "mlx_omnia.engine.models.lfm2",
    "lfm2_moe": "mlx_omnia.engine.models.lfm2_moe",
    "qwen3_next": "mlx_omnia.engine.models.qwen3_next",
    "mamba2": "mlx_omnia.engine.models.mamba2",
    "granitemoehybrid": "mlx_omnia.engine.models.granitemoehybrid",
    "nemotron_h": "mlx_omnia.engine.models.nemotron_h",
    "jamba": "mlx_omnia.engine.models.jamba",
    "falcon_h1": "mlx_omnia.engine.models.falcon_h1",
    "qwen3_5": "mlx_omnia.engine.models.qwen3_5",
    "qwen3_5_text": "mlx_omnia.engine.models.qwen3_5",
    "qwen3_5_moe": "mlx_omnia.engine.models.qwen3_5",
    "qwen3_5_moe_text": "mlx_omnia.engine.models.qwen3_5",
    "bailing_hybrid": "mlx_omnia.engine.models.bailing_hybrid",
}


def family_for(model_type: str) -> FamilyCheckpoint:
    module = FAMILIES.get(model_type)
    if module is None:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(sorted(FAMILIES))}"
        )
    return cast(FamilyCheckpoint, importlib.import_module(module).CHECKPOINT)
