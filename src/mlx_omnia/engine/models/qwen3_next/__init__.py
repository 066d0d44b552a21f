"""The qwen3_next family (Qwen3-Next): gated DeltaNet layers and gated attention, three to one,
under a mixture of experts with a gated shared expert."""

from mlx_omnia.engine.models.qwen3_next.checkpoint import CHECKPOINT

__all__ = ["CHECKPOINT"]
