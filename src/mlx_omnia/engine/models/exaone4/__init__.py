"""The exaone4 family (LG AI Research's EXAONE 4.0 1.2B/32B)."""

from mlx_omnia.engine.models.exaone4.checkpoint import CHECKPOINT

__all__ = ["CHECKPOINT"]
