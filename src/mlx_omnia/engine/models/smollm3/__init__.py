"""The smollm3 family (Hugging Face SmolLM3)."""

from mlx_omnia.engine.models.smollm3.checkpoint import CHECKPOINT

__all__ = ["CHECKPOINT"]
