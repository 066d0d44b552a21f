"""`load`: the only door into the engine."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import mlx.core as mx

from mlx_omnia.engine.errors import CheckpointError, InvalidOptionsError
from mlx_omnia.engine.loading.registry import family_for
from mlx_omnia.engine.loading.resolve import Source, resolve
from mlx_omnia.engine.loading.weights import (
    declare_quantization,
    finish_network,
    load_strict,
    on_cpu,
    read_json,
    read_safetensors,
)
from mlx_omnia.engine.model import GenerationDefaults, Model
from mlx_omnia.engine.text.tokenizer import Tokenizer

DTYPES: dict[str, mx.Dtype] = {
    "float32": mx.float32,
    "bfloat16": mx.bfloat16,
    "float16": mx.float16,
}

QuantizeSpec = int | Mapping[str, int] | None


def load(
    model: str | Path | None = None,
    *,
    dtype: str | mx.Dtype | None = None,
    quantize: QuantizeSpec = None,
    revision: str | None = None,
    local_files_only: bool = False,
    reference_kernels: bool | None = None,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
) -> Model:
    """Load a model: a local HF checkpoint directory, a hub repo id, a .gguf file, or
    "smollm2-135m-instruct"; None loads that embedded default model.

    dtype: "float32", "bfloat16", "float16" or an mx.Dtype; None keeps the checkpoint's dtype on
    a GPU and uses float32 on the CPU (where float32 matmuls are the fast ones).
    quantize: round-to-nearest affine quantization at load, as bits (4 or 8) or
    {"bits": 4, "group_size": 64}, for unquantized checkpoints.
    reference_kernels: True binds every layer declaration to its core MLX implementation (the
    numerical reference, for A/B runs) instead of a specialized kernel; None reads
    OMNIA_REFERENCE_KERNELS (1 = reference). `Model.bindings()` reports what each layer got.
    kv_bits: cache keys and values as 8- or 4-bit codes in groups of `kv_group_size` of a
    head's dims (`Model.quantize_kv_cache`); None caches them as computed."""
    want = _dtype(dtype)
    spec = _quantize_spec(quantize)
    source = resolve(model, revision=revision, local_files_only=local_files_only)
    if source.kind == "gguf":
        from mlx_omnia.engine.loading.gguf import load_gguf

        loaded = load_gguf(source, dtype=want, quantize=spec, reference_kernels=reference_kernels)
    else:
        loaded = _load_directory(
            source, dtype=want, quantize=spec, reference_kernels=reference_kernels
        )
    if kv_bits is not None:
        loaded.quantize_kv_cache(kv_bits, kv_group_size)
    return loaded


def _dtype(dtype: str | mx.Dtype | None) -> mx.Dtype | None:
    if dtype is None or isinstance(dtype, mx.Dtype):
        return dtype
    if dtype not in DTYPES:
        raise InvalidOptionsError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _quantize_spec(quantize: QuantizeSpec) -> tuple[int, int] | None:
    if quantize is None:
        return None
    if isinstance(quantize, int):
        bits, group_size = quantize, 64
    else:
        bits, group_size = int(quantize.get("bits", 4)), int(quantize.get("group_size", 64))
    if bits not in (2, 3, 4, 5, 6, 8) or group_size not in (32, 64, 128):
        raise InvalidOptionsError(
            f"quantize: bits must be 2-6 or 8 and group_size 32, 64 or 128 (got {bits}, {group_size})"
        )
    return bits, group_size


def _checkpoint_dtype(config: Mapping[str, Any]) -> mx.Dtype:
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    return DTYPES.get(str(name), mx.float32)


def eos_ids(*configs: Mapping[str, Any]) -> list[int]:
    ids: list[int] = []
    for config in configs:
        value = config.get("eos_token_id")
        if isinstance(value, int):
            ids.append(value)
        elif isinstance(value, list):
            ids.extend(int(v) for v in cast(list[Any], value) if isinstance(v, int))
    return ids


def _load_directory(
    source: Source, *, dtype: mx.Dtype | None, quantize: tuple[int, int] | None,
    reference_kernels: bool | None = None,
) -> Model:
    path = source.path
    config = read_json(path / "config.json")
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        raise CheckpointError(f"{path / 'config.json'} has no model_type")
    family = family_for(model_type)
    network = family.build(config)
    weights = family.sanitize(read_safetensors(path), config)
    quantization = config.get("quantization") or config.get("quantization_config")
    declare_quantization(
        network, weights, cast(Mapping[str, Any], quantization) if isinstance(quantization, dict) else None
    )
    load_strict(network, weights)
    if dtype is None:
        dtype = mx.float32 if on_cpu() else _checkpoint_dtype(config)
    finish_network(network, dtype=dtype, quantize=quantize, reference_kernels=reference_kernels)
    generation: dict[str, Any] = {}
    if (path / "generation_config.json").is_file():
        generation = read_json(path / "generation_config.json")
    tokenizer = Tokenizer.from_directory(path, eos_token_ids=eos_ids(generation, config))
    return Model(
        name=source.name,
        network=network,
        tokenizer=tokenizer,
        config=config,
        context_length=family.context_length(config),
        defaults=GenerationDefaults.from_dict(generation),
        source=str(path),
    )
