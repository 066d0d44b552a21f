"""The qwen3 family (Qwen3 dense models)."""

from mlx_omnia.engine.models.qwen3.checkpoint import CHECKPOINT

__all__ = ["CHECKPOINT"]
