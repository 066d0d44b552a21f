"""Precisely typed wrappers around the few MLX calls whose stubs are loose.

`mlx.nn` and `mlx.utils` ship no stubs and some `mlx.core` signatures leave arguments or the
result untyped; each such call is wrapped here once, with the reason on its suppression, so the
rest of the code type-checks strictly and without suppressions."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten  # pyright: ignore[reportUnknownVariableType]  # mlx.utils: no stubs


def load_safetensors(path: str | Path) -> dict[str, mx.array]:
    """Load every tensor of a safetensors file."""
    loaded: Any = mx.load(str(path), format="safetensors")
    if not isinstance(loaded, dict):
        raise TypeError(f"{path}: expected a dict of tensors")
    return cast(dict[str, mx.array], loaded)


def load_safetensors_with_metadata(path: str | Path) -> tuple[dict[str, mx.array], dict[str, str]]:
    """Load a safetensors file's tensors and its `__metadata__` string map."""
    loaded: Any = mx.load(str(path), format="safetensors", return_metadata=True)
    if not isinstance(loaded, tuple):
        raise TypeError(f"{path}: expected tensors and metadata")
    return cast(tuple[dict[str, mx.array], dict[str, str]], loaded)


def load_gguf(path: str | Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """Load a GGUF file's tensors (Q4_0/Q4_1/Q8_0 become affine-quantized triples) and metadata."""
    loaded: Any = mx.load(str(path), format="gguf", return_metadata=True)
    if not isinstance(loaded, tuple):
        raise TypeError(f"{path}: expected tensors and metadata")
    return cast(tuple[dict[str, mx.array], dict[str, Any]], loaded)


def named_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every submodule with its dotted path (the checkpoint's tensor prefix)."""
    return cast(list[tuple[str, nn.Module]], module.named_modules())


def flat_parameters(module: nn.Module) -> dict[str, mx.array]:
    """Parameters by dotted name, as a checkpoint names its tensors."""
    return dict(cast(list[tuple[str, mx.array]], tree_flatten(module.parameters())))


def set_parameters(module: nn.Module, items: list[tuple[str, mx.array]]) -> None:
    """Replace parameters by dotted name."""
    tree = cast(dict[str, Any], tree_unflatten(cast(list[tuple[str, Any]], items)))
    module.update(tree)  # pyright: ignore[reportUnknownMemberType]  # mlx.nn has no stubs


def drop_parameters(module: nn.Module, *names: str) -> None:
    """Remove parameters (e.g. `scales`/`biases` after dequantizing)."""
    for name in names:
        module.pop(name, None)  # pyright: ignore[reportUnknownMemberType]  # nn.Module is a dict


def save_safetensors(path: str | Path, arrays: dict[str, mx.array], metadata: dict[str, str]) -> None:
    """Write `arrays` to a safetensors file with string `metadata`."""
    mx.save_safetensors(str(path), arrays, metadata=metadata)  # pyright: ignore[reportUnknownMemberType]  # stub: no return type


def evaluate(*arrays: mx.array | list[mx.array]) -> None:
    """mx.eval with typed arguments."""
    mx.eval(*arrays)  # pyright: ignore[reportUnknownMemberType]  # stub: *args untyped


def evaluate_async(*arrays: mx.array | list[mx.array]) -> None:
    """mx.async_eval with typed arguments."""
    mx.async_eval(*arrays)  # pyright: ignore[reportUnknownMemberType]  # stub: *args untyped


def int_item(x: mx.array) -> int:
    """An integer scalar array's value (the stub's `item()` is int | float | bool | complex)."""
    return cast(int, x.item())


def float_item(x: mx.array) -> float:
    """A floating scalar array's value (the stub's `item()` is int | float | bool | complex)."""
    return cast(float, x.item())


def reshape(x: mx.array, *shape: int) -> mx.array:
    return mx.reshape(x, shape)


def _silu(x: mx.array) -> mx.array:
    return x * mx.sigmoid(x)


def _gelu_tanh(x: mx.array) -> mx.array:
    return 0.5 * x * (1.0 + mx.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))


# Compiled (shapeless): each activation is one fused elementwise kernel instead of a chain of
# them over the whole [tokens, hidden] activation, which prefill feels. The ops, their order
# and their dtypes are the same.
_silu_fused = mx.compile(_silu, shapeless=True)
_gelu_tanh_fused = mx.compile(_gelu_tanh, shapeless=True)


def _silu_mul(g: mx.array, u: mx.array) -> mx.array:
    return _silu(g) * u


def _gelu_tanh_mul(g: mx.array, u: mx.array) -> mx.array:
    return _gelu_tanh(g) * u


_silu_mul_fused = mx.compile(_silu_mul, shapeless=True)
_gelu_tanh_mul_fused = mx.compile(_gelu_tanh_mul, shapeless=True)


def silu(x: mx.array) -> mx.array:
    """x * sigmoid(x)."""
    return _silu_fused(x)


def silu_mul(g: mx.array, u: mx.array) -> mx.array:
    """silu(g) * u (a gated MLP's activation) as one fused kernel."""
    return _silu_mul_fused(g, u)


def gelu_tanh_mul(g: mx.array, u: mx.array) -> mx.array:
    """gelu_tanh(g) * u as one fused kernel."""
    return _gelu_tanh_mul_fused(g, u)


def gelu_tanh(x: mx.array) -> mx.array:
    """GELU with the tanh approximation (PyTorch's gelu(approximate="tanh"))."""
    return _gelu_tanh_fused(x)
