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
}


def family_for(model_type: str) -> FamilyCheckpoint:
    module = FAMILIES.get(model_type)
    if module is None:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(sorted(FAMILIES))}"
        )
    return cast(FamilyCheckpoint, importlib.import_module(module).CHECKPOINT)
