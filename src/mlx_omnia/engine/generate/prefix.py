"""A content-addressed, two-tier store of KV prefix blocks, so a prompt that repeats an earlier
prompt's beginning skips prefilling it.

A block is `block_tokens` tokens. Its key is a hash chain: the root hashes a version tag and the
model key, and each block's key hashes the previous key with the block's token ids, so a key
names the model and every token up to the block's end; a lookup walks the chain until a key is
missing. Blocks live in memory (LRU within a byte budget) and, write-through, on disk as one
safetensors file each (LRU by mtime within a byte budget), so they outlive the process. A
background thread writes the files; the caller only copies arrays to host memory. A file is
served only if its metadata (chain key, model digest, tensor layout, payload SHA-256) checks
out; a bad one is deleted and counted as a miss."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import mmap
import os
import queue
import struct
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias

import mlx.core as mx
import numpy as np

from mlx_omnia.engine.core.mxcompat import evaluate

LayerState: TypeAlias = dict[str, mx.array]
"""One layer's state for one block, opaque to the store (today its keys and values)."""
BlockState: TypeAlias = list[LayerState]
"""Every layer's state for one block; the list index is the layer."""

logger = logging.getLogger(__name__)

_VERSION = b"mlx-omnia prefix v1\0"
_FORMAT = "mlx-omnia-prefix/1"
_SUFFIX = ".safetensors"
# safetensors' dtype names; bfloat16 travels as its uint16 bits (numpy has no bfloat16).
_CODES: dict[mx.Dtype, str] = {
    mx.bool_: "BOOL", mx.uint8: "U8", mx.int8: "I8", mx.uint16: "U16", mx.int16: "I16",
    mx.uint32: "U32", mx.int32: "I32", mx.uint64: "U64", mx.int64: "I64", mx.float16: "F16",
    mx.bfloat16: "BF16", mx.float32: "F32", mx.float64: "F64",
}


def default_prefix_dir() -> Path:
    """The per-user prefix cache directory: $OMNIA_PREFIX_DIR when set, else
    ~/Library/Caches/mlx-omnia/prefix on macOS, $XDG_CACHE_HOME/mlx-omnia/prefix
    (~/.cache/mlx-omnia/prefix) elsewhere."""
    if os.environ.get("OMNIA_PREFIX_DIR"):
        return Path(os.environ["OMNIA_PREFIX_DIR"])
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "mlx-omnia" / "prefix"
    cache_home = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache_home) / "mlx-omnia" / "prefix"


@dataclass(frozen=True)
class PrefixStats:
    """A snapshot of the cache's sizes and counters. Hits and misses count the whole blocks
    lookups asked for; `evictions` are the memory tier's."""

    memory_bytes: int
    memory_blocks: int
    disk_bytes: int
    disk_blocks: int
    pending_writes: int
    hits: int
    misses: int
    stored: int
    evictions: int
    disk_evictions: int
    dropped_corrupt: int
    disk_errors: int


@dataclass
class _Write:
    key: bytes
    tensors: list[tuple[str, str, list[int], np.ndarray[Any, Any]]]  # name, dtype, shape, data
    metadata: dict[str, str]


def _layout(state: BlockState) -> list[list[list[Any]]]:
    """Each layer's [name, dtype, shape] triples, as a file's metadata records them."""
    return [[[name, _CODES.get(a.dtype), list(a.shape)] for name, a in layer.items()]
            for layer in state]


def _host(a: mx.array) -> np.ndarray[Any, Any]:
    """A C-ordered host copy of `a` (bfloat16 as its uint16 bits)."""
    return np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a, order="C", copy=True)


@dataclass
class _Block:
    """A block file read and checked on the host: each layer's tensors as (name, safetensors
    dtype, shape, bytes)."""

    layers: list[list[tuple[str, str, list[int], memoryview]]]

    def arrays(self) -> BlockState:
        """The block's state (MLX arrays: made on the caller's thread)."""
        return [{name: _array(code, shape, data) for name, code, shape, data in layer}
                for layer in self.layers]


