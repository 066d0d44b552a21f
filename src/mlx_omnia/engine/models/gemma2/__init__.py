"""The gemma2 family (Gemma 2)."""

from mlx_omnia.engine.models.gemma2.checkpoint import CHECKPOINT

__all__ = ["CHECKPOINT"]
