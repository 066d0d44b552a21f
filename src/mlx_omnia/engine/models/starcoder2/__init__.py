"""The starcoder2 family (BigCode StarCoder2 3B/7B/15B)."""

from mlx_omnia.engine.models.starcoder2.checkpoint import CHECKPOINT

__all__ = ["CHECKPOINT"]
