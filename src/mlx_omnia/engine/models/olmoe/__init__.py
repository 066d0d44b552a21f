"""The olmoe family (AllenAI OLMoE mixture-of-experts models, e.g. OLMoE-1B-7B)."""

from mlx_omnia.engine.models.olmoe.checkpoint import CHECKPOINT

__all__ = ["CHECKPOINT"]
