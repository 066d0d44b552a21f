"""The gemma3_text family (Gemma 3 text-only checkpoints: Gemma3ForCausalLM)."""

from mlx_omnia.engine.models.gemma3_text.checkpoint import CHECKPOINT

__all__ = ["CHECKPOINT"]
