"""The qwen2_moe family (Qwen1.5-MoE and Qwen2-MoE mixture-of-experts models)."""

from mlx_omnia.engine.models.qwen2_moe.checkpoint import CHECKPOINT

__all__ = ["CHECKPOINT"]
