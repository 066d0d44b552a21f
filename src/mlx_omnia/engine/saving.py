"""Saving a loaded model as an MLX-layout checkpoint directory (as mlx-community publishes them).

The directory holds config.json (with a "quantization" entry when layers are quantized: the
common bits/group size, plus per-layer entries where a layer differs or is left dense),
model.safetensors, the tokenizer files of the source checkpoint and generation_config.json.
`load` reads it back to bit-identical logits.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import mlx.core as mx
import mlx.nn as nn

from mlx_omnia.engine.core.layers import Embedding, Linear
from mlx_omnia.engine.core.moe import ExpertLinear
from mlx_omnia.engine.core.mxcompat import flat_parameters, named_modules, save_safetensors
from mlx_omnia.engine.errors import InvalidOptionsError, UnsupportedModelError


class _Defaults(Protocol):
    """The generation defaults of the source checkpoint (engine.model.GenerationDefaults)."""

    def to_dict(self, eos_token_ids: frozenset[int]) -> dict[str, Any]: ...


class _Tokenizer(Protocol):
    @property
    def eos_token_ids(self) -> frozenset[int]: ...


class Model(Protocol):
    """What saving reads of a loaded model (engine.model.Model, which calls into this module)."""

    @property
    def network(self) -> nn.Module: ...
    @property
    def config(self) -> Mapping[str, Any]: ...
    @property
    def source(self) -> str: ...
    @property
    def defaults(self) -> _Defaults: ...
    @property
    def tokenizer(self) -> _Tokenizer: ...

WEIGHTS_FILE = "model.safetensors"

# Files a checkpoint's tokenizer may be made of; those present in the source are copied.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)

DTYPE_NAMES: dict[mx.Dtype, str] = {
    mx.float32: "float32",
    mx.bfloat16: "bfloat16",
    mx.float16: "float16",
}


def save_model(model: Model, path: str | Path) -> Path:
    """Write `model` into the new directory `path` (created; it must not hold files yet)."""
    target = Path(path).expanduser()
    source = Path(model.source)
    if not source.is_dir():
        raise UnsupportedModelError(
            f"saving is supported for models loaded from a checkpoint directory, not from "
            f"{source.name}; load the HF checkpoint directory instead"
        )
    if target.exists():
        if not target.is_dir():
            raise InvalidOptionsError(f"{target} exists and is not a directory; pass a new path")
        if any(target.iterdir()):
            raise InvalidOptionsError(f"{target} is not empty; save into a new or empty directory")
    target.mkdir(parents=True, exist_ok=True)

    arrays = flat_parameters(model.network)
    save_safetensors(target / WEIGHTS_FILE, arrays, metadata={"format": "mlx"})

    config = _config(model, arrays)
    (target / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")

    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, target / name)
    if (source / "generation_config.json").is_file():
        shutil.copyfile(source / "generation_config.json", target / "generation_config.json")
    else:
        (target / "generation_config.json").write_text(
            json.dumps(_generation_config(model), indent=2) + "\n", encoding="utf-8"
        )
    return target


def quantization_entry(model: Model) -> dict[str, Any] | None:
    """The config's "quantization" entry for the network as it is now, or None if dense."""
    layers: dict[str, tuple[int, int] | None] = {}
    for name, module in named_modules(model.network):
        if isinstance(module, Linear | Embedding | ExpertLinear):
            if module.bits is not None and module.group_size is not None:
                layers[name] = (module.bits, module.group_size)
            else:
                layers[name] = None
    counts = Counter(spec for spec in layers.values() if spec is not None)
    if not counts:
        return None
    (bits, group_size), _ = counts.most_common(1)[0]
    entry: dict[str, Any] = {"group_size": group_size, "bits": bits}
    for name in sorted(layers):
        spec = layers[name]
        if spec is None:
            entry[name] = False
        elif spec != (bits, group_size):
            entry[name] = {"group_size": spec[1], "bits": spec[0]}
    return entry


def _config(model: Model, arrays: dict[str, mx.array]) -> dict[str, Any]:
    config = dict(model.config)
    config.pop("quantization", None)
    config.pop("quantization_config", None)
    quantization = quantization_entry(model)
    if quantization is not None:
        config["quantization"] = quantization
        config["quantization_config"] = quantization
    floats = {DTYPE_NAMES[a.dtype] for a in arrays.values() if a.dtype in DTYPE_NAMES}
    if len(floats) == 1:
        dtype = floats.pop()
        config["torch_dtype"] = dtype
        if "dtype" in config:
            config["dtype"] = dtype
    return config


def _generation_config(model: Model) -> dict[str, Any]:
    return model.defaults.to_dict(model.tokenizer.eos_token_ids)
