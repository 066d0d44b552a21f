"""Downloading checkpoints from the Hugging Face hub into the standard HF cache."""

from __future__ import annotations

from pathlib import Path

from mlx_omnia.engine.errors import DownloadError, ModelNotFoundError

# Only what loading reads: configs, tokenizer, templates and safetensors weights.
ALLOW_PATTERNS = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "*.safetensors",
    "model.safetensors.index.json",
]


def download(repo_id: str, *, revision: str | None = None, local_files_only: bool = False) -> Path:
    """Fetch (or find in the cache) the files of `repo_id` needed to load it."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        path = snapshot_download(
            repo_id,
            revision=revision,
            allow_patterns=ALLOW_PATTERNS,
            local_files_only=local_files_only,
        )
    except RepositoryNotFoundError as e:
        raise ModelNotFoundError(
            f"hub repo {repo_id!r} was not found (or is private: set HF_TOKEN)"
        ) from e
    except RevisionNotFoundError as e:
        raise ModelNotFoundError(f"hub repo {repo_id!r} has no revision {revision!r}") from e
    except LocalEntryNotFoundError as e:
        raise ModelNotFoundError(
            f"{repo_id!r} is not in the local HF cache and downloads are off "
            "(local_files_only / HF_HUB_OFFLINE); connect and try again"
        ) from e
    except Exception as e:
        raise DownloadError(f"downloading {repo_id!r} failed: {e}; try again") from e
    return Path(path)