# numpy's dtype of each safetensors code (bfloat16 as its uint16 bits)
_NUMPY: dict[str, np.dtype[Any]] = {code: np.dtype(name) for code, name in (
    ("BOOL", "bool"), ("U8", "uint8"), ("I8", "int8"), ("U16", "uint16"), ("I16", "int16"),
    ("U32", "uint32"), ("I32", "int32"), ("U64", "uint64"), ("I64", "int64"),
    ("F16", "float16"), ("BF16", "uint16"), ("F32", "float32"), ("F64", "float64"))}


def _array(code: str, shape: list[int], data: memoryview) -> mx.array:
    host = np.frombuffer(data, dtype=_NUMPY[code]).reshape(shape)
    a = mx.array(host)
    return a.view(mx.bfloat16) if code == "BF16" else a


def _read_block(path: Path, key: bytes, digest: str) -> _Block:
    """A block's file, once it proves to be the one `key` names (format, key, model) and to hold
    exactly what was written (its size, its tensors' layout, the payload's SHA-256): host bytes
    only, so reader threads run it side by side. The file is mapped, not read: the checksum and
    the arrays read the page cache's bytes (writers replace files whole, so a mapped file never
    shrinks under a reader)."""
    with path.open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise ValueError("an empty file")
        # the page cache's own bytes: hashed and copied into arrays once, never copied to here
        data = memoryview(mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ))
    if len(data) < 8:
        raise ValueError("shorter than a safetensors header")
    (length,) = struct.unpack("<Q", data[:8])
    if 8 + length > len(data):
        raise ValueError("header longer than the file")
    header: Any = json.loads(bytes(data[8 : 8 + length]))
    meta: Any = header.pop("__metadata__", {})
    if meta.get("format") != _FORMAT or meta.get("key") != key.hex():
        raise ValueError("not the block this key names")
    if meta.get("model") != digest:
        raise ValueError("written for another model")
    layout: Any = json.loads(meta["layers"])
    payload = data[8 + length :]
    end = 0
    layers: list[list[tuple[str, str, list[int], memoryview]]] = []
    for i, layer in enumerate(layout):
        tensors: list[tuple[str, str, list[int], memoryview]] = []
        for name, code, shape in layer:
            entry = header.pop(f"{i}.{name}")
            start, stop = entry["data_offsets"]
            count = int(np.prod(shape, dtype=np.int64))
            if (entry["dtype"], entry["shape"]) != (code, shape) or code not in _NUMPY or (
                start != end or stop - start != count * _NUMPY[code].itemsize
            ):
                raise ValueError("tensors differ from the metadata's layers")
            tensors.append((str(name), code, list(shape), payload[start:stop]))
            end = stop
        layers.append(tensors)
    if header:
        raise ValueError("tensors the metadata's layers do not name")
    if end != len(payload):
        raise ValueError(f"{len(data)} bytes, not what its header describes")
    if hashlib.sha256(payload).hexdigest() != meta.get("payload_sha256"):
        raise ValueError("payload checksum mismatch")
    return _Block(layers)


def _anchor_key(block_key: bytes) -> bytes:
    """The key of the anchor after the block whose chain key is `block_key`."""
    return hashlib.sha256(b"anchor\0" + block_key).digest()


def _unlink(paths: list[Path]) -> None:
    for path in paths:
        with contextlib.suppress(OSError):  # one that will not go only costs disk space
            path.unlink(missing_ok=True)


