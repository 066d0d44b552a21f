"""The mamba2 family (Mamba-2, Codestral Mamba): state space layers only, no attention."""

from mlx_omnia.engine.models.mamba2.checkpoint import CHECKPOINT

__all__ = ["CHECKPOINT"]
