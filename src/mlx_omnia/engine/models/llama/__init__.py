"""The llama family (Llama 2/3.x, SmolLM2, TinyLlama, ...)."""

from mlx_omnia.engine.models.llama.checkpoint import CHECKPOINT

__all__ = ["CHECKPOINT"]
