"""Precisely typed wrappers around the few MLX calls whose stubs are loose."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import mlx.core as mx


def load_safetensors(path: str | Path) -> dict[str, mx.array]:
    """Load every tensor of a safetensors file."""
    loaded = mx.load(str(path), format="safetensors")
    if not isinstance(loaded, dict):
        raise TypeError(f"{path}: expected a dict of tensors")
    return cast(dict[str, mx.array], loaded)


def load_gguf(path: str | Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """Load a GGUF file's tensors (Q4_0/Q4_1/Q8_0 become affine-quantized triples) and metadata."""
    loaded = mx.load(str(path), format="gguf", return_metadata=True)
    if not isinstance(loaded, tuple):
        raise TypeError(f"{path}: expected tensors and metadata")
    tensors, metadata = cast(tuple[dict[str, mx.array], dict[str, Any]], loaded)
    return tensors, metadata


def tree_arrays(tree: Any, prefix: str = "") -> list[tuple[str, mx.array]]:
    """Flatten nested dicts/lists of arrays into dotted names (like nn.Module.parameters())."""
    out: list[tuple[str, mx.array]] = []
    if isinstance(tree, mx.array):
        out.append((prefix, tree))
    elif isinstance(tree, dict):
        for key, value in cast(dict[str, Any], tree).items():
            out.extend(tree_arrays(value, f"{prefix}.{key}" if prefix else str(key)))
    elif isinstance(tree, list | tuple):
        for i, value in enumerate(cast(list[Any], tree)):
            out.extend(tree_arrays(value, f"{prefix}.{i}" if prefix else str(i)))
    return out


def silu(x: mx.array) -> mx.array:
    return x * mx.sigmoid(x)
