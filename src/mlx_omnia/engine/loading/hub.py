"""Downloading checkpoints from the Hugging Face hub into the standard HF cache.

Configured the way huggingface_hub is, through environment variables read when it is first
imported: HF_ENDPOINT (a mirror or a local hub), HF_HOME / HF_HUB_CACHE (where the cache lives),
HF_HUB_OFFLINE=1 (never touch the network), HF_TOKEN (private and gated repos)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from mlx_omnia.engine.errors import CheckpointError, DownloadError, ModelNotFoundError, OmniaError
from mlx_omnia.engine.loading.weights import INDEX, index_shards

if TYPE_CHECKING:
    from huggingface_hub import DryRunFileInfo

# What loading reads besides the weights: configs, tokenizer, templates, the shards' index.
META_PATTERNS = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    INDEX,
]
# Everything loading may read: the weights are the shards the index names, or without an index
# every top-level *.safetensors (weight_patterns).
ALLOW_PATTERNS = [*META_PATTERNS, "*.safetensors"]
# Loading reads only the repo's top level (fnmatch's "*" also matches "/").
SUBFOLDERS = ["*/*"]

# owner/name as the hub spells repo ids; never a path (no "..", no leading "/", no "\").
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")
# Characters git forbids in ref names (besides control characters).
_REF_FORBIDDEN = re.compile(r"[\x00-\x20\x7f~^:?*\[\\]|\.\.|@\{")


def _valid_revision(revision: str) -> bool:
    """git check-ref-format rules, so a revision can never step out of the cache's refs/."""
    if not revision or revision == "@" or _REF_FORBIDDEN.search(revision):
        return False
    return all(
        part and not part.startswith(".") and not part.endswith((".lock", "."))
        for part in revision.split("/")
    )


def is_repo_id(text: str) -> bool:
    """Whether `text` is spelled as a hub repo id (owner/name), never a path."""
    return bool(_REPO_ID.match(text)) and ".." not in text


def check_names(repo_id: str, revision: str | None) -> None:
    if not is_repo_id(repo_id):
        raise ModelNotFoundError(
            f"{repo_id!r} is not a hub repo id; write it as owner/name (letters, digits, '-', "
            "'_', '.')"
        )
    if revision is not None and not _valid_revision(revision):
        raise ModelNotFoundError(
            f"{revision!r} is not a valid revision of {repo_id!r}; pass a branch, tag or commit hash"
        )


def _is_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _endpoint() -> str:
    from huggingface_hub import constants

    return str(constants.ENDPOINT)


def _cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def weight_patterns(snapshot: Path) -> list[str]:
    """The weight files to fetch into `snapshot` (which holds the META_PATTERNS files): the
    shards its index names, else every top-level *.safetensors. A repo that ships both shards
    and a consolidated file (consolidated.safetensors beside model-0000N-of-0000M) needs only
    the shards, as loading reads only them."""
    index = snapshot / INDEX
    return index_shards(index) if index.is_file() else ["*.safetensors"]


def download(repo_id: str, *, revision: str | None = None, local_files_only: bool = False) -> Path:
    """Fetch (or find in the cache) the files of `repo_id` needed to load it and return the
    snapshot directory (HF_HUB_CACHE/models--owner--name/snapshots/<commit>): the configs,
    tokenizer and index first, then the weights they name, at the same commit."""
    check_names(repo_id, revision)
    try:
        meta = snapshot(repo_id, revision, META_PATTERNS, local_files_only=local_files_only)
        path = snapshot(repo_id, meta.name, weight_patterns(meta), local_files_only=local_files_only)
    except Exception as e:
        raise hub_error(e, repo_id, revision, local_files_only=local_files_only) from e
    _check_snapshot(repo_id, path)
    return path


def snapshot(
    repo_id: str, revision: str | None, patterns: list[str], *, local_files_only: bool = False
) -> Path:
    """The snapshot directory holding the top-level files of `repo_id` at `revision` that match
    `patterns`, fetched into the HF cache where missing."""
    snapshot_download, _ = _hub_downloads()
    return Path(
        snapshot_download(
            repo_id, revision=revision, allow_patterns=patterns, ignore_patterns=SUBFOLDERS,
            local_files_only=local_files_only,
        )
    )


def snapshot_plan(
    repo_id: str, revision: str | None, patterns: list[str], progress: type
) -> list[DryRunFileInfo]:
    """What `snapshot` would fetch (a dry run): each file's commit, size and whether it is
    cached; `progress` is the tqdm-like class huggingface_hub reports the listing to."""
    snapshot_download, _ = _hub_downloads()
    return list(
        snapshot_download(
            repo_id, revision=revision, allow_patterns=patterns, ignore_patterns=SUBFOLDERS,
            dry_run=True, tqdm_class=progress,
        )
    )


