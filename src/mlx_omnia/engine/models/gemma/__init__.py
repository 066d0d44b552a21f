"""The gemma family (Gemma 1)."""

from mlx_omnia.engine.models.gemma.checkpoint import CHECKPOINT

__all__ = ["CHECKPOINT"]
