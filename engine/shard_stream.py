"""A replica's batches read from a prepared dataset's shards, shard by shard (`ShardStream`).

A worker names its batches as arrays of global row ids of a split (`engine.epoch_order`); the
stream fetches each shard those batches touch once, checked against the manifest
(`engine.datasets.read_shard`), slices the batch's rows out of the shards it holds, and drops a
shard as soon as no later batch needs it. A worker's memory is therefore the shards its current
batches span plus what is read ahead, never its share of the dataset.
"""
from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np
import torch

from core.errors import ZooidValueError
from engine.datasets import ShardSource, read_shard, shard_rows
from engine.shards import SPLITS, DatasetManifest


def split_rows(manifest: DatasetManifest, split: str) -> list[int]:
    """The rows of each shard of `split`, in order (from the checksums' entries, or the counts of
    a manifest that has none)."""
    infos = manifest.shards.get(split)
    if infos:
        return [s.rows for s in infos]
    n = manifest.n_train if split == "train" else manifest.n_val
    return [min(manifest.subset_size, n - start) for start in range(0, n, manifest.subset_size)]


class ShardStream:
    """The rows of `batches` (arrays of global row ids of `split`) of the dataset `source`, batch
    by batch, in order, each shard fetched once per stream and checked (`fetch_shard`).

    Text shards come back int64; `mlm` shards are masked for (`seed`, `epoch`) by each row's global
    index. `wait_s` counts the seconds the consumer waited for data, `bytes_read` the stored bytes
    fetched (a shard the process cache kept costs none), `peak_bytes` the most decoded bytes held
    at once. `readahead_mb` bounds what is read ahead of the current batch (None: a few shards).
    Use it as a context manager, or `close()` it."""

    def __init__(self, source: ShardSource, batches: Sequence[np.ndarray], split: str = "train", *,
                 seed: int = 0, epoch: int = 0, readahead_mb: float | None = None):
        if split not in SPLITS:
            raise ZooidValueError("split", f"must be 'train' or 'val', got {split!r}")
        if readahead_mb is not None and not readahead_mb >= 0:
            raise ZooidValueError("readahead_mb", f"must be at least 0, got {readahead_mb!r}")
        self.source, self.split, self.seed, self.epoch = source, split, seed, epoch
        self.readahead_mb = readahead_mb
        rows = np.asarray(split_rows(source.manifest, split), dtype=np.int64)
        self._ends = np.cumsum(rows)
        self._starts = self._ends - rows
        total = int(self._ends[-1]) if len(rows) else 0
        self._batches: list[np.ndarray] = []
        self._shards: list[np.ndarray] = []  # per batch: each row's shard
        for k, batch in enumerate(batches):
            ids = np.asarray(batch, dtype=np.int64).reshape(-1)
            if len(ids) == 0 or ids.min() < 0 or ids.max() >= total:
                raise ZooidValueError("batches", f"batch {k} must hold ids in 0..{total - 1} of {split!r}, "
                                      f"got {len(ids)} ids")
            self._batches.append(ids)
            self._shards.append(np.searchsorted(self._ends, ids, side="right"))
        self.order: list[int] = []
        """Every shard the batches need, in the order they first need it (the order of fetches)."""
        self._last_need: dict[int, int] = {}
        for k, shards in enumerate(self._shards):
            for s in _in_first_order(shards):
                if s not in self._last_need:
                    self.order.append(s)
                self._last_need[s] = k
        self.wait_s = 0.0
        self.bytes_read = 0
        self.peak_bytes = 0
        self._held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._held_bytes = 0
        self._started = False

    def __len__(self) -> int:
        return len(self._batches)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self._started:
            raise RuntimeError("a ShardStream is read once")
        self._started = True
        try:
            for k in range(len(self._batches)):
                for s in _in_first_order(self._shards[k]):
                    if s not in self._held:
                        self._hold(s, self._fetch(s))
                yield self._rows(k)
                for s in _in_first_order(self._shards[k]):
                    if self._last_need[s] == k:
                        self._drop(s)
        finally:
            self.close()

    def _fetch(self, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        src = self.source
        (x, y, meta), fetched = read_shard(src.store, src.prefix, self.split, s, src.timeout, manifest=src.manifest)
        self.bytes_read += fetched
        return shard_rows(x, y, meta, self.split, self.seed, self.epoch)

    def _hold(self, s: int, xy: tuple[torch.Tensor, torch.Tensor]) -> None:
        self._held[s] = xy
        self._held_bytes += _nbytes(xy)
        self.peak_bytes = max(self.peak_bytes, self._held_bytes)

    def _drop(self, s: int) -> None:
        self._held_bytes -= _nbytes(self._held.pop(s))

    def _rows(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids, shards = self._batches[k], self._shards[k]
        x0, y0 = self._held[int(shards[0])]
        x = x0.new_empty((len(ids), *x0.shape[1:]))
        y = y0.new_empty((len(ids), *y0.shape[1:]))
        for s in _in_first_order(shards):
            at = np.flatnonzero(shards == s)
            local = torch.from_numpy(ids[at] - self._starts[s])
            at = torch.from_numpy(at)
            sx, sy = self._held[s]
            x[at], y[at] = sx[local], sy[local]
        return x, y

    def close(self) -> None:
        """Drop what is held (and stop the reader)."""
        self._held.clear()
        self._held_bytes = 0

    def __enter__(self) -> "ShardStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _in_first_order(shards: np.ndarray) -> list[int]:
    """The distinct shards of a batch's rows, in the order its rows first touch them."""
    _, first = np.unique(shards, return_index=True)
    return [int(shards[i]) for i in np.sort(first)]


def _nbytes(xy: tuple[torch.Tensor, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in xy)
