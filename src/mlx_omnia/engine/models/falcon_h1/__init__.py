"""The falcon_h1 family (TII's Falcon-H1): every layer runs attention and a Mamba-2 mixer side
by side, under muP multipliers."""

from mlx_omnia.engine.models.falcon_h1.checkpoint import CHECKPOINT

__all__ = ["CHECKPOINT"]
