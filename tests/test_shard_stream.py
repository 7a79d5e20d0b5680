"""Reading a replica's batches shard by shard with read-ahead (`engine.shard_stream.ShardStream`),
on a directory, S3 (the moto server) and Azure Blob (Azurite): the rows equal indexing the whole
dataset; each shard is fetched once per stream, in the order the batches first need it, ahead
of the consumer by at most the read-ahead bound; what is held at once stays within the current
window plus the read-ahead; a corrupt or missing shard fails naming it at the batch that needs
it; a stalled store shows as the consumer's waiting (a fake clock), and close() stops the reader."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import engine.datasets as datasets
import engine.shard_stream as shard_stream
import engine.shards as shards
from comm.store import Store
from comm.store_dir import DirectoryStore
from core.errors import ZooidValueError
from core.keys import shard_key
from engine.datasets import (
    ShardSource,
    keep_subsets,
    load_dataset,
    prepare_dataset,
    read_shards,
)
from engine.epoch_order import epoch_order
from engine.shard_stream import READAHEAD_SHARDS, READY_BATCHES, ShardStream, split_rows
from engine.shards import ShardError
from engine.text_data import TextSettings
from tests.bucket_stores import KINDS, empty_store

SOURCE = "synthetic:8:3:200:40"
ROWS = 32  # 7 training shards (the last of 8 rows), 2 validation shards
ROW_BYTES = 8 * 4 + 8  # a decoded row: 8 float32 inputs, an int64 label
WAIT = 60.0  # the longest a test waits for an event before failing (never a measured interval)


@pytest.fixture(autouse=True)
def no_cache_no_pause(monkeypatch):
    """No process cache unless a test keeps one, and re-reads without their pause."""
    monkeypatch.setattr(datasets, "_CACHE", None)
    monkeypatch.setattr(shards, "RETRY_PAUSE_S", 0.0)


@pytest.fixture(params=KINDS)
def bucket(request, tmp_path) -> Store:
    """The dataset prepared under `data` in a store of each kind."""
    s = empty_store(request.param, request, tmp_path)
    prepare_dataset(s, "data", SOURCE, subset_size=ROWS)
    yield s
    s.close()


@pytest.fixture
def prepared(tmp_path) -> Store:
    store = DirectoryStore(tmp_path / "bucket")
    prepare_dataset(store, "data", SOURCE, subset_size=ROWS)
    yield store
    store.close()


class Recording:
    """A store that records the shard keys it is asked for, in order, sets an event per key when
    it is asked, and may hold a key's get until its gate is opened."""

    def __init__(self, store: Store):
        self.store, self.url = store, store.url
        self.gets: list[str] = []
        self.asked: dict[str, threading.Event] = {}
        self.gates: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    def event(self, key: str) -> threading.Event:
        with self._lock:
            return self.asked.setdefault(key, threading.Event())

    def get(self, key, timeout=None):
        if "/train/" in key or "/val/" in key:
            with self._lock:
                self.gets.append(key)
            self.event(key).set()
            if key in self.gates:
                assert self.gates[key].wait(WAIT)
        return self.store.get(key, timeout=timeout)

    def exists(self, key):
        return self.store.exists(key)


def random_batches(n: int, b: int, seed: int = 0) -> list[np.ndarray]:
    order = np.random.default_rng(seed).permutation(n)
    return [order[i:i + b] for i in range(0, n, b)]


def shard_batches() -> list[np.ndarray]:
    """One batch per training shard, in shard order."""
    return [np.arange(s, min(s + ROWS, 200)) for s in range(0, 200, ROWS)]


def first_need_order(batches: list[np.ndarray]) -> list[int]:
    seen: list[int] = []
    for ids in batches:
        for s in ids // ROWS:
            if int(s) not in seen:
                seen.append(int(s))
    return seen


def keys(order) -> list[str]:
    return [shard_key("data", "train", s) for s in order]


