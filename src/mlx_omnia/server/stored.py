"""Responses the server keeps (the Responses API's `store`): a later request continues one by
its id (`previous_response_id`), a client reads or deletes it."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from mlx_omnia import ChatMessage

# Responses kept, the oldest forgotten first (memory only: a restart forgets them all).
MAX_STORED = 1000


@dataclass(frozen=True)
class StoredResponse:
    """A response as it was answered, and the conversation it ends: everything before it but
    the instructions (which a follow-up does not inherit), its input and its output."""

    response: dict[str, Any]
    conversation: tuple[ChatMessage, ...]


class ResponseStore:
    """The last MAX_STORED responses by id (thread-safe)."""

    def __init__(self, limit: int = MAX_STORED) -> None:
        self._limit = limit
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, stored: StoredResponse) -> None:
        with self._lock:
            self._items[str(stored.response["id"])] = stored
            while len(self._items) > self._limit:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._items.pop(response_id, None) is not None
