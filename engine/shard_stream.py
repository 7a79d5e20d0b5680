"""A replica's batches read from a prepared dataset's shards, shard by shard (`ShardStream`).

A worker names its batches as arrays of global row ids of a split (`engine.epoch_order`); the
stream fetches each shard those batches touch once, checked against the manifest
(`engine.datasets.read_shard`), slices each batch's rows out of the shards it holds before the
consumer asks for it, and drops a shard as soon as no later batch needs it. A worker's memory is therefore the shards its current
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
"""The fewest shards read ahead of the current batch when no `readahead_mb` is given (a stream
whose batches open shuffle windows reads a whole window ahead: `ShardStream.readahead_shards`)."""

READY_BATCHES = 4
"""Batches assembled ahead of the one the consumer holds; once there are that many, the assembler
rests until half of them were taken, so it is woken once every READY_BATCHES // 2 batches."""

FETCHES_IN_FLIGHT = 2
"""Shards fetched at once (each fetch starts in first-need order). Measured with a directory store
slowed to 50 ms a get, 64 shards of 64 rows, batches of 32 and 10 ms of compute a batch: the
consumer waited 1.6-1.8 s with one, 0.2-0.3 s with two; at 20 ms a get and 20 ms a batch, 0.2 s
and 0.1 s."""


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

    Background threads do the reading. The fetchers (`FETCHES_IN_FLIGHT`) fetch the shards in the
    order the batches first need them (`order`: each fetch starts in that order), ahead of the batch the consumer is on by at most
    `readahead_mb` MB of decoded rows, or, when None, `readahead_shards` shards: the larger of
    `READAHEAD_SHARDS` and the most shards one batch needs first (`window_shards`: a shuffle
    window's, `engine.epoch_order`), so a new window's shards are all read while the consumer is
    still in the one before; always at least one shard ahead. The assembler slices each batch's
    rows out of the shards it needs, up to `READY_BATCHES` batches beyond the consumer's, and
    drops a shard once no later batch needs it; the consumer's next() only hands a ready batch
    over. A shard that cannot be read (`ShardError` after its retries) is raised here at the
    first batch that needs it, after every batch before it was yielded; nothing is skipped.

    Memory: the decoded shards held at once (`peak_bytes` measures them) are at most those the
    consumer's batch spans that are still needed (the current window) plus the read-ahead plus
    one shard; the ready batches add at most `READY_BATCHES` + 1 batches of rows (the one the
    consumer holds included).

    Text shards come back int64; `mlm` shards are masked for (`seed`, `epoch`) by each row's global
    index (`engine.datasets.shard_rows`). Shards go through the process's cache when it is on
    (`keep_subsets`), so a warm worker's next epoch rereads nothing it kept.

    `wait_s`: seconds the consumer waited in next() for its batch (read by `clock`); `bytes_read`:
    stored bytes fetched (a shard from the process cache costs none); `peak_bytes`: the most
    decoded shard bytes held at once. A stream is read once; use it as a context manager, or
    `close()` it, which stops the readers (a generator that runs to its end, or fails, closes it
    too)."""

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
        firsts = [0] * len(self._batches)  # per batch: the shards it needs first
        for k, shards in enumerate(self._shards):
            for s in shards:
                if s not in self._first_need:
                    self.order.append(s)
                    self._first_need[s] = k
                    firsts[k] += 1
                self._last_need[s] = k
        self.window_shards = max(firsts, default=0)
        """The most shards one batch needs first: a shuffle window's, when a batch opens one."""
        self.readahead_shards = max(READAHEAD_SHARDS, self.window_shards)
        """Shards read ahead when `readahead_mb` is None."""
        # _current[k]: how many shards of `order` batches 0..k need (the rest are ahead of batch k)
        self._current = np.cumsum(firsts).tolist()
        self.wait_s = 0.0
        self.bytes_read = 0
        self.peak_bytes = 0
        # One lock, three conditions, so a thread is woken only when what it waits for may have
        # changed (a waking thread competes with the consumer's compute for the CPU and the GIL):
        # the consumer's (a batch ready), the fetchers' (room ahead), the assembler's (a shard
        # fetched, room for batches).
        lock = threading.Lock()
        self._cond = threading.Condition(lock)
        self._fetch_cond = threading.Condition(lock)
        self._asm_cond = threading.Condition(lock)
        # guarded by the lock:
        self._fetched = 0  # shards of `order` claimed by the fetcher (fetched or in flight)
        self._decoded: dict[int, int] = {}  # shard -> its decoded bytes, once fetched
        self._held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._failed: dict[int, BaseException] = {}
        self._held_bytes = 0
        self._ready: dict[int, tuple[torch.Tensor, torch.Tensor] | BaseException] = {}
        self._need = 0  # the batch the consumer is on
        self._assembling = 0  # the batch the assembler is on
        self._stop = False
        self._threads: list[threading.Thread] = []
        self._started = False

    def __len__(self) -> int:
        return len(self._batches)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self._started:
            raise RuntimeError("a ShardStream is read once")
        self._started = True
        self._threads = [threading.Thread(target=work, name="shard-stream", daemon=True)
                         for work in [self._fetch] * FETCHES_IN_FLIGHT + [self._assemble]]
        for t in self._threads:
            t.start()
        try:
            for k in range(len(self._batches)):
                got = self._wait_for(k)
                if isinstance(got, BaseException):
                    raise got
                yield got
        finally:
            self.close()

    def close(self) -> None:
        """Stop the readers and drop what is held. They end at once, or, in the middle of a
        fetch, when that fetch returns (bounded by the source's timeout and `fetch_shard`'s
        retries), its result dropped; close() waits for them, so no reader outlives its stream."""
        with self._cond:
            self._stop = True
            for cond in (self._cond, self._fetch_cond, self._asm_cond):
                cond.notify_all()
            self._held.clear()
            self._ready.clear()
            self._held_bytes = 0
        for t in self._threads:
            if t is not threading.current_thread():
                t.join()

    def __enter__(self) -> ShardStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- the consumer -------------------------------------------------------------------

    def _wait_for(self, k: int) -> tuple[torch.Tensor, torch.Tensor] | BaseException:
        """Batch `k`'s rows once the assembler has them, or the error that stopped it there."""
        with self._cond:
            self._need = k
            if k and self._current[k] != self._current[k - 1]:  # batch k opens shards: room ahead
                self._fetch_cond.notify_all()
            if self._assembling == k + READY_BATCHES // 2:  # the assembler rests until now
                self._asm_cond.notify_all()
            if k not in self._ready:
                since = self._clock()
                self._cond.wait_for(lambda: k in self._ready)
                self.wait_s += self._clock() - since
            return self._ready.pop(k)

    # --- the fetcher threads ---------------------------------------------------------------

    def _may_fetch(self) -> bool:
        """Whether the fetcher may claim the next shard of `order` now: one the consumer's batch
        needs always; one ahead of it while what is ahead is under the read-ahead bound (or is
        nothing)."""
        current = self._current[min(self._need, len(self._current) - 1)]
        if self._fetched < current:
            return True
        ahead = self.order[current:self._fetched]
        if not ahead:
            return True
        if self._budget is None:
            return len(ahead) < self.readahead_shards
        # a shard in flight counts as the largest fetched so far (none yet: wait for its size)
        guess = max(self._decoded.values(), default=None)
        if guess is None and any(s not in self._decoded for s in ahead):
            return False
        return sum(self._decoded.get(s, guess) for s in ahead) < self._budget

    def _fetch(self) -> None:
        src = self.source
        while True:
            with self._cond:
                self._fetch_cond.wait_for(lambda: self._stop or self._fetched >= len(self.order) or self._may_fetch())
                if self._stop or self._fetched >= len(self.order) or self._failed:
                    return
                s = self.order[self._fetched]
                self._fetched += 1
            try:
                (x, y, meta), fetched = read_shard(src.store, src.prefix, self.split, s, src.timeout,
                                                   manifest=src.manifest)
                xy = shard_rows(x, y, meta, self.split, self.seed, self.epoch)
            except BaseException as exc:  # noqa: BLE001 - raised in the consumer, at the batch that needs `s`
                with self._cond:
                    self._failed[s] = exc
                    self._fetch_cond.notify_all()  # the other fetchers stop
                    self._asm_cond.notify_all()
                return
            with self._cond:
                self.bytes_read += fetched
                if self._stop:
                    return
                self._held[s] = xy
                self._decoded[s] = _nbytes(xy)
                self._held_bytes += self._decoded[s]
                self.peak_bytes = max(self.peak_bytes, self._held_bytes)
                self._asm_cond.notify_all()
                if self._budget is not None:  # its size is known now
                    self._fetch_cond.notify_all()

    # --- the assembler thread ---------------------------------------------------------------

    def _assemble(self) -> None:
        for k in range(len(self._batches)):
            with self._cond:
                self._assembling = k
                if k > self._need + READY_BATCHES:  # full: rest until half were taken
                    self._asm_cond.wait_for(lambda: self._stop or k <= self._need + READY_BATCHES // 2)
                self._asm_cond.wait_for(lambda: self._stop or all(
                    s in self._held or s in self._failed for s in self._shards[k]))
                if self._stop:
                    return
                failed = [self._failed[s] for s in self._shards[k] if s in self._failed]
                held = {s: self._held[s] for s in self._shards[k]} if not failed else {}
            try:
                if failed:
                    raise failed[0]
                out: tuple[torch.Tensor, torch.Tensor] | BaseException = self._rows(k, held)
            except BaseException as exc:  # noqa: BLE001 - raised in the consumer, at batch k
                out = exc
            with self._cond:
                if self._stop:
                    return
                self._ready[k] = out
                if isinstance(out, BaseException):
                    self._cond.notify_all()
                    self._fetch_cond.notify_all()
                    return
                for s in self._shards[k]:
                    if self._last_need[s] == k:
                        self._held_bytes -= self._decoded[s]
                        del self._held[s]
                self._cond.notify_all()

    def _rows(self, k: int, held: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        ids, shard_of = self._batches[k], self._shard_of[k]
        x0, y0 = held[self._shards[k][0]]
        if len(held) == 1:  # a batch of one shard: one gather each
            local = torch.from_numpy(ids - self._starts[self._shards[k][0]])
            return x0[local], y0[local]
        x = x0.new_empty((len(ids), *x0.shape[1:]))
        y = y0.new_empty((len(ids), *y0.shape[1:]))
        for s, (sx, sy) in held.items():
            at = np.flatnonzero(shard_of == s)
            local = torch.from_numpy(ids[at] - self._starts[s])
            at = torch.from_numpy(at)
            x[at], y[at] = sx[local], sy[local]
        return x, y


def _in_first_order(shards: np.ndarray) -> list[int]:
    """The distinct shards of a batch's rows, in the order its rows first touch them."""
    _, first = np.unique(shards, return_index=True)
    return [int(shards[i]) for i in np.sort(first)]


def _nbytes(xy: tuple[torch.Tensor, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in xy)
