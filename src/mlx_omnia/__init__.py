"""mlx-omnia: an inference engine for large language models on MLX.

The engine's public API is re-exported lazily, so importing a sibling package (the CLI) never
imports MLX."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlx_omnia.engine import (
        Chat,
        ChatMessage,
        ChatTemplateError,
        CheckpointError,
        Completion,
        ContextLengthError,
        DownloadError,
        GenerationOptions,
        InvalidOptionsError,
        Model,
        ModelNotFoundError,
        OmniaError,
        Piece,
        Signature,
        TokenizerError,
        UnsupportedModelError,
        Usage,
        load,
    )

__all__ = [
    "Chat",
    "ChatMessage",
    "ChatTemplateError",
    "CheckpointError",
    "Completion",
    "ContextLengthError",
    "DownloadError",
    "GenerationOptions",
    "InvalidOptionsError",
    "Model",
    "ModelNotFoundError",
    "OmniaError",
    "Piece",
    "Signature",
    "TokenizerError",
    "UnsupportedModelError",
    "Usage",
    "load",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from mlx_omnia import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'mlx_omnia' has no attribute {name!r}")
