"""The granite family (IBM Granite 3.x dense models)."""

from mlx_omnia.engine.models.granite.checkpoint import CHECKPOINT

__all__ = ["CHECKPOINT"]
