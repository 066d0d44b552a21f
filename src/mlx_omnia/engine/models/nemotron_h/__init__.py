"""The nemotron_h family (NVIDIA Nemotron-H, Nemotron 3 Nano): Mamba-2, attention, MLP and
mixture-of-experts blocks in the order of the config's hybrid pattern."""

from mlx_omnia.engine.models.nemotron_h.checkpoint import CHECKPOINT

__all__ = ["CHECKPOINT"]
