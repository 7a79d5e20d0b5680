"""Reading a replica's batches shard by shard (`engine.shard_stream.ShardStream`): the rows equal
indexing the whole dataset, each shard is fetched once per stream and dropped once no later
batch needs it."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import engine.datasets as datasets
import engine.shards as shards
from comm.store_dir import DirectoryStore
from engine.datasets import ShardSource, load_dataset, prepare_dataset
from engine.shard_stream import ShardStream

SOURCE = "synthetic:8:3:200:40"
ROWS = 32  # 7 training shards (the last of 8 rows), 2 validation shards


@pytest.fixture(autouse=True)
def no_cache_no_pause(monkeypatch):
    """No process cache (each test sets its own) and re-reads without their pause."""
    monkeypatch.setattr(datasets, "_CACHE", None)
    monkeypatch.setattr(shards, "RETRY_PAUSE_S", 0.0)


@pytest.fixture
def prepared(tmp_path):
    store = DirectoryStore(tmp_path / "bucket")
    prepare_dataset(store, "data", SOURCE, subset_size=ROWS)
    yield store
    store.close()


def random_batches(n: int, b: int, seed: int = 0) -> list[np.ndarray]:
    order = np.random.default_rng(seed).permutation(n)
    return [order[i:i + b] for i in range(0, n, b)]


def test_rows_equal_indexing_the_whole_dataset(prepared):
    data = load_dataset(SOURCE)
    batches = random_batches(200, 24)
    with ShardStream(ShardSource(prepared, "data"), batches) as stream:
        got = list(stream)
    assert len(got) == len(batches)
    for ids, (x, y) in zip(batches, got):
        assert torch.equal(x, data.train_x[ids]) and torch.equal(y, data.train_y[ids])
    assert stream.bytes_read == sum(s.bytes for s in ShardSource(prepared, "data").manifest.shards["train"])
