"""Validation read chunk by chunk (`engine.validation_stream`): the figures equal scoring the
whole validation split at once (`validation_metrics`) exactly, for class targets and for masked
token targets, with chunks that cross shards; what a pass holds is a few shards, not the split;
a pipeline's `ChunkRows` gives each chunk's inputs and targets in any interleaving."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import engine.datasets as datasets
import engine.local_sgd as local_sgd
import engine.validation_stream as validation_stream
from comm.store_dir import DirectoryStore
from engine.datasets import ShardSource, prepare_dataset, read_shards
from engine.local_sgd import validation_metrics
from engine.objective import objective_for
from engine.shard_stream import ShardStream
from engine.text_data import TextSettings
from engine.validation_stream import ChunkRows, chunk_ids, manifest_chunk, streamed_validation


@pytest.fixture(autouse=True)
def no_cache(monkeypatch):
    monkeypatch.setattr(datasets, "_CACHE", None)


@pytest.fixture
def streams(monkeypatch) -> list[ShardStream]:
    """Every ShardStream a validation pass opens."""
    made = []

    class Recorded(ShardStream):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(validation_stream, "ShardStream", Recorded)
    return made


def whole_val(store, manifest, seed=0):
    return read_shards(store, "data", range(manifest.n_val_subsets), "val", seed=seed, manifest=manifest)


def test_class_figures_equal_the_whole_split_s_with_chunks_that_cross_shards(tmp_path, streams):
    store = DirectoryStore(tmp_path / "store")
    manifest = prepare_dataset(store, "data", "synthetic:8:5:100:2500", subset_size=300).manifest
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5)).double()
    vx, vy = whole_val(store, manifest)
    want = validation_metrics(model, vx.double(), vy)
    assert manifest_chunk(manifest) == local_sgd.VALIDATION_ROWS  # chunks of 1024, 1024, 452 rows: shards of 300
    got = streamed_validation(model, ShardSource(store, "data"),
                              convert=lambda t: t.double() if t.is_floating_point() else t)
    assert got == want and got.accuracy is not None
    stream, = streams
    shard = 300 * (8 * 4 + 8)
    assert stream.peak_bytes <= (5 + stream.readahead_shards + 1) * shard  # a chunk spans at most 5 shards
    assert stream.peak_bytes < 2500 * (8 * 4 + 8)  # never the whole split
    assert model.training  # back in training mode


def test_masked_token_figures_equal_the_whole_split_s(tmp_path, monkeypatch, streams):
    monkeypatch.setattr(local_sgd, "VALIDATION_TOKENS", 64 * 10)  # chunks of 10 rows of 64 tokens
    store = DirectoryStore(tmp_path / "store")
    manifest = prepare_dataset(store, "data", "text:stdlib:120", subset_size=16,
                               text=TextSettings(objective="mlm", seq_len=64)).manifest
    assert manifest_chunk(manifest) == 10
    vocab = manifest.text.vocab_size  # the mask token included
    torch.manual_seed(1)
    model = nn.Sequential(nn.Embedding(vocab, 8), nn.Linear(8, vocab))
    vx, vy = whole_val(store, manifest, seed=7)
    objective = objective_for(None)
    want = validation_metrics(model, vx, vy, objective)
    got = streamed_validation(model, ShardSource(store, "data"), objective, seed=7)
    assert got == want and got.perplexity is not None and got.token_accuracy is not None
    stream, = streams
    assert len(stream) == -(-manifest.n_val // 10)


def test_a_pipeline_s_chunk_rows_come_in_any_interleaving(tmp_path):
    store = DirectoryStore(tmp_path / "store")
    manifest = prepare_dataset(store, "data", "synthetic:8:5:100:200", subset_size=32).manifest
    vx, vy = whole_val(store, manifest)
    chunks = torch.tensor_split(torch.arange(200), 7)
    rows = ChunkRows(ShardSource(store, "data"), [c.numpy() for c in chunks], (0, 1))
    try:
        # a schedule's order: stage 0 runs a chunk or two ahead of the last stage
        for m in range(7):
            assert torch.equal(rows.take(m, 0), vx[chunks[m]])
            if m >= 1:
                assert torch.equal(rows.take(m - 1, 1), vy[chunks[m - 1]])
        assert torch.equal(rows.take(6, 1), vy[chunks[6]])
        assert not rows._kept  # every chunk dropped once both parts were taken
    finally:
        rows.close()
    only_targets = ChunkRows(ShardSource(store, "data"), [c.numpy() for c in chunks], (1,))
    with pytest.raises(KeyError):
        only_targets.take(0, 0)  # a last stage's worker keeps no inputs
    only_targets.close()


def test_chunk_ids_cover_the_split_once_in_order():
    parts = chunk_ids(10, 4)
    assert [p.tolist() for p in parts] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert chunk_ids(0, 4) == []
