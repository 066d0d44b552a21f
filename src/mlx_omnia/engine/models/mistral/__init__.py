"""The mistral family (Mistral 7B v0.1-v0.3, Mistral NeMo, Codestral-style dense models)."""

from mlx_omnia.engine.models.mistral.checkpoint import CHECKPOINT

__all__ = ["CHECKPOINT"]
