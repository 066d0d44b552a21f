"""The cohere family (Command R, Command R+)."""

from mlx_omnia.engine.models.cohere.checkpoint import CHECKPOINT

__all__ = ["CHECKPOINT"]
