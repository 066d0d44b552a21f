"""The engine's public API: `load` is the only door.

`blas` comes first (its name sorts before every other engine module's): importing it loads the
system BLAS, which only works before anything imports mlx.core."""

import warnings

from mlx_omnia.engine.blas import late_warning
from mlx_omnia.engine.concurrent import Batch
from mlx_omnia.engine.errors import (
    ChatTemplateError,
    CheckpointError,
    ConstraintError,
    ContextLengthError,
    DownloadError,
    InvalidOptionsError,
    ModelNotFoundError,
    OmniaError,
    TokenizerError,
    UnsupportedModelError,
)
from mlx_omnia.engine.generate.loop import Decoding
from mlx_omnia.engine.generate.prefix import PrefixCache, PrefixStats, default_prefix_dir
from mlx_omnia.engine.loading import load
from mlx_omnia.engine.loading.cache import (
    CachedModel,
    PullProgress,
    cached_models,
    delete_cached,
    embedded_model,
    estimate_memory,
    pull,
)
from mlx_omnia.engine.model import Generation, Model
from mlx_omnia.engine.runtime import runtime_info, runtime_notes
from mlx_omnia.engine.text.tools import ToolCall, ToolCallDelta
from mlx_omnia.engine.types import (
    Bounds,
    Chat,
    ChatMessage,
    Completion,
    Constraint,
    GenerationOptions,
    OptionSpec,
    Piece,
    Signature,
    TextPart,
    TokenLogprob,
    TopLogprob,
    Usage,
    generation_options,
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


def _warn_if_mlx_came_first() -> None:
    message = late_warning()
    if message is not None:
        import mlx.core as mx  # imported already: that is the warning's cause

        if mx.default_device() == mx.cpu:
            warnings.warn(message, RuntimeWarning, stacklevel=3)


_warn_if_mlx_came_first()
