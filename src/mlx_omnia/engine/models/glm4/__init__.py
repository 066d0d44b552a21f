"""The glm4 family (GLM-4-0414 dense models)."""

from mlx_omnia.engine.models.glm4.checkpoint import CHECKPOINT

__all__ = ["CHECKPOINT"]
