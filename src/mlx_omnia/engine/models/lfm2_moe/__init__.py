"""The lfm2_moe family (Liquid AI's LFM2-MoE): LFM2's gated short convolutions and attention,
with sigmoid-routed experts after the first dense layers."""

from mlx_omnia.engine.models.lfm2_moe.checkpoint import CHECKPOINT

__all__ = ["CHECKPOINT"]
