"""A replica's batches read from a prepared dataset's shards, shard by shard (`ShardStream`).

A worker names its batches as arrays of global row ids of a split (`engine.epoch_order`); the
stream fetches each shard those batches touch once, checked against the manifest
(`engine.datasets.read_shard`), slices the batch's rows out of the shards it holds, and drops a
shard as soon as no later batch needs it. A worker's memory is therefore the shards its current
batches span plus what is read ahead, never its share of the dataset.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch

from core.errors import ZooidValueError
from engine.datasets import ShardSource, read_shard, shard_rows
from engine.shards import SPLITS, DatasetManifest

READAHEAD_SHARDS = 4
"""Shards read ahead of the current batch when no `readahead_mb` is given."""


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
    by batch, in order, each shard fetched once per stream and checked (`fetch_shard`), read ahead.

    A background thread fetches the shards in the order the batches first need them (`order`),
    ahead of the batch the consumer is on by at most `readahead_mb` MB of decoded rows (None:
    `READAHEAD_SHARDS` shards), and always at least one shard; a shard is dropped once no later
    batch needs it. What it holds at once is therefore at most the shards a batch spans that are
    still needed (the current window) plus the read-ahead and one shard (`peak_bytes` measures it).
    A shard that cannot be read (`ShardError` after its retries) is raised here at the first batch
    that needs it, after every batch before it was yielded; nothing is skipped.

    Text shards come back int64; `mlm` shards are masked for (`seed`, `epoch`) by each row's global
    index (`engine.datasets.shard_rows`). Shards go through the process's cache when it is on
    (`keep_subsets`), so a warm worker's next epoch rereads nothing it kept.

    `wait_s`: seconds the consumer waited for a shard (read by `clock`); `bytes_read`: stored bytes
    fetched (a shard from the process cache costs none); `peak_bytes`: the most decoded bytes held
    at once. A stream is read once; use it as a context manager, or `close()` it, which stops the
    reader (a generator that runs to its end, or fails, closes it too)."""

    def __init__(self, source: ShardSource, batches: Sequence[np.ndarray], split: str = "train", *,
                 seed: int = 0, epoch: int = 0, readahead_mb: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        if split not in SPLITS:
            raise ZooidValueError("split", f"must be 'train' or 'val', got {split!r}")
        if readahead_mb is not None and not readahead_mb >= 0:
            raise ZooidValueError("readahead_mb", f"must be at least 0, got {readahead_mb!r}")
        self.source, self.split, self.seed, self.epoch = source, split, seed, epoch
        self.readahead_mb = readahead_mb
        self._budget = None if readahead_mb is None else int(readahead_mb * 2**20)
        self._clock = clock
        rows = np.asarray(split_rows(source.manifest, split), dtype=np.int64)
        self._ends = np.cumsum(rows)
        self._starts = self._ends - rows
        total = int(self._ends[-1]) if len(rows) else 0
        self._batches: list[np.ndarray] = []
        self._shards: list[list[int]] = []  # per batch: its distinct shards, in first-touch order
        self._shard_of: list[np.ndarray] = []  # per batch: each row's shard
        for k, batch in enumerate(batches):
            ids = np.asarray(batch, dtype=np.int64).reshape(-1)
            if len(ids) == 0 or ids.min() < 0 or ids.max() >= total:
                raise ZooidValueError("batches", f"batch {k} must hold ids in 0..{total - 1} of {split!r}, "
                                      f"got {len(ids)} ids")
            self._batches.append(ids)
            self._shard_of.append(np.searchsorted(self._ends, ids, side="right"))
            self._shards.append(_in_first_order(self._shard_of[-1]))
        self.order: list[int] = []
        """Every shard the batches need, in the order they first need it: the order of fetches."""
        self._first_need: dict[int, int] = {}
        self._last_need: dict[int, int] = {}
        for k, shards in enumerate(self._shards):
            for s in shards:
                if s not in self._first_need:
                    self.order.append(s)
                    self._first_need[s] = k
                self._last_need[s] = k
        self.wait_s = 0.0
        self.bytes_read = 0
        self.peak_bytes = 0
        self._cond = threading.Condition()
        self._held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # guarded by _cond, as below
        self._failed: dict[int, BaseException] = {}
        self._held_bytes = 0
        self._need = 0  # the batch the consumer is on
        self._stop = False
        self._thread: threading.Thread | None = None
        self._started = False

    def __len__(self) -> int:
        return len(self._batches)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self._started:
            raise RuntimeError("a ShardStream is read once")
        self._started = True
        self._thread = threading.Thread(target=self._read_ahead, name="shard-stream", daemon=True)
        self._thread.start()
        try:
            for k in range(len(self._batches)):
                with self._cond:
                    self._need = k
                    self._cond.notify_all()
                yield self._rows(k, self._wait_for(k))
                with self._cond:
                    for s in self._shards[k]:
                        if self._last_need[s] == k:
                            self._held_bytes -= _nbytes(self._held.pop(s))
        finally:
            self.close()

    def close(self) -> None:
        """Stop the reader and drop what is held. The reader ends at once, or, in the middle of a
        fetch, when that fetch returns (bounded by the source's timeout and `fetch_shard`'s
        retries), its result dropped; close() waits for it, so no reader outlives its stream."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
            self._held.clear()
            self._held_bytes = 0
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def __enter__(self) -> ShardStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- the consumer -------------------------------------------------------------------

    def _wait_for(self, k: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """The shards batch `k` needs, once the reader has them; a failed one's error raised."""
        got = {}
        with self._cond:
            for s in self._shards[k]:
                if s not in self._held and s not in self._failed:
                    since = self._clock()
                    self._cond.wait_for(lambda s=s: s in self._held or s in self._failed)
                    self.wait_s += self._clock() - since
                if s in self._failed:
                    raise self._failed[s]
                got[s] = self._held[s]
        return got

    def _rows(self, k: int, held: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        ids, shard_of = self._batches[k], self._shard_of[k]
        x0, y0 = held[self._shards[k][0]]
        x = x0.new_empty((len(ids), *x0.shape[1:]))
        y = y0.new_empty((len(ids), *y0.shape[1:]))
        for s, (sx, sy) in held.items():
            at = np.flatnonzero(shard_of == s)
            local = torch.from_numpy(ids[at] - self._starts[s])
            at = torch.from_numpy(at)
            x[at], y[at] = sx[local], sy[local]
        return x, y

    # --- the reader thread ---------------------------------------------------------------

    def _may_fetch(self, s: int) -> bool:
        """Whether the reader may fetch `s` now: a shard the current batch needs always; one
        ahead of it while what is ahead is under the read-ahead bound (or is nothing)."""
        if self._first_need[s] <= self._need:
            return True
        ahead = [xy for t, xy in self._held.items() if self._first_need[t] > self._need]
        if not ahead:
            return True
        if self._budget is None:
            return len(ahead) < READAHEAD_SHARDS
        return sum(map(_nbytes, ahead)) < self._budget

    def _read_ahead(self) -> None:
        src = self.source
        for s in self.order:
            with self._cond:
                self._cond.wait_for(lambda s=s: self._stop or self._may_fetch(s))
                if self._stop:
                    return
            try:
                (x, y, meta), fetched = read_shard(src.store, src.prefix, self.split, s, src.timeout,
                                                   manifest=src.manifest)
                xy = shard_rows(x, y, meta, self.split, self.seed, self.epoch)
            except BaseException as exc:  # noqa: BLE001 - raised in the consumer, at the batch that needs `s`
                with self._cond:
                    self._failed[s] = exc
                    self._cond.notify_all()
                return
            with self._cond:
                self.bytes_read += fetched
                if self._stop:
                    return
                self._held[s] = xy
                self._held_bytes += _nbytes(xy)
                self.peak_bytes = max(self.peak_bytes, self._held_bytes)
                self._cond.notify_all()


def _in_first_order(shards: np.ndarray) -> list[int]:
    """The distinct shards of a batch's rows, in the order its rows first touch them."""
    _, first = np.unique(shards, return_index=True)
    return [int(shards[i]) for i in np.sort(first)]


def _nbytes(xy: tuple[torch.Tensor, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in xy)
