"""The bailing_hybrid family (inclusionAI's Ling 3.0 / Ring hybrid linear models): delta
attention with a forget gate per key channel and gated multi-head latent attention, under a
mixture of experts with shared experts or a dense MLP."""

from mlx_omnia.engine.models.bailing_hybrid.checkpoint import CHECKPOINT

__all__ = ["CHECKPOINT"]
