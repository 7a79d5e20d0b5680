"""A Store kept in a dict, for tests that need many fast rounds against one shared store."""
from __future__ import annotations

import threading

from comm.store import Store


class MemoryStore(Store):
    """Bytes in a dict guarded by a lock; one instance is shared by threads standing in for workers."""

    def __init__(self):
        super().__init__()
        self.url = "memory://test"
        self._data: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self.puts: list[str] = []
        self.bytes_written = 0

    def _write(self, key: str, data: bytes) -> None:
        with self._lock:
            self._data[key] = bytes(data)
            self.puts.append(key)
            self.bytes_written += len(data)

    def _read(self, key: str) -> bytes | None:
        with self._lock:
            return self._data.get(key)

    def _exists(self, key: str) -> bool:
        with self._lock:
            return key in self._data

    def _list(self, prefix: str) -> list[str]:
        with self._lock:
            return [k for k in self._data if k.startswith(prefix)]

    def _delete_prefix(self, prefix: str) -> int:
        with self._lock:
            doomed = [k for k in self._data if k.startswith(prefix)]
            for k in doomed:
                del self._data[k]
            return len(doomed)

    def _delete(self, key: str) -> None:
        with self._lock:
            self._data.pop(key, None)


class Died(Exception):
    """Stands in for a SIGKILL of one rank's thread."""


class DyingStore(MemoryStore):
    """One rank's view of a shared MemoryStore (its keys and lock) that dies at the first put,
    get or delete `when(op, key)` accepts."""

    def __init__(self, shared: MemoryStore, when):
        super().__init__()
        self._data, self._lock, self.when = shared._data, shared._lock, when

    def put(self, key, data, **kwargs):
        if self.when("put", key):
            raise Died(key)
        super().put(key, data, **kwargs)

    def get(self, key, timeout=None):
        if self.when("get", key):
            raise Died(key)
        return super().get(key, timeout=timeout)

    def delete(self, key):
        if self.when("delete", key):
            raise Died(key)
        super().delete(key)
