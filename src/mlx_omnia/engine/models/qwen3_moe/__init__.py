"""The qwen3_moe family (Qwen3 mixture-of-experts models, e.g. Qwen3-30B-A3B)."""

from mlx_omnia.engine.models.qwen3_moe.checkpoint import CHECKPOINT

__all__ = ["CHECKPOINT"]
