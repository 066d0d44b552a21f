"""The qwen3_5 family (Qwen3.5, dense and MoE): Qwen3-Next's gated DeltaNet and gated attention,
three to one, with split DeltaNet projections; the text model of the hub's image-text
checkpoints."""

from mlx_omnia.engine.models.qwen3_5.checkpoint import CHECKPOINT

__all__ = ["CHECKPOINT"]
