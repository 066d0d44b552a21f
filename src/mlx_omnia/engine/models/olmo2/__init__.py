"""The olmo2 family (AI2's OLMo 2 dense models)."""

from mlx_omnia.engine.models.olmo2.checkpoint import CHECKPOINT

__all__ = ["CHECKPOINT"]
