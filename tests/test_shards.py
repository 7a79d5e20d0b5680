"""A prepared dataset (`engine.shards`, `engine.datasets.prepare_dataset`): shards and a manifest
with checksums, on a directory, S3 (the moto server) and Azure Blob (Azurite); a prepare killed
halfway goes on where it stopped; preparing again is a no-op; a corrupt or missing shard is read
again, then fails naming the shard; no manifest, or another format, is refused naming `dataset`."""
from __future__ import annotations

import hashlib
import json

import pytest
import torch

import engine.shards as shards
from comm.store import Store
from comm.store_dir import DirectoryStore
from core.errors import ZooidValueError
from core.keys import shard_key, shard_manifest_key
from engine.datasets import keep_subsets, load_dataset, prepare_dataset, read_shards
from engine.shards import FORMAT, READ_TRIES, ShardCache, ShardError, read_dataset_manifest
from tests.bucket_stores import KINDS, empty_store

SOURCE = "synthetic:8:3:200:40"
ROWS = 32  # 7 training shards (the last of 8 rows), 2 validation shards


@pytest.fixture(params=KINDS)
def bucket(request, tmp_path) -> Store:
    """An empty store of each kind a prepared dataset lives in."""
    s = empty_store(request.param, request, tmp_path)
    yield s
    s.close()


@pytest.fixture(autouse=True)
def no_pause(monkeypatch):
    """Re-reads without their pause (the count of reads is what is checked)."""
    monkeypatch.setattr(shards, "RETRY_PAUSE_S", 0.0)


class Counting:
    """A store that counts gets and puts per key, fails the `fail_after`-th put (a prepare
    killed there), and may corrupt or hide keys for their first `bad_reads` reads."""

    def __init__(self, store: Store, fail_after: int | None = None):
        self.store, self.url, self.fail_after = store, store.url, fail_after
        self.gets: dict[str, int] = {}
        self.puts: list[str] = []
        self.corrupt: dict[str, int] = {}
        self.hidden: dict[str, int] = {}

    def put(self, key, data, **kw):
        if self.fail_after is not None and len(self.puts) == self.fail_after:
            raise KeyboardInterrupt("killed")
        self.puts.append(key)
        self.store.put(key, data, **kw)

    def get(self, key, timeout=None):
        n = self.gets[key] = self.gets.get(key, 0) + 1
        if n <= self.hidden.get(key, 0):
            raise KeyError(key)
        data = self.store.get(key, timeout=timeout)
        return data[:-1] + bytes([data[-1] ^ 1]) if n <= self.corrupt.get(key, 0) else data

    def exists(self, key):
        return self.store.exists(key)


def test_prepared_shards_hold_the_dataset_with_checksums_and_read_back_equal(bucket):
    done = prepare_dataset(bucket, "", SOURCE, ROWS, prepared_by="abc123")
    m = done.manifest
    assert (done.written, done.kept, done.already) == (9, 0, False)
    assert (m.n_train, m.n_val, m.n_subsets, m.n_val_subsets, m.format) == (200, 40, 7, 2, FORMAT)
    assert [s.rows for s in m.shards["train"]] == [32] * 6 + [8]
    assert m.dtypes == {"x": "torch.float32", "y": "torch.int64"} and m.prepared_by == "abc123"
    assert m.settings == {"source": SOURCE, "subset_size": ROWS, "text": None}
    for split, infos in m.shards.items():  # each checksum is the stored bytes'
        for i, info in enumerate(infos):
            blob = bucket.get(shard_key("", split, i))
            assert (len(blob), hashlib.sha256(blob).hexdigest()) == (info.bytes, info.sha256)
    assert read_dataset_manifest(bucket, "") == m
    data = load_dataset(SOURCE)
    x, y = read_shards(bucket, "", range(7), manifest=m)
    assert torch.equal(x, data.train_x) and torch.equal(y, data.train_y)
    vx, vy = read_shards(bucket, "", [1, 0], split="val", manifest=m)
    assert torch.equal(vx, torch.cat([data.val_x[32:], data.val_x[:32]]))


def test_preparing_the_same_source_again_writes_nothing_and_says_so(dir_store):
    first = prepare_dataset(dir_store, "pre", SOURCE, ROWS)
    store = Counting(dir_store)
    again = prepare_dataset(store, "pre", SOURCE, ROWS)
    assert again.already and (again.written, again.kept) == (0, 0) and again.manifest == first.manifest
    assert store.puts == []
    other = prepare_dataset(store, "pre", SOURCE, 64)  # other settings: prepared anew
    assert not other.already and other.manifest.n_subsets == 4


