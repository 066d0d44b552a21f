"""Loading GGUF files: MLX reads Q4_0/Q4_1/Q8_0/F16/F32 tensors; the family maps names."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, cast

import mlx.core as mx

from mlx_omnia.engine.core.layers import Embedding, Linear
from mlx_omnia.engine.core.mxcompat import load_gguf as read_gguf
from mlx_omnia.engine.core.mxcompat import named_modules
from mlx_omnia.engine.errors import CheckpointError, UnsupportedModelError
from mlx_omnia.engine.loading.registry import FamilyCheckpoint, family_for
from mlx_omnia.engine.loading.resolve import Source
from mlx_omnia.engine.loading.weights import (
    declare_quantization,
    finish_network,
    load_strict,
    on_cpu,
)
from mlx_omnia.engine.model import GenerationDefaults, Model
from mlx_omnia.engine.text.gguf_tokenizer import tokenizer_from_gguf

GGUF_MAGIC = b"GGUF"


class GgufCheckpoint(FamilyCheckpoint, Protocol):
    """A family that can read GGUF files of its architecture."""

    gguf_architecture: str

    def gguf_config(
        self, metadata: Mapping[str, Any], tensors: Mapping[str, mx.array]
    ) -> dict[str, Any]: ...

    def gguf_weights(
        self, tensors: Mapping[str, mx.array], config: Mapping[str, Any]
    ) -> dict[str, mx.array]: ...


def read(path: Any) -> tuple[dict[str, mx.array], dict[str, Any]]:
    with open(path, "rb") as f:
        magic = f.read(4)
    if not magic:
        raise CheckpointError(f"{path} is empty (0 bytes); download it again")
    if magic != GGUF_MAGIC:
        raise CheckpointError(
            f"{path} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r}: bad "
            "magic); download it again"
        )
    try:
        return read_gguf(path)
    except Exception as e:
        raise CheckpointError(
            f"{path} could not be read as GGUF ({e}); it may be truncated or use a tensor type "
            "MLX cannot load (supported: Q4_0, Q4_1, Q8_0, F16, F32)"
        ) from e


def load_gguf(
    source: Source, *, dtype: mx.Dtype | None, quantize: tuple[int, int] | None,
    reference_kernels: bool | None = None,
) -> Model:
    tensors, metadata = read(source.path)
    arch = str(metadata.get("general.architecture", ""))
    family = family_for(arch)
    if not hasattr(family, "gguf_config"):
        raise UnsupportedModelError(f"GGUF files of architecture {arch!r} are not supported yet")
    gguf = cast(GgufCheckpoint, family)
    config = gguf.gguf_config(metadata, tensors)
    weights = gguf.gguf_weights(tensors, config)
    if on_cpu():
        # GGUF stores group scales/mins as float16; dequantizing with float16 scales rounds every
        # weight to float16 (|error| up to 4e-3 on this model). Float32 scales expand exactly.
        weights = {
            k: v.astype(mx.float32) if k.endswith((".scales", ".biases")) else v
            for k, v in weights.items()
        }
    network = family.build(config)
    declare_quantization(network, weights, None)
    load_strict(network, weights)
    if on_cpu():
        # MLX's CPU quantized matmul is ~10x slower than float32 with BLAS: expand at load.
        for _, module in named_modules(network):
            if isinstance(module, Linear | Embedding):
                module.dequantize_weights(mx.float32)
    if dtype is None:
        dtype = mx.float32 if on_cpu() else mx.float16
    finish_network(network, dtype=dtype, quantize=quantize, reference_kernels=reference_kernels)
    tokenizer = tokenizer_from_gguf(metadata)
    return Model(
        name=source.name,
        network=network,
        tokenizer=tokenizer,
        config=config,
        context_length=family.context_length(config),
        defaults=GenerationDefaults(),
        source=str(source.path),
    )