def test_rows_equal_indexing_the_whole_dataset_on_every_store(bucket):
    data = load_dataset(SOURCE)
    source = ShardSource(bucket, "data")
    batches = random_batches(200, 24)
    with ShardStream(source, batches, seed=3, epoch=1) as stream:
        got = list(stream)
    assert len(got) == len(batches) == len(stream)
    for ids, (x, y) in zip(batches, got):
        assert torch.equal(x, data.train_x[ids]) and torch.equal(y, data.train_y[ids])
    assert stream.bytes_read == sum(s.bytes for s in source.manifest.shards["train"])
    val_ids = np.arange(40)[::-1].copy()
    with ShardStream(source, [val_ids], "val") as stream:
        (vx, vy), = list(stream)
    assert torch.equal(vx, data.val_x[val_ids]) and torch.equal(vy, data.val_y[val_ids])


def test_each_shard_is_fetched_once_in_the_order_the_batches_first_need_it(prepared, monkeypatch):
    monkeypatch.setattr(shard_stream, "FETCHES_IN_FLIGHT", 1)  # two may reach the store in either order
    store = Recording(prepared)
    batches = random_batches(200, 5, seed=1)[:12] + [np.arange(200)]  # scattered, then every shard again
    with ShardStream(ShardSource(store, "data"), batches, readahead_mb=0) as stream:
        n = sum(1 for _ in stream)
    assert n == len(batches)
    assert store.gets == keys(stream.order) == keys(first_need_order(batches))
    assert sorted(stream.order) == list(range(7))


@pytest.mark.parametrize("readahead_mb, ahead", [(0, 1), (2 * ROWS * ROW_BYTES / 2**20, 2), (None, READAHEAD_SHARDS)])
def test_the_reader_runs_ahead_of_the_consumer_up_to_its_bound(prepared, readahead_mb, ahead):
    store = Recording(prepared)
    stream = ShardStream(ShardSource(store, "data"), shard_batches(), readahead_mb=readahead_mb)
    with stream:
        it = iter(stream)
        next(it)  # the consumer holds batch 0 (shard 0) and asks for nothing more
        assert store.event(keys([ahead])[0]).wait(WAIT)
        assert sorted(store.gets) == keys(range(ahead + 1))  # the bound stops it there until the consumer moves on
        assert sum(1 for _ in it) == 6
    assert sorted(store.gets) == keys(range(7))


def test_batches_are_assembled_ahead_so_next_only_hands_one_over(prepared):
    store = Recording(prepared)
    stream = ShardStream(ShardSource(store, "data"), shard_batches())
    with stream:
        it = iter(stream)
        next(it)  # the consumer holds batch 0
        with stream._cond:  # the readers come to rest at their bounds: shards 0..4, batches 1..4 ready
            assert stream._cond.wait_for(lambda: sorted(stream._ready) == list(range(1, READY_BATCHES + 1)), WAIT)
        assert READY_BATCHES == READAHEAD_SHARDS  # (one batch a shard here)
        assert sorted(store.gets) == keys(range(READAHEAD_SHARDS + 1))
        waited = stream.wait_s
        x, y = next(it)  # ready: a hand-over
        assert stream.wait_s == waited and len(y) == ROWS
        assert sum(1 for _ in it) == 5
    assert sorted(store.gets) == keys(range(7))


