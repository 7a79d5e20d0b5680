"""Pipelined scatter-reduce through a store (FuncPipe Sec. 3.3), beside the plain baseline.

Both reduce a dict of tensors over `world` ranks with the signature of
`training.collectives.allreduce_mean` / `allreduce_sum`, so Local-SGD averaging and the
gradient sync of a hybrid D x M pipeline can use either:

- plain (LambdaML's three phases, `training.collectives`): upload the world - 1 foreign
  slices, then download the world - 1 pieces of one's own slice, then upload the reduced
  slice and download the others. Upload and download never overlap, so with a link of
  bandwidth w per direction a model of s bytes takes 3 s/w - 2 s/(n w) + 4 latencies
  (FuncPipe Eq. 1).
- pipelined (this module): phases 1 and 2 run as n steps on two threads. In step k the
  upload thread sends slice rank + k while the download thread fetches this rank's slice
  from rank - (k - 1), which that rank uploaded in its step k - 1; both directions of the
  link are busy at once, so the two phases cost s/w + n latencies together and the whole
  sync 2 s/w + (n + 2) latencies (FuncPipe Eq. 2). Phase 3 is unchanged.

Keys and cleanup are those of `training.collectives` (`{prefix}/part/{j}/{i}` is rank i's
piece of slice j, deleted by its one reader; `{prefix}/mean/{j}` is slice j reduced,
deleted by rank j in the next call of the group through `previous_prefix`, or by
`release_group` after the last call), so a group may mix the two algorithms. The pieces of
a slice are reduced in rank order with the same arithmetic as the plain version, so both
give bitwise-equal results and every rank ends with the same bits.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Protocol

import torch

from training import collectives
from training.collectives import SyncStats
from training.errors import StoreTimeout, ZooidValueError
from training.store import Store
from training.tensor_codec import decode_tensors, encode_tensors

Flat = dict[str, torch.Tensor]
"""One flat vector per dtype name."""


class Allreduce(Protocol):
    """The signature every store collective here shares."""

    def __call__(self, store: Store, prefix: str, rank: int, world: int,
                 tensors: dict[str, torch.Tensor], timeout: float, *,
                 stats: SyncStats | None = None,
                 previous_prefix: str | None = None) -> dict[str, torch.Tensor]: ...


def pipelined_allreduce_mean(
    store: Store, prefix: str, rank: int, world: int, tensors: dict[str, torch.Tensor],
    timeout: float, *, stats: SyncStats | None = None, previous_prefix: str | None = None,
) -> dict[str, torch.Tensor]:
    """Elementwise mean of `tensors` over `world` ranks by the pipelined scatter-reduce.

    Every rank passes the same names, shapes and dtypes; world == 1 returns `tensors`
    untouched. A peer that posts nothing within `timeout` raises `StoreTimeout` naming the
    missing key. `previous_prefix` is this group's previous call, cleaned up by this one.
    """
    for name, t in tensors.items():
        if not t.is_floating_point():
            raise ZooidValueError("tensors", f"{name!r} is {t.dtype}; a mean needs floating tensors")
    return _pipelined(store, prefix, rank, world, tensors, timeout,
                      lambda s: s.mean(0), stats, previous_prefix)


def pipelined_allreduce_sum(
    store: Store, prefix: str, rank: int, world: int, tensors: dict[str, torch.Tensor],
    timeout: float, *, stats: SyncStats | None = None, previous_prefix: str | None = None,
) -> dict[str, torch.Tensor]:
    """Elementwise sum of `tensors` over `world` ranks; otherwise as the mean."""
    return _pipelined(store, prefix, rank, world, tensors, timeout,
                      lambda s: s.sum(0), stats, previous_prefix)


plain_allreduce_mean: Allreduce = collectives.allreduce_mean
"""The three-phase baseline (LambdaML), kept in `training.collectives`."""
plain_allreduce_sum: Allreduce = collectives.allreduce_sum
"""The three-phase baseline for sums."""

ALGORITHMS = ("pipelined", "plain")


def allreduce_for(algorithm: str, op: str = "mean") -> Allreduce:
    """The collective named `algorithm` (`pipelined` or `plain`) for `op` (`mean` or `sum`)."""
    table = {("pipelined", "mean"): pipelined_allreduce_mean,
             ("pipelined", "sum"): pipelined_allreduce_sum,
             ("plain", "mean"): plain_allreduce_mean,
             ("plain", "sum"): plain_allreduce_sum}
    if algorithm not in ALGORITHMS:
        raise ZooidValueError("sync", f"unknown algorithm {algorithm!r}; valid: {', '.join(ALGORITHMS)}")
    if op not in ("mean", "sum"):
        raise ZooidValueError("op", f"must be 'mean' or 'sum', got {op!r}")
    return table[(algorithm, op)]


def _pipelined(
    store: Store, prefix: str, rank: int, world: int, tensors: dict[str, torch.Tensor],
    timeout: float, reduce: Callable[[torch.Tensor], torch.Tensor],
    stats: SyncStats | None, previous_prefix: str | None,
) -> dict[str, torch.Tensor]:
    if not isinstance(world, int) or world < 1:
        raise ZooidValueError("world", f"must be a positive integer, got {world!r}")
    if not isinstance(rank, int) or not 0 <= rank < world:
        raise ZooidValueError("rank", f"must be in 0..{world - 1}, got {rank!r}")
    if world == 1:
        return tensors
    stats = stats if stats is not None else SyncStats()
    began = time.perf_counter()
    flat = _flatten(tensors)
    slices = {dtype: torch.tensor_split(v, world) for dtype, v in flat.items()}

    def piece(j: int) -> Flat:
        return {dtype: parts[j].contiguous() for dtype, parts in slices.items()}

    # Phases 1 and 2, pipelined: the uploader runs ahead of the downloader by one step.
    up = _Link(store, rank, timeout)
    uploader = threading.Thread(
        target=up.run, name=f"scatter-up-{rank}",
        args=([(f"{prefix}/part/{(rank + k) % world}/{rank}", piece((rank + k) % world))
               for k in range(1, world)],), daemon=True)
    uploader.start()
    down = _Link(store, rank, timeout)
    pieces: dict[int, Flat] = {rank: piece(rank)}
    try:
        for k in range(1, world):
            source = (rank - k) % world
            key = f"{prefix}/part/{rank}/{source}"
            pieces[source] = down.get(key)
            store.delete(key)
    finally:
        uploader.join()
    up.raise_error()
    if previous_prefix is not None:
        # Every peer posted a part of this call, so all have read the previous call's results.
        store.delete(f"{previous_prefix}/mean/{rank}")
    mine = {dtype: reduce(torch.stack([pieces[i][dtype] for i in range(world)]))
            for dtype in flat}
    del pieces

    # Phase 3: publish the reduced slice, gather the others.
    down.put(f"{prefix}/mean/{rank}", mine)
    gathered = {dtype: [] for dtype in flat}
    for j in range(world):
        part = mine if j == rank else down.get(f"{prefix}/mean/{j}")
        for dtype in flat:
            gathered[dtype].append(part[dtype])
    out = _unflatten({dtype: torch.cat(v) for dtype, v in gathered.items()}, tensors)
    for link in (up, down):
        stats.bytes_up += link.bytes_up
        stats.bytes_down += link.bytes_down
        stats.upload_s += link.upload_s
        stats.download_s += link.download_s
    stats.seconds += time.perf_counter() - began
    stats.calls += 1
    return out


class _Link:
    """One thread's store traffic: counts bytes and seconds, names a missing key on timeout,
    and keeps an uploader thread's error for the caller to raise."""

    def __init__(self, store: Store, rank: int, timeout: float):
        self.store, self.rank, self.timeout = store, rank, timeout
        self.bytes_up = self.bytes_down = 0
        self.upload_s = self.download_s = 0.0
        self.error: BaseException | None = None

    def put(self, key: str, tensors: Flat) -> None:
        t0 = time.perf_counter()
        blob = encode_tensors(tensors)
        self.store.put(key, blob)
        self.upload_s += time.perf_counter() - t0
        self.bytes_up += len(blob)

    def get(self, key: str) -> Flat:
        t0 = time.perf_counter()
        try:
            blob = self.store.get(key, timeout=self.timeout)
        except (StoreTimeout, KeyError):
            raise StoreTimeout(
                f"rank {self.rank} waited {self.timeout:g}s for {key}; a peer is missing or slow"
            ) from None
        tensors, _ = decode_tensors(blob)
        self.download_s += time.perf_counter() - t0
        self.bytes_down += len(blob)
        return tensors

    def run(self, uploads: list[tuple[str, Flat]]) -> None:
        try:
            for key, tensors in uploads:
                self.put(key, tensors)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the calling thread
            self.error = exc

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error


def _flatten(tensors: dict[str, torch.Tensor]) -> Flat:
    """One flat vector per dtype, the tensors concatenated in sorted-name order (the
    layout `training.collectives` uses, so the two algorithms slice identically)."""
    groups: dict[str, list[torch.Tensor]] = {}
    for name in sorted(tensors):
        t = tensors[name]
        groups.setdefault(_dtype_name(t), []).append(t.detach().reshape(-1))
    return {dtype: torch.cat(parts) for dtype, parts in groups.items()}


def _unflatten(flat: Flat, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    offsets = {dtype: 0 for dtype in flat}
    out = {}
    for name in sorted(like):
        t = like[name]
        dtype = _dtype_name(t)
        start = offsets[dtype]
        out[name] = flat[dtype][start:start + t.numel()].reshape(t.shape).clone()
        offsets[dtype] = start + t.numel()
    return out


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")
