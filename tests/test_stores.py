"""The stores against real servers: one suite, parametrised over directory, Redis, S3, Azure Blob."""
from __future__ import annotations

import hashlib
import pickle
import threading
import time
import uuid
from types import SimpleNamespace

import pytest
import torch

from comm.bandwidth import TokenBucket
from comm.store import Store, open_store
from comm.store_dir import DirectoryStore, default_store_url
from comm.store_redis import RedisStore
from comm.store_s3 import S3Store
from comm.tensor_codec import decode_json, decode_tensors, encode_json, encode_tensors
from core.errors import StoreError, StoreTimeout
from tests.conftest import free_port

MB = 1_000_000
# Small chunk and multipart sizes, so ~20 MB values take the chunked / multipart paths.
REDIS_CHUNK = 4 * MB
S3_MULTIPART = 8 * 1024 * 1024
AZURE_SINGLE_PUT = 8 * 1024 * 1024


@pytest.fixture(params=["dir", "redis", "s3", "azure"])
def store(request, tmp_path) -> Store:
    """A fresh, empty store of each kind."""
    if request.param == "dir":
        s = DirectoryStore(tmp_path / "store")
    elif request.param == "redis":
        server = request.getfixturevalue("redis_server")
        s = open_store(f"{server.url}?chunk_bytes={REDIS_CHUNK}")
        s.client.flushdb()
    elif request.param == "s3":
        server = request.getfixturevalue("s3_server")
        bucket = server.create_bucket(f"zooid-{uuid.uuid4().hex[:12]}")
        s = S3Store(bucket, "tenant", endpoint=server.endpoint, multipart_threshold=S3_MULTIPART)
    else:
        from comm.store_azure import AzureBlobStore

        server = request.getfixturevalue("azurite")
        container = server.create_container(f"zooid-{uuid.uuid4().hex[:12]}")
        s = AzureBlobStore(container, "tenant", connection_string=server.connection_string(),
                           single_put_bytes=AZURE_SINGLE_PUT)
    yield s
    s.close()


