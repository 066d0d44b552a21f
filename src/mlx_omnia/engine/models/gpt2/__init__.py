"""The gpt2 family (OpenAI's GPT-2 and checkpoints of its architecture: DistilGPT2, DialoGPT,
Stanford CRFM's Mistral GPT-2s)."""

from mlx_omnia.engine.models.gpt2.checkpoint import CHECKPOINT

__all__ = ["CHECKPOINT"]
