"""The phi3 family (Phi-3 mini/medium 4k and 128k, Phi-3.5-mini, Phi-4-mini)."""

from mlx_omnia.engine.models.phi3.checkpoint import CHECKPOINT

__all__ = ["CHECKPOINT"]
