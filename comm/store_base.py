"""The store interface: bytes under keys, all of them below `runs/<run_id>/`.

A reader never sees half an object: every `put` is atomic. Values are raw bytes; tensors
are encoded by `comm.tensor_codec` (safetensors), never pickled.

`Store` does what all implementations share: key validation, the wait-with-backoff of `get`,
bandwidth emulation and transfer accounting (`store.stats`), and the count of its requests
(`store.ops`, a `core.store_ops.StoreOps`: puts, gets, misses (each poll of a waiting get), heads,
list pages, deletes, and the bytes each way; every client also adds to `process_ops()`, this
process's total). An implementation supplies the raw operations (`_write`, `_read`, `_exists`,
`_list`, `_delete_prefix`, `_delete`) and, where one operation takes more than one request,
how many (`_put_requests`, `_get_requests`, `_list_requests`, `_delete_requests`): the
arithmetic of its own protocol, which the bill's prediction uses too.
The implementations (`store_dir`, `store_redis`, `store_s3`) import this module, and
`comm.store.open_store` picks one of them from a URL.
"""
from __future__ import annotations

import abc
import threading
import time
from urllib.parse import urlsplit

from comm import heartbeat
from comm.bandwidth import Link, TransferStats
from core.errors import StoreTimeout, ZooidValueError
from core.polling import POLL_GROWTH
from core.store_ops import StoreOps


class StoreKeyError(ZooidValueError):
    """A key that no store accepts (absolute, `..`, empty segment, control characters)."""


def check_key(key: str, *, field: str = "key", prefix: bool = False) -> str:
    """Return `key` if it is a valid relative key (or key prefix), else raise StoreKeyError.

    Keys are `/`-separated relative paths: no leading `/`, no `.` or `..` segments, no
    empty segments, no backslashes or control characters. A prefix may be empty and
    may end in `/` or in the middle of a segment.
    """
    if not isinstance(key, str):
        raise StoreKeyError(field, f"must be a string, got {type(key).__name__}")
    if not key:
        if prefix:
            return key
        raise StoreKeyError(field, "must not be empty")
    if key.startswith("/"):
        raise StoreKeyError(field, f"must be relative (no leading '/'), got {key!r}")
    if "\\" in key or any(ord(c) < 32 or ord(c) == 127 for c in key):
        raise StoreKeyError(field, f"must not contain backslashes or control characters: {key!r}")
    parts = key.split("/")
    if prefix and parts[-1] == "":
        parts = parts[:-1]
    for part in parts:
        if part in ("", ".", ".."):
            raise StoreKeyError(field, f"must not contain empty, '.' or '..' segments: {key!r}")
    return key


class OpCounter:
    """A thread-safe running `StoreOps` (a store client's, or the process's)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(StoreOps().to_dict(), 0)

    def add(self, kind: str, requests: int = 1, bytes_in: int = 0, bytes_out: int = 0) -> None:
        """Count `requests` of `kind` and the bytes they moved."""
        with self._lock:
            self._counts[kind] += requests
            self._counts["bytes_in"] += bytes_in
            self._counts["bytes_out"] += bytes_out

    def snapshot(self) -> StoreOps:
        """The counts so far."""
        with self._lock:
            return StoreOps(**self._counts)


_PROCESS_OPS: dict[str, OpCounter] = {}
_PROCESS_LOCK = threading.Lock()


def _process_counter(where: str) -> OpCounter:
    with _PROCESS_LOCK:
        return _PROCESS_OPS.setdefault(where, OpCounter())


def process_ops() -> dict[str, StoreOps]:
    """Every request any store client of this process made so far, by store (`Store.where`);
    the coordinator's share of a run is the difference between two readings."""
    with _PROCESS_LOCK:
        counters = dict(_PROCESS_OPS)
    return {where: c.snapshot() for where, c in counters.items()}