class PrefixCache:
    """KV prefix blocks by content, in memory and optionally on disk; thread-safe. Arrays that
    lookup returns are shared with the store: read them, never assign into them."""

    def __init__(self, *, block_tokens: int = 256, memory_bytes: int,
                 disk_dir: Path | None = None, disk_bytes: int = 0) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be positive, got {block_tokens}")
        self.block_tokens = block_tokens
        self._memory_budget, self._disk_budget = memory_bytes, disk_bytes
        self._disk_dir = disk_dir if disk_bytes > 0 else None
        self._lock = threading.Lock()
        self._memory: OrderedDict[bytes, tuple[BlockState, int]] = OrderedDict()
        self._disk: OrderedDict[bytes, int] = OrderedDict()  # key -> file size, oldest first
        self._pending: set[bytes] = set()
        self._counts = dict.fromkeys(("memory_bytes", "disk_bytes", "hits", "misses", "stored",
            "evictions", "disk_evictions", "dropped_corrupt", "disk_errors"), 0)
        self._jobs: queue.Queue[_Write | Path | None] = queue.Queue()  # a Path: touch it
        self._writer: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None  # the readers, made on first use
        if self._disk_dir is not None:
            self._scan(self._disk_dir)
            self._writer = threading.Thread(target=self._write_loop, daemon=True)
            self._writer.start()

    def lookup(self, model_key: str, tokens: Sequence[int]) -> list[BlockState]:
        """The states of the longest run of whole blocks of `tokens`, from the first, that the
        cache holds (a disk hit is promoted into memory); [] on no hit. The run's files are read
        and checked on reader threads, all at once; the arrays are made here."""
        digest = hashlib.sha256(model_key.encode()).hexdigest()
        run: list[tuple[bytes, BlockState | None]] = []  # None: on disk only
        for key in self._chain(model_key, tokens):
            with self._lock:
                held = self._memory.get(key)
                on_disk = key in self._disk
                if held is not None:
                    self._memory.move_to_end(key)
                if on_disk:
                    self._disk.move_to_end(key)
                    if self._writer is not None:  # the file's mtime is its age across restarts
                        self._jobs.put(self._path(key))
            if held is None and not on_disk:
                break
            run.append((key, None if held is None else held[0]))
        reads = {key: self._readers().submit(_read_block, self._path(key), key, digest)
                 for key, state in run if state is None}
        found: list[BlockState] = []
        for i, (key, state) in enumerate(run):
            if state is None:
                state = self._take(key, reads[key])
                if state is None:
                    for later, _ in run[i + 1:]:
                        if later in reads:
                            reads[later].cancel()
                    break
            found.append(state)
        with self._lock:
            self._counts["hits"] += len(found)
            self._counts["misses"] += len(tokens) // self.block_tokens - len(found)
        return found

    def store(self, model_key: str, tokens: Sequence[int],
              state_of: Callable[[int], BlockState]) -> int:
        """Keep every whole block of `tokens` the cache does not hold yet; `state_of(i)` gives
        block i's state. Returns how many blocks were added."""
        missing: list[tuple[bytes, BlockState]] = []
        for i, key in enumerate(self._chain(model_key, tokens)):
            if not self._holds(key):
                missing.append((key, state_of(i)))
        return self._add(model_key, missing)

    def store_anchor(self, model_key: str, tokens: Sequence[int], state: BlockState) -> bool:
        """Keep `state`, what a model carries past all of `tokens` (whole blocks: a recurrent
        layer's state there), as an anchor a later prompt starting with `tokens` resumes from.
        An anchor is an entry of its own, keyed by the last block's chain key, beside the
        blocks' rows. Returns whether it was added (False: held already)."""
        if not tokens or len(tokens) % self.block_tokens:
            raise ValueError(f"an anchor follows whole blocks of {self.block_tokens} tokens")
        key = _anchor_key(list(self._chain(model_key, tokens))[-1])
        return not self._holds(key) and self._add(model_key, [(key, state)]) == 1

    def anchor(self, model_key: str, tokens: Sequence[int]) -> tuple[int, BlockState] | None:
        """The anchor after the most whole blocks of `tokens` (from the first) that has one:
        (how many blocks, its state), or None."""
        digest = hashlib.sha256(model_key.encode()).hexdigest()
        keys = [_anchor_key(k) for k in self._chain(model_key, tokens)]
        for n in range(len(keys), 0, -1):
            key = keys[n - 1]
            with self._lock:
                held = self._memory.get(key)
                on_disk = key in self._disk
                if held is not None:
                    self._memory.move_to_end(key)
            if held is not None:
                return n, held[0]
            if on_disk:
                state = self._take(key, self._readers().submit(
                    _read_block, self._path(key), key, digest))
                if state is not None:
                    return n, state
        return None

    def _holds(self, key: bytes) -> bool:
        with self._lock:
            return key in self._memory or key in self._disk or key in self._pending

    def _add(self, model_key: str, entries: list[tuple[bytes, BlockState]]) -> int:
        """Keep new entries in memory and queue their files; returns how many were added."""
        digest = hashlib.sha256(model_key.encode()).hexdigest()
        # Own copies (mx.array copies; mx.contiguous may share): a block sliced out of a
        # larger KV buffer would otherwise keep the whole buffer alive behind a small nbytes.
        missing = [(key, [{name: mx.array(a) for name, a in layer.items()} for layer in state])
                   for key, state in entries]
        # one evaluation for all of them: the caller's device work is waited for once
        evaluate([a for _, state in missing for layer in state for a in layer.values()])
        added = 0
        for key, state in missing:
            write = self._encode(key, digest, state)
            with self._lock:
                kept = self._keep(key, state)
                if write is not None and self._writer is not None:  # not closed meanwhile
                    self._pending.add(key)
                    self._jobs.put(write)
                if kept or write is not None:
                    self._counts["stored"] += 1
                    added += 1
        return added

    def stats(self) -> PrefixStats:
        """The current sizes and counters."""
        with self._lock:
            return PrefixStats(memory_blocks=len(self._memory), disk_blocks=len(self._disk),
                               pending_writes=len(self._pending), **self._counts)

    def flush(self) -> None:
        """Wait until every queued disk write (and touch) is done."""
        if self._writer is not None:
            self._jobs.join()

    def close(self) -> None:
        """Flush and stop the writer thread; later stores keep to memory. Idempotent."""
        with self._lock:
            writer, self._writer = self._writer, None
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        if writer is not None:
            self._jobs.join()
            self._jobs.put(None)
            writer.join()

    def clear(self) -> None:
        """Drop every block from both tiers, their files included."""
        self.flush()
        with self._lock:
            self._memory.clear()
            dropped, self._disk = list(self._disk), OrderedDict()
            self._counts["memory_bytes"] = self._counts["disk_bytes"] = 0
        _unlink([self._path(key) for key in dropped])

    def _chain(self, model_key: str, tokens: Sequence[int]) -> Iterator[bytes]:
        key = hashlib.sha256(_VERSION + model_key.encode()).digest()
        n = self.block_tokens
        for start in range(0, len(tokens) - n + 1, n):
            key = hashlib.sha256(key + struct.pack(f"<{n}i", *tokens[start:start + n])).digest()
            yield key

    def _path(self, key: bytes) -> Path:
        assert self._disk_dir is not None
        return self._disk_dir / key.hex()[:2] / f"{key.hex()}{_SUFFIX}"

    def _keep(self, key: bytes, state: BlockState) -> bool:
        """Put a block in memory as the most recent, evicting the least recent (lock held)."""
        nbytes = sum(a.nbytes for layer in state for a in layer.values())
        if nbytes > self._memory_budget:
            return False
        if key not in self._memory:
            self._memory[key] = (state, nbytes)
            self._counts["memory_bytes"] += nbytes
        self._memory.move_to_end(key)
        while self._counts["memory_bytes"] > self._memory_budget:
            _, (_, size) = self._memory.popitem(last=False)
            self._counts["memory_bytes"] -= size
            self._counts["evictions"] += 1
        return True

    def _readers(self) -> ThreadPoolExecutor:
        """The threads that read and check block files (host bytes only)."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1),
                                                thread_name_prefix="omnia-prefix-read")
            return self._pool

    def _take(self, key: bytes, read: Future[_Block]) -> BlockState | None:
        """A disk block's state once its read is checked (kept in memory), or None where the
        file was evicted meanwhile or fails its checks (deleted, counted)."""
        path = self._path(key)
        try:
            state = read.result().arrays()
        except Exception as error:  # whatever a bad file does, it costs a miss, never the caller
            corrupt = not isinstance(error, FileNotFoundError)  # else evicted meanwhile
            if corrupt:
                logger.warning("prefix cache: dropping %s: %s", path, error)
                _unlink([path])
            with self._lock:
                self._counts["dropped_corrupt"] += corrupt
                if (size := self._disk.pop(key, None)) is not None:
                    self._counts["disk_bytes"] -= size
            return None
        with self._lock:
            self._keep(key, state)
        return state

    def _encode(self, key: bytes, digest: str, state: BlockState) -> _Write | None:
        """The host copy of a block for the writer thread, or None where it will not be written."""
        if self._writer is None:
            return None
        if any(a.dtype not in _CODES for layer in state for a in layer.values()):
            logger.warning("prefix cache: a dtype safetensors lacks; block kept in memory only")
            return None
        tensors = [(f"{i}.{name}", _CODES[a.dtype], list(a.shape), _host(a))
                   for i, layer in enumerate(state) for name, a in layer.items()]
        metadata = {"format": _FORMAT, "key": key.hex(), "model": digest,
                    "layers": json.dumps(_layout(state))}
        return _Write(key, tensors, metadata)

    def _write_loop(self) -> None:
        # Only host bytes and files here: MLX is never called off the engine's thread.
        while (job := self._jobs.get()) is not None:
            try:
                if isinstance(job, Path):
                    os.utime(job)
                else:
                    self._write(job)
            except FileNotFoundError:  # a touch of a file evicted meanwhile
                pass
            except Exception as error:  # a failed write costs a cache entry, never the engine
                with self._lock:
                    self._counts["disk_errors"] += 1
                    level = logging.WARNING if self._counts["disk_errors"] == 1 else logging.DEBUG
                logger.log(level, "prefix cache: disk write failed: %s", error)
            finally:
                if isinstance(job, _Write):
                    with self._lock:
                        self._pending.discard(job.key)
                self._jobs.task_done()
        self._jobs.task_done()

    def _write(self, job: _Write) -> None:
        header: dict[str, Any] = {}
        payload, end = hashlib.sha256(), 0
        for name, code, shape, data in job.tensors:
            header[name] = {"dtype": code, "shape": shape, "data_offsets": [end, end + data.nbytes]}
            payload.update(data.data)
            end += data.nbytes
        header["__metadata__"] = {**job.metadata, "payload_sha256": payload.hexdigest()}
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the format aligns the payload to 8 bytes
        if (size := 8 + len(encoded) + end) > self._disk_budget:
            return
        path = self._path(job.key)
        path.parent.mkdir(parents=True, exist_ok=True)
        # A whole file or none: readers never see a partial one. No fsync: a file torn by a
        # crash fails its checks and is dropped, which is all a cache needs.
        temp = path.with_name(f".{path.stem}.{os.getpid()}.tmp")
        try:
            with temp.open("wb") as f:
                f.write(struct.pack("<Q", len(encoded)) + encoded)
                for *_, data in job.tensors:
                    f.write(data.data)
            os.replace(temp, path)
        finally:
            temp.unlink(missing_ok=True)
        with self._lock:
            self._counts["disk_bytes"] += size - self._disk.get(job.key, 0)
            self._disk[job.key] = size
            evicted = self._trim_disk()
        _unlink(evicted)

    def _trim_disk(self) -> list[Path]:
        """Forget the least recently used files until the rest fit the budget (lock held)."""
        evicted: list[Path] = []
        while self._counts["disk_bytes"] > self._disk_budget:
            old, size = self._disk.popitem(last=False)
            self._counts["disk_bytes"] -= size
            self._counts["disk_evictions"] += 1
            evicted.append(self._path(old))
        return evicted

    def _scan(self, root: Path) -> None:
        """Learn the files an earlier process left, oldest first, and trim them to the budget."""
        found: list[tuple[int, bytes, int]] = []
        for path in root.glob("??/*"):
            name = path.name.removesuffix(_SUFFIX)
            try:
                stat = path.stat()
                if path.suffix == ".tmp" and time.time() - stat.st_mtime > 600:
                    path.unlink()  # left by a crash (a live writer's is younger)
                elif path.suffix == _SUFFIX and len(name) == 64 and name == name.lower():
                    found.append((stat.st_mtime_ns, bytes.fromhex(name), stat.st_size))
            except (OSError, ValueError):  # gone meanwhile, or a name that is no key
                continue
        for _, key, size in sorted(found):
            self._disk[key] = size
            self._counts["disk_bytes"] += size
        _unlink(self._trim_disk())