def test_a_prepare_killed_halfway_goes_on_where_it_stopped(dir_store, tmp_path):
    killed = Counting(dir_store, fail_after=4)
    with pytest.raises(KeyboardInterrupt):
        prepare_dataset(killed, "", SOURCE, ROWS)
    assert not dir_store.exists(shard_manifest_key(""))  # no manifest: not a dataset yet
    resumed = Counting(dir_store)
    done = prepare_dataset(resumed, "", SOURCE, ROWS)
    assert (done.written, done.kept, done.already) == (5, 4, False)
    assert resumed.puts[:5] == [shard_key("", "train", i) for i in range(4, 7)] + [shard_key("", "val", i)
                                                                               for i in range(2)]
    clean = prepare_dataset(DirectoryStore(tmp_path / "clean"), "", SOURCE, ROWS)
    assert done.manifest == clean.manifest


def test_a_shard_that_heals_is_read_again_one_that_stays_bad_fails_naming_it(dir_store):
    m = prepare_dataset(dir_store, "", SOURCE, ROWS).manifest
    store = Counting(dir_store)
    store.corrupt[shard_key("", "train", 2)] = 1
    store.hidden[shard_key("", "train", 3)] = READ_TRIES - 1
    x, _ = read_shards(store, "", [2, 3], manifest=m)
    assert torch.equal(x, load_dataset(SOURCE).train_x[64:128])
    assert store.gets[shard_key("", "train", 2)] == 2 and store.gets[shard_key("", "train", 3)] == READ_TRIES

    store.corrupt[shard_key("", "train", 5)] = READ_TRIES
    with pytest.raises(ShardError, match=r"shard train/5 of .* is corrupt .* after 3 reads"):
        read_shards(store, "", [5], manifest=m)
    assert store.gets[shard_key("", "train", 5)] == READ_TRIES
    dir_store.delete(shard_key("", "val", 1))
    with pytest.raises(ShardError, match=r"shard val/1 of .* is missing after 3 reads"):
        read_shards(dir_store, "", [0, 1], split="val", manifest=m)


def test_corruption_in_a_bucket_is_caught_by_the_checksum(bucket):
    m = prepare_dataset(bucket, "", SOURCE, ROWS).manifest
    key = shard_key("", "train", 1)
    blob = bucket.get(key)
    bucket.put(key, blob[:-4] + b"\0\0\0\0" if blob[-4:] != b"\0\0\0\0" else blob[:-4] + b"\1\1\1\1")
    with pytest.raises(ShardError, match="shard train/1 .* corrupt"):
        read_shards(bucket, "", [1], manifest=m)
    read_shards(bucket, "", [0, 2], manifest=m)  # the others still read


def test_no_manifest_or_another_format_is_refused_naming_dataset(dir_store):
    with pytest.raises(ZooidValueError, match=r"^dataset: no prepared dataset at .*/empty \(no manifest.json"):
        read_dataset_manifest(dir_store, "empty")
    prepare_dataset(dir_store, "old", SOURCE, ROWS)
    doc = json.loads(dir_store.get(shard_manifest_key("old")))
    dir_store.put(shard_manifest_key("old"), json.dumps({**doc, "format": FORMAT + 1}).encode())
    with pytest.raises(ZooidValueError, match=rf"^dataset: the manifest at .*/old is format {FORMAT + 1}"):
        read_dataset_manifest(dir_store, "old")
    again = prepare_dataset(dir_store, "old", SOURCE, ROWS)  # another format: prepared anew
    assert not again.already and read_dataset_manifest(dir_store, "old").format == FORMAT


def test_the_shard_cache_keeps_the_most_recent_within_its_bound():
    cache = ShardCache(max_bytes=250)
    for i in range(3):
        cache.put(i, f"v{i}", 100)
    assert (cache.get(0), cache.get(1), cache.get(2), cache.bytes) == (None, "v1", "v2", 200)
    cache.get(1)
    cache.put(3, "v3", 100)  # 2 was used least recently
    assert (cache.get(2), cache.get(1), cache.get(3), len(cache)) == (None, "v1", "v3", 2)
    cache.put(4, "big", 300)  # larger than the whole bound: not kept, nothing dropped
    assert (cache.get(4), len(cache)) == (None, 2)


def test_a_worker_reads_each_shard_once_within_its_cache(dir_store, monkeypatch):
    m = prepare_dataset(dir_store, "", SOURCE, ROWS).manifest
    monkeypatch.setattr("engine.datasets._CACHE", None)
    store = Counting(dir_store)
    keep_subsets(max_mb=2 * m.shards["train"][0].bytes / 2**20)  # room for two shards
    for _ in range(2):
        read_shards(store, "", [0, 1], manifest=m)
    read_shards(store, "", [2], manifest=m)  # drops shard 0
    read_shards(store, "", [0], manifest=m)
    assert [store.gets[shard_key("", "train", i)] for i in range(3)] == [2, 1, 1]
