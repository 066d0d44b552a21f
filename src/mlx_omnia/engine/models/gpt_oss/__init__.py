"""The gpt_oss family (OpenAI gpt-oss-20b / gpt-oss-120b)."""

from mlx_omnia.engine.models.gpt_oss.checkpoint import CHECKPOINT

__all__ = ["CHECKPOINT"]
