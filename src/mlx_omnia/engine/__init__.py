"""The engine's public API: `load` is the only door."""

from mlx_omnia.engine import blas

blas.preload()  # before anything imports mlx.core
if (_late := blas.late_warning()) is not None:
    import mlx.core as _mx  # imported already (that is the warning's cause)

    if _mx.default_device() == _mx.cpu:
        import warnings

        warnings.warn(_late, RuntimeWarning, stacklevel=2)

# ruff: noqa: E402

from mlx_omnia.engine.errors import (
    ChatTemplateError,
    CheckpointError,
    ContextLengthError,
    DownloadError,
    InvalidOptionsError,
    ModelNotFoundError,
    OmniaError,
    TokenizerError,
    UnsupportedModelError,
)
from mlx_omnia.engine.generate.loop import Decoding
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
from mlx_omnia.engine.model import Model
from mlx_omnia.engine.runtime import runtime_info
from mlx_omnia.engine.types import (
    Bounds,
    Chat,
    ChatMessage,
    Completion,
    GenerationOptions,
    OptionSpec,
    Piece,
    Signature,
    TokenLogprob,
    TopLogprob,
    Usage,
    generation_options,
)

__all__ = [
    "Bounds",
    "CachedModel",
    "Chat",
    "ChatMessage",
    "ChatTemplateError",
    "CheckpointError",
    "Completion",
    "ContextLengthError",
    "Decoding",
    "DownloadError",
    "GenerationOptions",
    "InvalidOptionsError",
    "Model",
    "ModelNotFoundError",
    "OmniaError",
    "OptionSpec",
    "Piece",
    "PullProgress",
    "Signature",
    "TokenLogprob",
    "TokenizerError",
    "TopLogprob",
    "UnsupportedModelError",
    "Usage",
    "cached_models",
    "delete_cached",
    "embedded_model",
    "estimate_memory",
    "generation_options",
    "load",
    "pull",
    "runtime_info",
]