def store_where(url: str) -> str:
    """Which store a URL names, as a bill tells stores apart, without path or credentials:
    `s3://bucket`, `az://container`, `redis://host:port`, `file://` (any directory)."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme in ("", "file") or len(scheme) == 1:
        return "file://"
    try:
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        port = ""
    return f"{scheme}://{parts.hostname or ''}{port}"


class Store(abc.ABC):
    """Bytes under string keys with atomic puts and a blocking get."""

    url: str
    """A URL that `open_store` turns back into an equivalent store (workers reopen it)."""
    poll_first_s: float = 0.002
    """First sleep of a waiting `get`; each next one is `POLL_GROWTH` times longer."""
    poll_max_s: float = 0.05
    """Longest sleep between two checks while `get` waits for a key."""
    keeps_keys: bool = True
    """Whether a key once put stays until deleted (False: a restart may empty the store, as
    Redis without persistence does; who relies on a key there puts it again, `runtime.warm`)."""

    def __init__(self, *, upload_bytes_per_s: float | None = None,
                 download_bytes_per_s: float | None = None):
        self.link = Link(upload_bytes_per_s, download_bytes_per_s)
        self._ops = OpCounter()
        self._process_ops: OpCounter | None = None

    @property
    def stats(self) -> TransferStats:
        """Bytes and seconds moved so far in each direction by this client."""
        return self.link.stats

    @property
    def ops(self) -> StoreOps:
        """The requests this client made so far, by kind, and the bytes they moved."""
        return self._ops.snapshot()

    def _count(self, kind: str, requests: int, bytes_in: int = 0, bytes_out: int = 0) -> None:
        """Count requests in this client and in the process's total."""
        if requests or bytes_in or bytes_out:
            self._ops.add(kind, requests, bytes_in, bytes_out)
            if self._process_ops is None:  # `url` is set by the implementation's __init__
                self._process_ops = _process_counter(self.where)
            self._process_ops.add(kind, requests, bytes_in, bytes_out)

    @property
    def where(self) -> str:
        """Which store this is, as a bill tells stores apart (`store_where` of its URL)."""
        return store_where(self.url)

    # --- the interface -------------------------------------------------------------

    def put(self, key: str, data: bytes, *, scratch: bool = False) -> None:
        """Store `data` under `key` atomically (readers see all of it or nothing).

        `scratch`: the key is read by a live peer and deleted (an activation, a sync round's
        part, a barrier mark), so a store may skip what only guards it against a crash of
        the machine, which would lose the epoch anyway (the directory store's fsync)."""
        check_key(key)
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ZooidValueError("data", f"must be bytes, got {type(data).__name__}")
        data = bytes(data) if not isinstance(data, bytes) else data
        write = self._write_scratch if scratch else self._write
        try:
            self.link.upload(len(data), lambda: write(key, data))
        finally:  # a failed request was sent all the same
            self._count("put", self._put_requests(len(data)), bytes_in=len(data))

    def get(self, key: str, timeout: float | None = None) -> bytes:
        """Return the bytes under `key`; wait up to `timeout` seconds for it to appear
        (None: do not wait). Raises `StoreTimeout` (or KeyError when not waiting)."""
        check_key(key)
        if timeout is not None and not timeout >= 0:
            raise ZooidValueError("timeout", f"must be >= 0 seconds or None, got {timeout!r}")
        began = time.monotonic()
        pause = self.poll_first_s
        while True:
            start = time.monotonic()
            try:
                data = self._read(key)
            except Exception:
                self._count("miss", 1)
                raise
            if data is None:
                self._count("miss", 1)
            else:
                self._count("get", self._get_requests(len(data)), bytes_out=len(data))
            if data is not None:
                self.link.waited(start - began)
                self.link.download(start, len(data))
                return data
            if timeout is None:
                raise KeyError(key)
            left = began + timeout - time.monotonic()
            if left <= 0:
                self.link.waited(time.monotonic() - began)
                raise StoreTimeout(f"key {key!r} did not appear in {self.url} within {timeout:g} s")
            heartbeat.beat(waiting=True)  # waiting on a peer is not hanging
            time.sleep(min(pause, left))
            pause = min(pause * POLL_GROWTH, self.poll_max_s)

    def exists(self, key: str) -> bool:
        """Whether `key` is present."""
        check_key(key)
        try:
            return self._exists(key)
        finally:
            self._count("head", 1)

    def size(self, key: str) -> int:
        """The bytes under `key`, without reading them (KeyError when absent)."""
        check_key(key)
        try:
            n = self._size(key)
        finally:
            self._count("head", 1)
        if n is None:
            raise KeyError(key)
        return n

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """`length` bytes of the value under `key` from byte `start` (fewer where the value
        ends first), without reading the rest: a reader of a large file takes only its part.
        KeyError when absent; never waits."""
        check_key(key)
        if not (isinstance(start, int) and isinstance(length, int)) or start < 0 or length < 0:
            raise ZooidValueError("range", f"start and length must be integers >= 0, got {start!r}, {length!r}")
        began = time.monotonic()
        try:
            data = self._read_range(key, start, length) if length else (b"" if self._exists(key) else None)
        except Exception:
            self._count("miss" if length else "head", 1)
            raise
        self._count("head" if not length else "get" if data is not None else "miss", 1)
        if data is None:
            raise KeyError(key)
        self.link.download(began, len(data))
        self._count("get", 0, bytes_out=len(data))
        return data

    def list(self, prefix: str) -> list[str]:
        """Every key that starts with `prefix`, sorted."""
        keys = self._list(check_key(prefix, field="prefix", prefix=True))
        self._count("list", self._list_requests(len(keys)))
        return sorted(keys)

    def delete_prefix(self, prefix: str) -> int:
        """Delete every key under `prefix`; return how many were deleted.

        An empty prefix is refused: wiping a whole store is never what a run means.
        """
        if not prefix:
            raise StoreKeyError("prefix", "must not be empty (refusing to delete every key)")
        count = self._delete_prefix(check_key(prefix, field="prefix", prefix=True))
        self._count("list", self._list_requests(count))
        self._count("delete", self._delete_requests(count))
        return count

    def delete(self, key: str) -> None:
        """Delete one key (no error when absent)."""
        check_key(key)
        try:
            self._delete(key)
        finally:
            self._count("delete", 1)

    def ping(self) -> None:
        """Raise `StoreError` when the store cannot be reached (checked before a run)."""

    def close(self) -> None:
        """Release connections."""

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    # --- what an implementation supplies -------------------------------------------

    @abc.abstractmethod
    def _write(self, key: str, data: bytes) -> None:
        """Atomically replace the value under a validated key."""

    def _write_scratch(self, key: str, data: bytes) -> None:
        """`_write` for a scratch key (see `put`); the same unless a store can do less."""
        self._write(key, data)

    @abc.abstractmethod
    def _read(self, key: str) -> bytes | None:
        """The whole value under a validated key, or None when absent (never partial)."""

    @abc.abstractmethod
    def _exists(self, key: str) -> bool:
        """Whether a validated key is present."""

    def _size(self, key: str) -> int | None:
        """The length of the value under a validated key, or None when absent (by reading it,
        unless a store can ask)."""
        data = self._read(key)
        return None if data is None else len(data)

    def _read_range(self, key: str, start: int, length: int) -> bytes | None:
        """Bytes [start, start + length) of the value under a validated key (fewer at its end),
        or None when absent (by reading all of it, unless a store can read a range)."""
        data = self._read(key)
        return None if data is None else data[start : start + length]

    @abc.abstractmethod
    def _list(self, prefix: str) -> list[str]:
        """Keys starting with a validated prefix, any order."""

    @abc.abstractmethod
    def _delete_prefix(self, prefix: str) -> int:
        """Delete keys under a validated, non-empty prefix; return the count."""

    @abc.abstractmethod
    def _delete(self, key: str) -> None:
        """Delete a validated key if present."""

    # --- how many requests an operation takes (one, unless a store says otherwise) ----

    def _put_requests(self, nbytes: int) -> int:
        """Requests one put of `nbytes` bytes takes (several for a multipart upload)."""
        return 1

    def _get_requests(self, nbytes: int) -> int:
        """Requests one found read of `nbytes` bytes takes (a miss takes one)."""
        return 1

    def _list_requests(self, keys: int) -> int:
        """Requests one listing of `keys` keys takes (one per page)."""
        return 1

    def _delete_requests(self, keys: int) -> int:
        """Delete requests `delete_prefix` makes for `keys` keys after listing them (one per
        key, unless the store deletes in batches)."""
        return keys
