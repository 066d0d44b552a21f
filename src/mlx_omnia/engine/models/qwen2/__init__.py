"""The qwen2 family (Qwen1.5, Qwen2, Qwen2.5, and their coder/math variants)."""

from mlx_omnia.engine.models.qwen2.checkpoint import CHECKPOINT

__all__ = ["CHECKPOINT"]
