"""The kimi_linear family (Moonshot's Kimi Linear): Kimi Delta Attention layers (a gated delta
rule with a decay per key channel) and multi-head latent attention without positions, under a
mixture of experts with sigmoid routing and shared experts."""

from mlx_omnia.engine.models.kimi_linear.checkpoint import CHECKPOINT

__all__ = ["CHECKPOINT"]
