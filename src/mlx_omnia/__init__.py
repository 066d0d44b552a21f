"""mlx-omnia: an inference engine for large language models on MLX.

The engine's public API is re-exported lazily, so importing a sibling package (the CLI) never
imports MLX."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlx_omnia.engine import (
        Batch,
        Bounds,
        CachedModel,
        Chat,
        ChatMessage,
        ChatTemplateError,
        CheckpointError,
        Completion,
        Constraint,
        ConstraintError,
        ContextLengthError,
        Decoding,
        DownloadError,
        Generation,
        GenerationOptions,
        InvalidOptionsError,
        Model,
        ModelNotFoundError,
        OmniaError,
        OptionSpec,
        Piece,
        PrefixCache,
        PrefixStats,
        PullProgress,
        Signature,
        TextPart,
        TokenizerError,
        TokenLogprob,
        ToolCall,
        ToolCallDelta,
        TopLogprob,
        UnsupportedModelError,
        Usage,
        cached_models,
        default_prefix_dir,
        delete_cached,
        embedded_model,
        estimate_memory,
        generation_options,
        load,
        pull,
        runtime_info,
        runtime_notes,
    )

__all__ = [
    "Batch",
    "Bounds",
    "CachedModel",
    "Chat",
    "ChatMessage",
    "ChatTemplateError",
    "CheckpointError",
    "Completion",
    "Constraint",
    "ConstraintError",
    "ContextLengthError",
    "Decoding",
    "DownloadError",
    "Generation",
    "GenerationOptions",
    "InvalidOptionsError",
    "Model",
    "ModelNotFoundError",
    "OmniaError",
    "OptionSpec",
    "Piece",
    "PrefixCache",
    "PrefixStats",
    "PullProgress",
    "Signature",
    "TextPart",
    "TokenLogprob",
    "TokenizerError",
    "ToolCall",
    "ToolCallDelta",
    "TopLogprob",
    "UnsupportedModelError",
    "Usage",
    "cached_models",
    "default_prefix_dir",
    "delete_cached",
    "embedded_model",
    "estimate_memory",
    "generation_options",
    "load",
    "pull",
    "runtime_info",
    "runtime_notes",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        # Resolved at run time (not a static import), so siblings that use this public API
        # depend on `mlx_omnia`, not on the engine's internals (see import-linter contracts).
        engine = importlib.import_module("mlx_omnia.engine")
        return getattr(engine, name)
    raise AttributeError(f"module 'mlx_omnia' has no attribute {name!r}")
