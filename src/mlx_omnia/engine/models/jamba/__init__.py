"""The jamba family (AI21's Jamba): Mamba-1 layers interleaved with attention, MLPs and
mixtures of experts."""

from mlx_omnia.engine.models.jamba.checkpoint import CHECKPOINT

__all__ = ["CHECKPOINT"]
