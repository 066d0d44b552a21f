"""The deepseek_v2 family (DeepSeek-V2, V2-Lite, V2.5, Coder-V2): multi-head latent attention
and a mixture of experts with shared experts."""

from mlx_omnia.engine.models.deepseek_v2.checkpoint import CHECKPOINT

__all__ = ["CHECKPOINT"]
