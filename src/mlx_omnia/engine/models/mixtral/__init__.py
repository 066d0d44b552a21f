"""The mixtral family (Mixtral mixture-of-experts models, e.g. Mixtral-8x7B)."""

from mlx_omnia.engine.models.mixtral.checkpoint import CHECKPOINT

__all__ = ["CHECKPOINT"]
