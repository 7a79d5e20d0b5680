"""The Redis store: redis-py with a connection pool, pipelined multi-key operations.

Large values. Redis refuses a bulk string over `proto-max-bulk-len` (512 MB by default),
and one huge SET holds a server thread and a second copy of the value in the client. A
value over `chunk_bytes` (128 MiB by default) is therefore written as chunks under
versioned side keys, then a small manifest under the key itself, last:

    <key>                      MAGIC + JSON {"version", "size", "chunks"}
    <key>\\0<version>/<i>       chunk i of that version

The manifest swap is the atomic step. A reader reads the manifest, then all chunks of
that version in one MGET (a single command, so atomic); if a concurrent overwrite has
already removed some of them it reads the manifest again. Versions are unique, so a
reader can never assemble chunks of two different values. Keys never contain NUL
(`check_key` refuses control characters), so side keys cannot collide with keys, and
they sort and match right after their key, so `delete_prefix` removes them too.

Restarts. Every operation is retried with exponential backoff on connection errors for up
to `retry_seconds`, so a client survives a redis-server restart; `ping` does not retry,
so an unreachable store is reported within about a second.
"""
from __future__ import annotations

import json
import time
import uuid
from urllib.parse import parse_qs, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from comm.store_base import Store
from core.errors import StoreError, ZooidValueError

MAGIC = b"\x00zooid-chunked-v1\n"
MANIFEST_MAX = 4096  # bytes of a manifest, read back in the swap transaction
SIDE = "\x00"  # separates a key from its chunk keys
DEFAULT_CHUNK_BYTES = 128 * 1024 * 1024
SCAN_BATCH = 1000


