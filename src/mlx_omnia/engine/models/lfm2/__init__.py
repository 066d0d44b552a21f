"""The lfm2 family (Liquid AI's LFM2): short gated convolutions interleaved with attention."""

from mlx_omnia.engine.models.lfm2.checkpoint import CHECKPOINT

__all__ = ["CHECKPOINT"]