def pattern(n: int, seed: int) -> bytes:
    """`n` bytes that differ from those of any other seed at every 4 KB block."""
    block = hashlib.sha256(seed.to_bytes(8, "little")).digest() * 128
    return (block * (n // len(block) + 1))[:n]


# --- the interface, on every store ----------------------------------------------------

@pytest.mark.parametrize("size", [0, 1000, 20 * MB])
def test_put_get_round_trip(store, size):
    data = pattern(size, size)
    store.put("runs/r1/blob", data)
    assert store.get("runs/r1/blob") == data
    assert store.exists("runs/r1/blob")
    assert store.stats.bytes_up == size and store.stats.bytes_down == size


def test_overwrite_then_delete(store):
    store.put("runs/r1/k", b"first value, longer than the second")
    store.put("runs/r1/k", b"second")
    assert store.get("runs/r1/k") == b"second"
    store.delete("runs/r1/k")
    store.delete("runs/r1/k")  # absent: no error
    assert not store.exists("runs/r1/k")
    with pytest.raises(KeyError):
        store.get("runs/r1/k")


class FakeClock:
    """A monotonic clock the test moves: `sleep` advances it by its argument, `sleep_until`
    jumps to the deadline (never back), so paced or waiting code runs at once and exactly."""

    def __init__(self, now: float = 1000.0):
        self.now, self.sleeps, self.deadlines = now, [], []
        self.on_sleep = None  # called with the number of sleeps so far: an event inside a wait
        self.together: threading.Barrier | None = None  # set: each deadline waits for all parties
        self._lock = threading.Lock()

    def monotonic(self) -> float:
        return self.now

    perf_counter = monotonic

    def sleep(self, seconds: float) -> None:
        with self._lock:
            self.sleeps.append(seconds)
            self.now += seconds
        if self.on_sleep is not None:
            self.on_sleep(len(self.sleeps))

    def sleep_until(self, deadline: float) -> None:
        if self.together is not None:  # transfers at once: none moves the clock before all have
            self.together.wait(timeout=60)  # read it (a loaded machine may run them in turn)
        with self._lock:
            self.deadlines.append(deadline)
            self.now = max(self.now, deadline)


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    """The stores' and links' clock, under the test's control (real I/O, no real waiting)."""
    import comm.bandwidth
    import comm.store_base

    fake = FakeClock()
    monkeypatch.setattr(comm.store_base, "time", fake)
    monkeypatch.setattr(comm.bandwidth, "time", fake)
    monkeypatch.setattr(comm.bandwidth, "sleep_until", fake.sleep_until)
    return fake


def test_get_waits_for_a_later_put(store, clock):
    """The put lands while the get waits (inside its third pause): the get returns it and
    counts exactly the pauses it slept as waiting."""
    clock.on_sleep = lambda n: n == 3 and store.put("runs/r1/late", b"arrived")
    start = clock.now
    assert store.get("runs/r1/late", timeout=10) == b"arrived"
    assert len(clock.sleeps) == 3  # it missed three times, then read the value
    assert clock.now - start == pytest.approx(sum(clock.sleeps))
    assert store.stats.seconds_waiting == pytest.approx(sum(clock.sleeps))


def test_get_times_out_when_nothing_comes(store, clock):
    start = clock.now
    with pytest.raises(StoreTimeout):
        store.get("runs/r1/never", timeout=0.3)
    assert clock.now - start == pytest.approx(0.3)  # the last pause is cut to what was left
    assert max(clock.sleeps) <= store.poll_max_s
    assert store.stats.seconds_waiting == pytest.approx(0.3)


def test_a_waiting_get_polls_fast_first_then_backs_off(store, monkeypatch):
    """The sleeps between a waiting get's reads: the store's first pause, growing by half
    each time up to its longest (a neighbour's activation usually lands within a ms)."""
    import comm.store_base as store_module

    reads, pauses = [], []
    monkeypatch.setattr(type(store), "_read", lambda self, key: reads.append(key) or (b"v" if len(reads) > 9 else None))
    monkeypatch.setattr(store_module.time, "sleep", pauses.append)
    assert store.get("runs/r1/soon", timeout=10) == b"v"
    expected, pause = [], store.poll_first_s
    for _ in range(9):
        expected.append(pause)
        pause = min(pause * store_module.POLL_GROWTH, store.poll_max_s)
    assert pauses == pytest.approx(expected)
    assert max(pauses) <= store.poll_max_s
    if isinstance(store, DirectoryStore):  # a miss is one failed open(): poll a stage's neighbour fast
        assert pauses[0] < 0.001


def test_list_and_delete_prefix_are_scoped(store):
    keys = ["runs/a/x", "runs/a/sub/y", "runs/ab/z", "runs/b/x"]
    for k in keys:
        store.put(k, k.encode())
    assert store.list("runs/a/") == ["runs/a/sub/y", "runs/a/x"]
    assert store.list("runs/a") == ["runs/a/sub/y", "runs/a/x", "runs/ab/z"]
    assert store.list("runs/") == sorted(keys)
    assert store.list("runs/none/") == []
    assert store.delete_prefix("runs/a/") == 2
    assert store.list("") == ["runs/ab/z", "runs/b/x"]
    assert store.get("runs/ab/z") == b"runs/ab/z"


def test_two_runs_are_isolated(store):
    for run in ("run1", "run2"):
        for i in range(3):
            store.put(f"runs/{run}/grad/{i}", f"{run}-{i}".encode())
    assert store.delete_prefix("runs/run1/") == 3
    assert store.list("runs/run1/") == []
    assert [store.get(k) for k in store.list("runs/run2/")] == [b"run2-0", b"run2-1", b"run2-2"]


def test_bad_keys_are_refused(store):
    for key in ["/etc/passwd", "runs/../x", "runs//x", "./x", "runs/x\x00y", "", "a\\b"]:
        with pytest.raises(ValueError, match="key"):
            store.put(key, b"x")
        with pytest.raises(ValueError, match="key"):
            store.get(key)
    assert store.list("") == []


def test_delete_prefix_refuses_the_empty_prefix(store):
    store.put("runs/r1/k", b"v")
    with pytest.raises(ValueError, match="prefix"):
        store.delete_prefix("")
    assert store.exists("runs/r1/k")


def test_reader_never_sees_a_partial_value(store):
    """A reader polls while a writer overwrites with large values of distinct content."""
    size = 9 * MB  # > Redis chunk size, > S3 multipart and Azure single-put thresholds: the hard paths
    key = "runs/r1/hot"

    def value(i: int) -> bytes:
        body = pattern(size, i)
        return hashlib.sha256(body).digest() + body

    store.put(key, value(0))
    done = threading.Event()
    seen, bad = set(), []

    def read():
        while not done.is_set():
            data = store.get(key, timeout=5)
            digest, body = data[:32], data[32:]
            if hashlib.sha256(body).digest() != digest:
                bad.append(len(data))
            seen.add(digest)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(1, 7):
            store.put(key, value(i))
    finally:
        done.set()
        reader.join()
    assert bad == []
    assert len(seen) >= 2  # the reader did overlap with the overwrites


# --- store-specific behaviour -----------------------------------------------------------

@pytest.mark.timeout(120)
def test_redis_survives_a_server_restart(redis_server, monkeypatch):
    """A put while the server is down fails, waits and retries, and lands once the server
    is back: the server is started again only after the store has retried (an event)."""
    import comm.store_redis

    store = open_store(redis_server.url)
    store.put("runs/r1/before", b"x")
    retrying, real_sleep = threading.Event(), time.sleep

    def pause(seconds: float) -> None:  # the store's pause after a failed try
        retrying.set()
        real_sleep(seconds)

    monkeypatch.setattr(comm.store_redis, "time", SimpleNamespace(monotonic=time.monotonic, sleep=pause))
    redis_server.stop()
    restart = threading.Thread(target=lambda: retrying.wait(60) and redis_server.start())
    restart.start()
    try:
        store.put("runs/r1/after", b"written across the restart")
        assert retrying.is_set()  # the put did meet the server down
        assert store.get("runs/r1/after", timeout=5) == b"written across the restart"
        assert not store.exists("runs/r1/before")  # a restart without persistence: it really went down
    finally:
        retrying.set()
        restart.join()
        if redis_server.proc is None:
            redis_server.start()
    store.ping()
    store.close()


def test_redis_chunks_large_values_and_cleans_them_up(redis_server):
    store = open_store(f"{redis_server.url}?chunk_bytes=1000")
    store.client.flushdb()
    store.put("runs/r1/big", pattern(3500, 1))
    assert store.client.dbsize() == 1 + 4  # manifest + 4 chunks
    store.put("runs/r1/big", b"small")  # replacing a chunked value drops its chunks
    assert store.client.dbsize() == 1
    assert store.get("runs/r1/big") == b"small"
    # A small value that looks like a manifest is stored chunked, so it reads back as itself.
    from comm.store_redis import MAGIC
    store.put("runs/r1/tricky", MAGIC + b"{}")
    assert store.get("runs/r1/tricky") == MAGIC + b"{}"
    assert store.list("runs/") == ["runs/r1/big", "runs/r1/tricky"]
    assert store.delete_prefix("runs/r1/") == 2
    assert store.client.dbsize() == 0
    store.close()


def test_open_store_reads_urls(tmp_path, redis_server, s3_server, monkeypatch):
    d = open_store(tmp_path.as_uri())
    assert isinstance(d, DirectoryStore) and d.root == tmp_path
    assert isinstance(open_store(str(tmp_path / "plain")), DirectoryStore)
    r = open_store(redis_server.url)
    assert isinstance(r, RedisStore)
    r.ping()
    bucket = s3_server.create_bucket("zooid-open")
    s = open_store(f"s3://{bucket}/pre/fix?endpoint={s3_server.endpoint}")
    assert isinstance(s, S3Store) and s.prefix == "pre/fix/"
    s.ping()
    s.put("runs/r/k", b"v")
    assert s3_server.client().get_object(Bucket=bucket, Key="pre/fix/runs/r/k")["Body"].read() == b"v"
    direct = S3Store(bucket, "pre/fix", endpoint=s3_server.endpoint)
    assert open_store(direct.url).get("runs/r/k") == b"v"  # `url` reopens the same store
    monkeypatch.setenv("ZOOID_S3_ENDPOINT", s3_server.endpoint)
    assert open_store(f"s3://{bucket}/pre/fix").get("runs/r/k") == b"v"
    with pytest.raises(ValueError, match="store"):
        open_store("ftp://host/x")
    monkeypatch.setenv("ZOOID_HOME", str(tmp_path / "home"))
    assert default_store_url() == (tmp_path / "home" / "store").as_uri()


@pytest.mark.timeout(60)
def test_unreachable_stores_fail_ping_with_one_short_attempt(tmp_path, s3_server):
    """`ping` makes one attempt with a short connect timeout (redis: 1 s, no retry; S3: 1 s
    connect and read, one attempt), so an unreachable store fails the check fast."""
    closed = free_port()
    candidates = [open_store("redis://127.0.0.1:1"),
                  open_store(f"redis://127.0.0.1:{closed}/0"),
                  open_store(f"s3://bucket?endpoint=http://127.0.0.1:{closed}"),
                  open_store(f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}?endpoint={s3_server.endpoint}")]
    for store in candidates:
        with pytest.raises(StoreError):
            store.ping()
        if isinstance(store, RedisStore):
            kwargs = store.client.connection_pool.connection_kwargs
            assert kwargs["socket_connect_timeout"] <= 1.0 and kwargs["retry"].get_retries() == 0, store
        else:
            config, sent = store._ping_client.meta.config, []
            assert (config.connect_timeout, config.read_timeout) == (1, 1), store
            assert config.retries["total_max_attempts"] == 1, store
            store._ping_client.meta.events.register("before-send.s3.HeadBucket", lambda **kw: sent.append(1))
            with pytest.raises(StoreError):
                store.ping()
            assert sent == [1], store  # one request, no retry
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(StoreError):
        DirectoryStore(tmp_path / "file" / "store")


# --- bandwidth emulation ----------------------------------------------------------------

def test_emulated_bandwidth_paces_each_direction(tmp_path, clock):
    """On the test's clock: each direction takes exactly its bytes (less the bucket's small
    burst) over its rate, and an upload and a download at once take as long as one."""
    rate = 20 * MB
    store = open_store(str(tmp_path), upload_bytes_per_s=rate, download_bytes_per_s=rate)
    burst, data = store.link.up.burst, bytes(4 * MB)
    assert 0 < burst < 0.02 * len(data)
    start = clock.now
    store.put("runs/r/a", data)
    up = clock.now - start
    start = clock.now
    store.get("runs/r/a")
    down = clock.now - start
    assert up == pytest.approx((4 * MB - burst) / rate) and down == pytest.approx((4 * MB - burst) / rate)
    assert store.stats.bytes_up == store.stats.bytes_down == 4 * MB
    assert store.stats.upload_s == pytest.approx(up) and store.stats.download_s == pytest.approx(down)

    # Upload and download at once take as long as one: the directions are independent
    # (one shared link would take both transfers' time, 0.4 s).
    store.put("runs/r/b", data)
    start, clock.together = clock.now, threading.Barrier(2)
    threads = [threading.Thread(target=store.put, args=("runs/r/c", data)),
               threading.Thread(target=store.get, args=("runs/r/b",))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert clock.now - start == pytest.approx(4 * MB / rate)


def test_token_bucket_is_shared_by_concurrent_transfers(clock):
    bucket = TokenBucket(10 * MB, burst=0)
    start = clock.now
    threads = [threading.Thread(target=bucket.consume, args=(MB,)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Three transfers queue behind each other on the one bucket: they end 0.1, 0.2, 0.3 s on.
    assert sorted(d - start for d in clock.deadlines) == pytest.approx([0.1, 0.2, 0.3])
    assert clock.now - start == pytest.approx(0.3)
    with pytest.raises(ValueError, match="bytes_per_s"):
        TokenBucket(0)


def test_unlimited_store_is_not_paced(tmp_path, clock):
    store = open_store(str(tmp_path))
    assert store.link.up is None and store.link.down is None
    start = clock.now
    store.put("runs/r/a", bytes(4 * MB))
    store.get("runs/r/a")
    assert clock.now == start and all(d <= start for d in clock.deadlines)  # no wait at all
    assert store.stats.upload_s == 0 and store.stats.download_s == 0


# --- tensor codec -------------------------------------------------------------------------

def test_tensor_codec_round_trips_dtypes_exactly():
    special = torch.tensor([0.1, -0.0, float("inf"), float("nan"), 5e-324, 1.7976931348623157e308],
                           dtype=torch.float64)
    tensors = {
        "f64": special, "f32": torch.randn(3, 5), "t": torch.randn(4, 3).t(),
        "bf16": torch.randn(7).to(torch.bfloat16), "i64": torch.arange(-3, 3),
        "bool": torch.tensor([True, False]), "scalar": torch.tensor(2.5), "empty": torch.empty(0, 4),
    }
    tensors["tied"] = tensors["f32"]
    data = encode_tensors(tensors, {"epoch": "3"})
    out, meta = decode_tensors(data)
    assert meta == {"epoch": "3"}
    assert set(out) == set(tensors)
    for name, t in tensors.items():
        assert out[name].dtype == t.dtype and out[name].shape == t.shape, name
        # Bit-exact: compare the raw bytes, so NaN payloads and -0.0 count too.
        assert out[name].reshape(-1).view(torch.uint8).tolist() == \
            t.reshape(-1).view(torch.uint8).tolist(), name


def test_tensor_codec_through_a_store(dir_store):
    weights = {"w": torch.randn(100, 10, dtype=torch.float64)}
    dir_store.put("runs/r/model", encode_tensors(weights))
    out, meta = decode_tensors(dir_store.get("runs/r/model"))
    assert meta == {} and torch.equal(out["w"], weights["w"])


@pytest.mark.parametrize("blob", [
    b"", b"short", pickle.dumps(torch.ones(3)), pickle.dumps({"w": [1.0]}),
    encode_json({"a": 1}), (1000).to_bytes(8, "little") + b"{}",
    (2).to_bytes(8, "little") + b"[]",
])
def test_tensor_codec_refuses_other_bytes(blob):
    with pytest.raises(ValueError, match="data"):
        decode_tensors(blob)


def test_json_codec_round_trip():
    obj = {"b": [1, 2.5, None, "x"], "a": {"nested": True}}
    assert decode_json(encode_json(obj)) == obj
    assert encode_json({"b": 1, "a": 2}) == b'{"a":2,"b":1}'
    with pytest.raises(ValueError, match="obj"):
        encode_json({"t": torch.ones(1)})


def test_directory_store_reports_a_key_that_is_also_a_prefix(dir_store):
    dir_store.put("runs/r/a/b", b"x")
    with pytest.raises(StoreError, match="collides"):
        dir_store.put("runs/r/a", b"y")
    assert dir_store.list("runs/r/") == ["runs/r/a/b"]  # the failed put left no temp file
    assert dir_store.list("") == ["runs/r/a/b"] and not list((dir_store.root / ".zooid-tmp").iterdir())


def test_a_scratch_put_is_as_atomic_but_skips_the_fsync_of_the_directory_store(dir_store, monkeypatch):
    import os as os_module

    synced = []
    real_fsync = os_module.fsync
    monkeypatch.setattr("comm.store_dir.os.fsync", lambda fd: synced.append(fd) or real_fsync(fd))
    dir_store.put("runs/r1/ckpt", b"durable")
    assert len(synced) == 1
    dir_store.put("runs/r1/act/it0/f0m0", b"scratch", scratch=True)
    assert len(synced) == 1  # an activation read and deleted by a live peer is not fsynced
    assert dir_store.get("runs/r1/act/it0/f0m0") == b"scratch" and dir_store.get("runs/r1/ckpt") == b"durable"
    assert not any(dir_store._tmp.iterdir())  # renamed into place, nothing half-written left


def test_scratch_puts_reach_every_store(store):
    store.put("runs/r1/sync/e0/r0/part-0-1", b"part", scratch=True)
    assert store.get("runs/r1/sync/e0/r0/part-0-1") == b"part"
    assert store.stats.bytes_up == 4