def fetch_file(repo_id: str, filename: str, revision: str, progress: type | None = None) -> Path:
    """One file of `repo_id` at `revision` in the HF cache (`progress`: a tqdm-like class)."""
    _, hf_hub_download = _hub_downloads()
    return Path(hf_hub_download(repo_id, filename=filename, revision=revision, tqdm_class=progress))


def _hub_downloads() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """huggingface_hub's snapshot_download and hf_hub_download, imported on first use (loading
    a local checkpoint never imports the hub client)."""
    from huggingface_hub import hf_hub_download, snapshot_download  # pyright: ignore[reportUnknownVariableType]  # their user_agent is a bare dict

    return cast(Callable[..., Any], snapshot_download), cast(Callable[..., Any], hf_hub_download)


def hub_error(
    e: Exception, repo_id: str, revision: str | None, *, local_files_only: bool
) -> OmniaError:
    """The engine's typed error for an exception raised by huggingface_hub."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(e, OmniaError):
        return e
    at = f" at revision {revision!r}" if revision else ""
    if isinstance(e, GatedRepoError):
        return ModelNotFoundError(
            f"hub repo {repo_id!r} is gated: accept its terms on {_endpoint()}/{repo_id} and set "
            "HF_TOKEN to a token of that account"
        )
    if isinstance(e, RepositoryNotFoundError):
        return ModelNotFoundError(
            f"hub repo {repo_id!r} was not found on {_endpoint()}; check the spelling "
            "(owner/name), or set HF_TOKEN if it is private"
        )
    if isinstance(e, RevisionNotFoundError):
        return ModelNotFoundError(
            f"hub repo {repo_id!r} has no revision {revision!r}; pass an existing branch, tag or "
            "commit hash"
        )
    if isinstance(e, IncompleteSnapshotError):
        return DownloadError(
            f"the cached download of {repo_id!r}{at} is incomplete and the hub cannot be used "
            f"now ({e.__class__.__name__}); run again with network access (and without "
            "local_files_only / HF_HUB_OFFLINE) to finish it"
        )
    if isinstance(e, LocalEntryNotFoundError):
        if local_files_only or _is_offline():
            why = "local_files_only=True" if local_files_only else "HF_HUB_OFFLINE is set"
            return ModelNotFoundError(
                f"{repo_id!r}{at} is not in the local HF cache ({_cache_dir()}) and downloads are "
                f"off ({why}); download it first: load it with downloads on, or `omnia pull "
                f"{repo_id}`"
            )
        return DownloadError(
            f"could not reach the hub at {_endpoint()} to download {repo_id!r}{at}, and it is "
            "not in the local HF cache; check the network (and HF_ENDPOINT) and try again"
        )
    if isinstance(e, HFValidationError):
        return ModelNotFoundError(f"{repo_id!r} is not a valid hub repo id: {e}")
    detail = " ".join(str(e).split())  # huggingface_hub's messages span several lines
    if _unreachable(e):
        return DownloadError(
            f"could not reach the hub at {_endpoint()} to download {repo_id!r}{at} "
            f"({e.__class__.__name__}: {detail}); check the network (and HF_ENDPOINT) and try "
            "again"
        )
    return DownloadError(
        f"downloading {repo_id!r}{at} from {_endpoint()} failed ({e.__class__.__name__}: "
        f"{detail}); try again: files already complete are kept in the HF cache and are not "
        "fetched twice"
    )


def _unreachable(e: BaseException) -> bool:
    """Whether `e` (or what it wraps) says the hub could not be reached at all: a refused or
    timed-out connection, an unknown host (a transfer broken midway is not that)."""
    import socket

    import httpx

    seen: set[int] = set()
    at: BaseException | None = e
    while at is not None and id(at) not in seen:
        seen.add(id(at))
        if isinstance(at, httpx.ConnectError | httpx.ConnectTimeout | ConnectionRefusedError
                      | socket.gaierror):
            return True
        at = at.__cause__ or at.__context__
    return False

def _check_snapshot(repo_id: str, path: Path) -> None:
    """The repo must hold an HF-format checkpoint: config.json and safetensors weights."""
    if not (path / "config.json").is_file():
        raise CheckpointError(
            f"hub repo {repo_id!r} has no config.json, so it is not a Hugging Face format "
            "checkpoint; for a GGUF-only repo, download the .gguf file and pass its path"
        )
    if not any(path.glob("*.safetensors")):
        raise CheckpointError(
            f"hub repo {repo_id!r} has no *.safetensors weights (only PyTorch .bin or other "
            "formats?); pick a repo with safetensors weights or convert the checkpoint"
        )