def _glob_escape(prefix: str) -> str:
    """Escape Redis glob metacharacters so SCAN MATCH treats `prefix` literally."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in prefix)


class RedisStore(Store):
    """Bytes in Redis; values over `chunk_bytes` are chunked behind a manifest."""

    poll_max_s = 0.005  # a GET on loopback is ~50 us; a peer waiting on a key hears of it within 5 ms
    keeps_keys = False  # a restart without persistence empties it

    def __init__(self, url: str, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 retry_seconds: float = 20.0, connect_timeout: float = 1.0,
                 socket_timeout: float = 120.0, **rates):
        super().__init__(**rates)
        if not (isinstance(chunk_bytes, int) and chunk_bytes > 0):
            raise ZooidValueError("chunk_bytes", f"must be a positive int, got {chunk_bytes!r}")
        self.url = url
        self.chunk_bytes = chunk_bytes
        self.retry_seconds = float(retry_seconds)
        try:
            # redis-py's own retries are off: `_call` retries with a deadline instead,
            # and `ping` must not retry at all.
            self.client = redis.Redis.from_url(
                url, socket_connect_timeout=connect_timeout, socket_timeout=socket_timeout,
                retry=Retry(NoBackoff(), 0), health_check_interval=30)
        except ValueError as e:
            raise ZooidValueError("store", f"bad Redis URL {url!r}: {e}") from None

    @classmethod
    def from_url(cls, url: str, **rates) -> "RedisStore":
        """Open `redis://host:port/db`; `?chunk_bytes=N` overrides the chunk size."""
        query = parse_qs(urlsplit(url).query)
        extra = {}
        if "chunk_bytes" in query:
            try:
                extra["chunk_bytes"] = int(query["chunk_bytes"][-1])
            except ValueError:
                raise ZooidValueError("store", f"chunk_bytes must be an int in {url!r}") from None
            # redis-py rejects query arguments it does not know.
            store = cls(url.split("?", 1)[0] + _other_query(url, "chunk_bytes"), **extra, **rates)
            store.url = url  # keep the chunk size when a worker reopens the URL
            return store
        return cls(url, **rates)

    # --- retries -------------------------------------------------------------------

    def _call(self, what: str, fn):
        """Run `fn(client)`, retrying connection errors with backoff up to `retry_seconds`."""
        deadline = time.monotonic() + self.retry_seconds
        pause = 0.05
        while True:
            try:
                return fn(self.client)
            except (redis.ConnectionError, redis.TimeoutError) as e:
                if time.monotonic() + pause > deadline:
                    raise StoreError(f"Redis at {self.url} unreachable during {what}: {e}") from e
                time.sleep(pause)
                pause = min(pause * 2, 1.0)
            except redis.RedisError as e:
                raise StoreError(f"Redis at {self.url} failed {what}: {e}") from e

    # --- raw operations ------------------------------------------------------------

    def _write(self, key: str, data: bytes) -> None:
        if len(data) <= self.chunk_bytes and not data.startswith(MAGIC):
            old = self._call("put", lambda c: self._swap(c, key, data))
        else:
            version = uuid.uuid4().hex
            count = max(1, -(-len(data) // self.chunk_bytes))
            view = memoryview(data)

            def write_chunks(c):
                pipe = c.pipeline(transaction=False)
                for i in range(count):
                    pipe.set(f"{key}{SIDE}{version}/{i}",
                             view[i * self.chunk_bytes:(i + 1) * self.chunk_bytes])
                    if (i + 1) % 4 == 0:  # bound what one pipeline buffers
                        pipe.execute()
                pipe.execute()

            self._call("put", write_chunks)
            manifest = MAGIC + json.dumps(
                {"version": version, "size": len(data), "chunks": count}).encode()
            old = self._call("put", lambda c: self._swap(c, key, manifest))
        self._drop_chunks(key, old)

    @staticmethod
    def _swap(c, key: str, value: bytes) -> bytes:
        """Set `key` and return the head of its previous value, in one transaction."""
        pipe = c.pipeline(transaction=True)
        pipe.getrange(key, 0, MANIFEST_MAX - 1)
        pipe.set(key, value)
        return pipe.execute()[0]

    def _drop_chunks(self, key: str, old_head: bytes | None) -> None:
        """Delete the chunks a replaced or deleted manifest pointed at."""
        if not old_head or not old_head.startswith(MAGIC):
            return
        manifest = json.loads(old_head[len(MAGIC):])
        names = [f"{key}{SIDE}{manifest['version']}/{i}" for i in range(manifest["chunks"])]
        self._call("put", lambda c: c.unlink(*names))

    def _read(self, key: str) -> bytes | None:
        for _attempt in range(8):
            head = self._call("get", lambda c: c.get(key))
            if head is None or not head.startswith(MAGIC):
                return head
            manifest = json.loads(head[len(MAGIC):])
            names = [f"{key}{SIDE}{manifest['version']}/{i}" for i in range(manifest["chunks"])]
            chunks = self._call("get", lambda c: c.mget(names))
            if all(ch is not None for ch in chunks):
                data = b"".join(chunks)
                if len(data) != manifest["size"]:
                    raise StoreError(f"key {key!r} in {self.url}: chunks add up to {len(data)} "
                                     f"bytes, manifest says {manifest['size']}")
                return data
            # Overwritten or deleted between the two reads: look at the manifest again.
        return None

    def _exists(self, key: str) -> bool:
        return bool(self._call("exists", lambda c: c.exists(key)))

    def _scan(self, prefix: str):
        """Yield batches of raw key names (user keys and side keys) under `prefix`."""
        cursor = 0
        match = _glob_escape(prefix) + "*"
        while True:
            cursor, batch = self._call(
                "scan", lambda c: c.scan(cursor=cursor, match=match, count=SCAN_BATCH))
            if batch:
                yield batch
            if cursor == 0:
                return

    def _list(self, prefix: str) -> list[str]:
        keys = set()  # SCAN may return a key twice
        for batch in self._scan(prefix):
            for name in batch:
                name = name.decode("utf-8")
                if SIDE not in name:
                    keys.add(name)
        return list(keys)

    def _delete_prefix(self, prefix: str) -> int:
        count = 0
        for batch in self._scan(prefix):
            def unlink(c):
                pipe = c.pipeline(transaction=False)
                for name in batch:
                    pipe.unlink(name)
                return pipe.execute()
            for name, gone in zip(batch, self._call("delete_prefix", unlink)):
                if gone and SIDE.encode() not in name:
                    count += 1
        return count

    def _delete(self, key: str) -> None:
        def getdel_head(c):
            pipe = c.pipeline(transaction=True)
            pipe.getrange(key, 0, MANIFEST_MAX - 1)
            pipe.unlink(key)
            return pipe.execute()[0]
        self._drop_chunks(key, self._call("delete", getdel_head))

    def ping(self) -> None:
        """Raise StoreError within about a second when Redis cannot be reached."""
        try:
            self.client.ping()
        except redis.RedisError as e:
            raise StoreError(f"Redis at {self.url} unreachable: {e}") from e

    def close(self) -> None:
        """Close the pool's connections."""
        self.client.close()
        self.client.connection_pool.disconnect()


def _other_query(url: str, drop: str) -> str:
    """The query of `url` without parameter `drop`, as `?a=b&...` or ''."""
    parts = urlsplit(url)
    kept = [p for p in parts.query.split("&") if p and p.split("=", 1)[0] != drop]
    return "?" + "&".join(kept) if kept else ""
