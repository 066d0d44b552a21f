"""Reading tensors from checkpoint files, putting them into a network strictly, and finishing
the network (dtype, quantization, binding)."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn

from mlx_omnia.engine.core.binder import bind_layers
from mlx_omnia.engine.core.layers import Embedding, Linear
from mlx_omnia.engine.core.moe import ExpertLinear
from mlx_omnia.engine.core.mxcompat import (
    evaluate,
    flat_parameters,
    load_safetensors,
    named_modules,
    set_parameters,
)
from mlx_omnia.engine.errors import CheckpointError


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise CheckpointError(f"{path.name} is missing from {path.parent}") from e
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); re-download the checkpoint") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return cast(dict[str, Any], data)


def _check_safetensors(path: Path) -> None:
    """Validate the header and the data length, so truncation is an error, not garbage."""
    size = path.stat().st_size
    try:
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError("shorter than a header")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > 100_000_000:
                raise ValueError("header length past the end of the file")
            header = json.loads(f.read(n))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        end = 0
        for name, entry in cast(dict[str, Any], header).items():
            if name == "__metadata__":
                continue
            offsets = cast(dict[str, Any], entry)["data_offsets"]
            end = max(end, int(offsets[1]))
        if 8 + n + end > size:
            raise ValueError(f"data runs to byte {8 + n + end} but the file has {size}")
    except (ValueError, KeyError, TypeError, IndexError, OSError) as e:
        raise CheckpointError(
            f"{path} is corrupt or truncated ({e}); delete it and download the checkpoint again"
        ) from e


INDEX = "model.safetensors.index.json"


def index_shards(index: Path) -> list[str]:
    """The shard file names a safetensors index maps its tensors to, each a plain file name
    beside the index (the index is untrusted: no folders, no way out of the checkpoint)."""
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index} has no weight_map")
    names = sorted({str(v) for v in cast(dict[str, Any], weight_map).values()})
    bad = [
        n for n in names
        if not n.endswith(".safetensors") or n.startswith(".") or "/" in n or "\\" in n
    ]
    if bad or not names:
        raise CheckpointError(
            f"{index} maps tensors to {', '.join(map(repr, bad)) or 'no file'}: each shard must "
            "be a .safetensors file beside the index"
        )
    return names


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's weight files: the shards its index names, else every *.safetensors."""
    index = path / INDEX
    if index.is_file():
        files = [path / n for n in index_shards(index)]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(
                f"{path} is missing shard(s) {', '.join(missing)} named by its index; "
                "re-download the checkpoint"
            )
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path} has no *.safetensors weights (pytorch .bin is not read)")
    return files


def read_safetensors(path: Path) -> dict[str, mx.array]:
    weights: dict[str, mx.array] = {}
    for file in safetensors_files(path):
        _check_safetensors(file)
        try:
            weights.update(load_safetensors(file))
        except Exception as e:
            raise CheckpointError(f"{file} could not be read ({e}); download it again") from e
    return weights


def declare_quantization(
    network: nn.Module, weights: Mapping[str, mx.array], quantization: Mapping[str, Any] | None
) -> None:
    """Mark Linear/Embedding declarations quantized where the checkpoint stores them so.

    Bits and group size come from the config (with per-layer overrides, as mlx-community
    publishes them) and must agree with the tensor shapes."""
    layer_spec = _layer_specs(quantization or {})
    for path, module in named_modules(network):
        if not isinstance(module, Linear | Embedding | ExpertLinear) or f"{path}.scales" not in weights:
            continue
        w, scales = weights[f"{path}.weight"], weights[f"{path}.scales"]
        in_dims = module.input_dims if isinstance(module, Linear | ExpertLinear) else module.dims
        group_size = in_dims // scales.shape[-1]
        bits = w.shape[-1] * 32 // in_dims
        if quantization is not None:
            spec: Any = layer_spec(path)
            if isinstance(spec, Mapping):
                spec = cast(Mapping[str, Any], spec)
                want = (int(spec.get("bits", bits)), int(spec.get("group_size", group_size)))
                if want != (bits, group_size):
                    raise CheckpointError(
                        f"{path}: config says {want[0]}-bit groups of {want[1]} but the tensors "
                        f"hold {bits}-bit groups of {group_size}"
                    )
        if isinstance(module, ExpertLinear) and scales.dtype == mx.uint8:  # e8m0 scales: MXFP4
            module.to_quantized(bits=bits, group_size=group_size, mode="mxfp4")
        else:
            module.to_quantized(bits=bits, group_size=group_size)


def _layer_specs(quantization: Mapping[str, Any]) -> Callable[[str], Any]:
    """The config's entry for the layer at a path of the network: under that path, or else under
    the one longer path that ends with it, where the checkpoint's module tree wraps the network
    (mlx-lm's image-text models: `language_model.model.layers.0.mlp.gate`); else the defaults."""
    wrapped: dict[str, list[str]] = {}
    for key in quantization:
        parts = key.split(".")
        for i in range(1, len(parts)):
            wrapped.setdefault(".".join(parts[i:]), []).append(key)

    def spec(path: str) -> Any:
        if path in quantization:
            return quantization[path]
        keys = wrapped.get(path, [])
        return quantization[keys[0]] if len(keys) == 1 else quantization

    return spec


def load_strict(network: nn.Module, weights: Mapping[str, mx.array]) -> None:
    """Put `weights` into `network`; every parameter must be found, with its shape, and every
    tensor must find a parameter."""
    expected = flat_parameters(network)
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        parts: list[str] = []
        if missing:
            parts.append(f"missing tensors: {', '.join(missing[:8])}" + (" ..." if len(missing) > 8 else ""))
        if unexpected:
            parts.append(
                f"unexpected tensors: {', '.join(unexpected[:8])}" + (" ..." if len(unexpected) > 8 else "")
            )
        raise CheckpointError(
            "the checkpoint does not match its config.json (" + "; ".join(parts) + ")"
        )
    for name, param in expected.items():
        if tuple(param.shape) != tuple(weights[name].shape):
            raise CheckpointError(
                f"tensor {name} has shape {tuple(weights[name].shape)} but the config implies "
                f"{tuple(param.shape)}"
            )
    set_parameters(network, list(weights.items()))


def cast_floats(network: nn.Module, dtype: mx.Dtype) -> None:
    """Cast every floating-point parameter (not packed quantized weights) to `dtype`."""
    params = flat_parameters(network)
    set_parameters(
        network,
        [(k, v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v) for k, v in params.items()],
    )


def on_cpu() -> bool:
    return mx.default_device() == mx.cpu


def finish_network(
    network: nn.Module, *, dtype: mx.Dtype, quantize: tuple[int, int] | None,
    reference_kernels: bool | None = None,
) -> None:
    """After strict loading: cast, optionally quantize, bind declarations, materialize."""
    cast_floats(network, dtype)
    if quantize is not None:
        bits, group_size = quantize
        for _, module in named_modules(network):
            if isinstance(module, Linear | Embedding | ExpertLinear) and not module.quantized:
                dims = module.input_dims if isinstance(module, Linear | ExpertLinear) else module.dims
                if dims % group_size == 0:
                    module.quantize_weights(bits=bits, group_size=group_size)
    bind_layers(network, force_reference=reference_kernels)
    evaluate(list(flat_parameters(network).values()))
