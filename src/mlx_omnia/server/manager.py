"""Which models are resident: loading on demand (one load at a time), pricing a checkpoint
against the memory budget, evicting least-recently-used idle models, unloading idle ones."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mlx_omnia import (
    InvalidOptionsError,
    Model,
    OmniaError,
    cached_models,
    estimate_memory,
    load,
)
from mlx_omnia.server.errors import ApiError
from mlx_omnia.server.settings import Settings

DEFAULT_MODEL = "smollm2-135m-instruct"
# A model id is a name: the default, an alias given with --model PATH, or a hub repo id.
REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")


def not_served(model_id: str) -> ApiError:
    """The one answer for every id the server does not serve, whether or not something of that
    name exists anywhere (a client learns nothing about the server's disk)."""
    return ApiError(
        "not_found",
        f"model {model_id!r} is not served here: ask for the default, a model given with --model "
        "or a hub model in the server's cache (omnia pull owner/name)",
        "model",
    )


def cached_snapshot(repo_id: str) -> Path | None:
    """The snapshot directory of `repo_id` in the HF cache (the one `main` points at, if any)."""
    revisions = [m for m in cached_models() if m.repo_id == repo_id]
    revisions.sort(key=lambda m: "main" not in m.refs)
    return revisions[0].path if revisions else None

Loader = Callable[[str | Path | None], Model]
Pricer = Callable[[str | Path | None], int]


def _estimate(reference: str | Path | None) -> int:
    """The engine's estimate from file headers; 0 when it cannot price the checkpoint (the load
    that follows reports why with its own typed error)."""
    try:
        return estimate_memory(reference)
    except OmniaError:
        return 0


logger = logging.getLogger(__name__)


@dataclass
class Resident:
    id: str
    model: Model
    nbytes: int
    loaded_at: float
    last_used: float
    busy: int = 0


class ModelManager:
    def __init__(
        self,
        settings: Settings,
        *,
        loader: Loader | None = None,
        pricer: Pricer | None = None,
    ) -> None:
        self.settings = settings
        # Requests load what is on disk; downloads happen only through POST /admin/models.
        self._loader: Loader = loader or self._load
        self._pricer: Pricer = pricer or _estimate
        self._resident: OrderedDict[str, Resident] = OrderedDict()
        self._aliases: dict[str, Path] = {}
        self._state = threading.Lock()  # guards _resident
        self._loading = threading.Lock()  # one load at a time
        self.default_id = DEFAULT_MODEL

    def _load(self, ref: str | Path | None) -> Model:
        model = load(ref, local_files_only=True)
        if self.settings.kv_bits is not None:
            try:
                model.quantize_kv_cache(self.settings.kv_bits, self.settings.kv_group_size)
            except InvalidOptionsError as e:
                logger.warning("%s keeps a plain KV cache: %s", model.name, e)
        return model

    # -- ids ---------------------------------------------------------------------------------
    def add_alias(self, path: Path) -> str:
        """Serve a local directory or GGUF file under its directory name or file stem."""
        model_id = path.stem if path.is_file() else path.name
        self._aliases[model_id] = path
        return model_id

    def aliases(self) -> dict[str, Path]:
        return dict(self._aliases)

    def check_id(self, model_id: str | None) -> str:
        """The canonical id for a requested model name (None: the default model): only what the
        server serves, the default, its aliases, what is resident, or a hub repo id (owner/name,
        found in the HF cache when it loads). A bare name is never a path."""
        if model_id is None or model_id == "":
            return self.default_id
        if model_id.lower() == DEFAULT_MODEL:
            return DEFAULT_MODEL
        if model_id in self._aliases or model_id == self.default_id or self.is_resident(model_id):
            return model_id
        if REPO_ID.match(model_id) and ".." not in model_id:
            return model_id
        raise not_served(model_id)

    def repo_id(self, model_id: str) -> str:
        """`model_id` if it is spelled as a hub repo id (owner/name) and is no alias, else 400."""
        if REPO_ID.match(model_id) and ".." not in model_id and model_id not in self._aliases:
            return model_id
        raise ApiError("invalid_request", f"{model_id!r} is not a hub repo id (owner/name)", "model")

    def _reference(self, model_id: str) -> str | Path | None:
        """What `load` is given: None (the embedded default), an alias's path or a hub model's
        snapshot directory, never a name `load` could read as a path under the cwd."""
        if model_id == DEFAULT_MODEL:
            return None
        if model_id in self._aliases:
            return self._aliases[model_id]
        snapshot = cached_snapshot(model_id) if REPO_ID.match(model_id) else None
        if snapshot is None:
            raise not_served(model_id)
        return snapshot

    # -- residency ---------------------------------------------------------------------------
    def get(self, model_id: str) -> Resident:
        """The resident model, loading it (and evicting LRU idle models) if needed.
        Marks it busy: call `release` when done."""
        res = self.get_resident(model_id)
        if res is not None:
            return res
        with self._loading:
            res = self.get_resident(model_id)  # loaded while we waited for the lock
            if res is not None:
                return res
            reference = self._reference(model_id)
            self._make_room(model_id, reference)
            try:
                model = self._loader(reference)
            except (OmniaError, ApiError):
                raise
            except Exception as e:  # a malformed checkpoint the loader did not name
                raise ApiError(
                    "invalid_request",
                    f"the model {model_id!r} cannot be loaded: its checkpoint is malformed "
                    f"({type(e).__name__}: {e})",
                    "model",
                ) from e
            now = time.monotonic()
            res = Resident(model_id, model, model.nbytes, now, now, busy=1)
            with self._state:
                self._resident[model_id] = res
            return res

    def release(self, res: Resident) -> None:
        with self._state:
            res.busy = max(0, res.busy - 1)
            res.last_used = time.monotonic()

    def _make_room(self, model_id: str, reference: str | Path | None) -> None:
        need = self._pricer(reference)
        budget = self.settings.memory_limit
        if need > budget:
            raise ApiError(
                "invalid_request",
                f"model {model_id!r} needs about {need / 1e9:.1f} GB but the server's memory "
                f"limit is {budget / 1e9:.1f} GB (--memory-limit)",
                "model",
            )
        with self._state:
            used = sum(r.nbytes for r in self._resident.values())
            for rid in list(self._resident):
                if used + need <= budget:
                    break
                victim = self._resident[rid]
                if victim.busy == 0:
                    del self._resident[rid]
                    used -= victim.nbytes
            if used + need > budget:
                raise ApiError(
                    "overloaded",
                    f"not enough memory to load {model_id!r} now: the resident models are busy; "
                    "try again shortly",
                    "model",
                )

    def unload(self, model_id: str) -> bool:
        with self._state:
            res = self._resident.get(model_id)
            if res is None:
                return False
            if res.busy:
                raise ApiError("invalid_request", f"model {model_id!r} is busy; try again")
            del self._resident[model_id]
            return True

    def reap_idle(self) -> list[str]:
        """Unload models idle for longer than --idle-ttl."""
        cutoff = time.monotonic() - self.settings.idle_ttl
        with self._state:
            gone = [r.id for r in self._resident.values() if r.busy == 0 and r.last_used < cutoff]
            for rid in gone:
                del self._resident[rid]
        return gone

    def resident(self) -> list[Resident]:
        with self._state:
            return list(self._resident.values())

    def get_resident(self, model_id: str) -> Resident | None:
        """The resident model marked busy (call `release`), or None; never loads."""
        with self._state:
            res = self._resident.get(model_id)
            if res is not None:
                res.busy += 1
                res.last_used = time.monotonic()
                self._resident.move_to_end(model_id)
            return res

    def is_resident(self, model_id: str) -> bool:
        with self._state:
            return model_id in self._resident

    def memory_used(self) -> int:
        """Bytes held by the resident models' weights."""
        with self._state:
            return sum(r.nbytes for r in self._resident.values())

    def reference(self, model_id: str) -> str | Path | None:
        """What `load` is given for a canonical id (see `_reference`); 404 if it is not served."""
        return self._reference(model_id)