def test_the_default_read_ahead_holds_a_whole_shuffle_window_wider_than_its_floor(tmp_path):
    store = DirectoryStore(tmp_path / "bucket")
    prepare_dataset(store, "data", "synthetic:8:3:400:40", subset_size=16)  # 25 shards of 16 rows
    source = ShardSource(store, "data")
    order = epoch_order(split_rows(source.manifest, "train"), seed=0, epoch=0, window=6)
    batches = [order[i:i + 32] for i in range(0, 400, 32)]
    recording = Recording(store)
    stream = ShardStream(ShardSource(recording, "data"), batches)
    seen, bursts = set(), []  # per batch: the shards it needs first
    for b in batches:
        bursts.append(len(set((b // 16).tolist()) - seen))
        seen |= set((b // 16).tolist())
    assert stream.window_shards == max(bursts) == 6 > READAHEAD_SHARDS
    assert stream.readahead_shards == 6
    with stream:
        for k, _ in enumerate(stream):
            if k + 1 < len(batches):  # while the consumer holds batch k, every shard batch k + 1 opens is read
                opened = [s for s in stream.order if stream._first_need[s] == k + 1]
                assert all(recording.event(key).wait(WAIT) for key in keys(opened))
    assert sorted(recording.gets) == sorted(keys(stream.order))


def test_a_second_fetch_goes_on_while_the_first_is_stalled(prepared):
    store = Recording(prepared)
    gate = store.gates[keys([1])[0]] = threading.Event()
    with ShardStream(ShardSource(store, "data"), shard_batches()) as stream:
        it = iter(stream)
        next(it)
        assert store.event(keys([1])[0]).wait(WAIT) and store.event(keys([2])[0]).wait(WAIT)  # 2 asked, 1 stalled
        gate.set()
        data = load_dataset(SOURCE)
        for ids, (x, y) in zip(shard_batches()[1:], it):
            assert torch.equal(x, data.train_x[ids]) and torch.equal(y, data.train_y[ids])
    assert sorted(store.gets) == keys(range(7))


def windowed_batches(seed: int = 0, window: int = 2, batch: int = 16) -> list[np.ndarray]:
    """An epoch's order as `engine.epoch_order` makes one: shards permuted, rows permuted inside
    windows of `window` shards; cut into batches."""
    rng = np.random.default_rng(seed)
    perm = rng.permutation(7)
    order = np.concatenate([rng.permutation(np.concatenate([np.arange(s * ROWS, min((s + 1) * ROWS, 200))
                                                            for s in perm[w:w + window]]))
                            for w in range(0, 7, window)])
    return [order[i:i + batch] for i in range(0, 200, batch)]


@pytest.mark.parametrize("readahead_shards", [0, 1, 3])
def test_what_is_held_at_once_stays_within_the_window_and_the_read_ahead(prepared, readahead_shards):
    shard_bytes = [min(ROWS, 200 - s * ROWS) * ROW_BYTES for s in range(7)]
    batches = windowed_batches()
    budget = readahead_shards * ROWS * ROW_BYTES
    with ShardStream(ShardSource(prepared, "data"), batches, readahead_mb=budget / 2**20) as stream:
        n = sum(1 for _ in stream)
    assert n == len(batches)
    first, last = {}, {}
    for k, ids in enumerate(batches):
        for s in set((ids // ROWS).tolist()):
            first.setdefault(s, k)
            last[s] = k
    window = max(sum(b for s, b in enumerate(shard_bytes) if first[s] <= k <= last[s]) for k in range(n))
    assert window <= 4 * ROWS * ROW_BYTES  # a batch spans at most two windows of two shards
    assert window <= stream.peak_bytes <= window + budget + ROWS * ROW_BYTES
    assert stream.peak_bytes < sum(shard_bytes)  # never the whole dataset


def test_a_corrupt_shard_fails_naming_it_at_the_batch_that_needs_it_on_every_store(bucket):
    key = shard_key("data", "train", 4)
    blob = bucket.get(key)
    bucket.put(key, blob[:-1] + bytes([blob[-1] ^ 1]))
    got = []
    with pytest.raises(ShardError, match=f"{key} of .* is corrupt .* after {shards.READ_TRIES} reads"):
        with ShardStream(ShardSource(bucket, "data"), shard_batches()) as stream:
            for xy in stream:
                got.append(xy)
    assert len(got) == 4  # batches 0..3 were yielded; batch 4 needs shard 4
    assert not [t for t in threading.enumerate() if t.name == "shard-stream"]


def test_a_missing_shard_fails_naming_it_at_the_batch_that_needs_it_on_every_store(bucket):
    key = shard_key("data", "train", 2)
    bucket.delete(key)
    batches = shard_batches()[::-1]  # shards 6, 5, 4, 3, 2, ...
    got = []
    with pytest.raises(ShardError, match=f"{key} of .* is missing after {shards.READ_TRIES} reads"):
        with ShardStream(ShardSource(bucket, "data"), batches, readahead_mb=1.0) as stream:
            for xy in stream:
                got.append(xy)
    assert len(got) == 4


def test_a_stalled_store_shows_as_the_consumer_waiting(prepared):
    store = Recording(prepared)
    gate = store.gates[keys([1])[0]] = threading.Event()
    got, now, waiting = [], [0.0], threading.Event()

    def clock() -> float:  # a fake clock: reads the time the test sets; says when batch 1 waits
        if got:
            waiting.set()
        return now[0]

    stream = ShardStream(ShardSource(store, "data"), shard_batches(), clock=clock)

    def consume():
        with stream:
            for xy in stream:
                got.append(xy)

    consumer = threading.Thread(target=consume)
    consumer.start()
    assert waiting.wait(WAIT) and store.event(keys([1])[0]).wait(WAIT)
    assert len(got) == 1  # batch 1 needs shard 1, which the store holds
    now[0] = 5.0
    gate.set()
    consumer.join(WAIT)
    assert len(got) == 7 and stream.wait_s == 5.0


def test_close_stops_the_reader_when_the_consumer_fails(prepared):
    stream = ShardStream(ShardSource(prepared, "data"), shard_batches(), readahead_mb=0)
    with pytest.raises(RuntimeError, match="compute failed"):
        with stream:
            for _ in stream:
                raise RuntimeError("compute failed")
    assert not [t for t in threading.enumerate() if t.name == "shard-stream"]
    with pytest.raises(RuntimeError, match="read once"):
        next(iter(stream))


def test_a_warm_worker_s_next_epoch_rereads_nothing_the_process_cache_kept(prepared):
    keep_subsets(None)
    source = ShardSource(prepared, "data")
    streams = [ShardStream(source, random_batches(200, 32, seed=e), epoch=e) for e in (0, 1)]
    with streams[0] as s0:
        list(s0)
    with streams[1] as s1:
        rows = list(s1)
    assert s0.bytes_read == sum(s.bytes for s in source.manifest.shards["train"]) and s1.bytes_read == 0
    data = load_dataset(SOURCE)
    assert all(torch.equal(x, data.train_x[ids]) for ids, (x, _) in zip(random_batches(200, 32, seed=1), rows))
    keep_subsets(2 * max(s.bytes for s in source.manifest.shards["train"]) / 2**20)
    with ShardStream(source, random_batches(200, 32)) as s2:
        list(s2)
    assert datasets._CACHE.bytes <= datasets._CACHE.max_bytes and len(datasets._CACHE) == 2


def test_mlm_rows_are_masked_by_their_global_index_for_the_seed_and_epoch(tmp_path):
    store = DirectoryStore(tmp_path / "store")
    manifest = prepare_dataset(store, "data", "text:stdlib:120", subset_size=16,
                               text=TextSettings(objective="mlm", seq_len=64)).manifest
    n = manifest.n_train
    whole_x, whole_y = read_shards(store, "data", range(manifest.n_subsets), seed=7, epoch=1, manifest=manifest)
    batches = random_batches(n, 10, seed=2)
    with ShardStream(ShardSource(store, "data"), batches, seed=7, epoch=1) as stream:
        for ids, (x, y) in zip(batches, stream):
            assert x.dtype == y.dtype == torch.int64
            assert torch.equal(x, whole_x[ids]) and torch.equal(y, whole_y[ids])


def test_bad_arguments_are_refused_naming_the_parameter(prepared):
    source = ShardSource(prepared, "data")
    with pytest.raises(ZooidValueError, match="split"):
        ShardStream(source, [np.arange(3)], "test")
    with pytest.raises(ZooidValueError, match="batches"):
        ShardStream(source, [np.arange(3), np.array([199, 200])])
    with pytest.raises(ZooidValueError, match="batches"):
        ShardStream(source, [np.array([], dtype=np.int64)])
    with pytest.raises(ZooidValueError, match="readahead_mb"):
        ShardStream(source, [np.arange(3)], readahead_mb=-1)
