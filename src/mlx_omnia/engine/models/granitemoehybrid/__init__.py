"""The granitemoehybrid family (IBM Granite 4.0): Mamba-2 and attention layers, each followed
by a shared MLP and, where the model has them, top-k routed experts, under Granite's scalars."""

from mlx_omnia.engine.models.granitemoehybrid.checkpoint import CHECKPOINT

__all__ = ["CHECKPOINT"]
