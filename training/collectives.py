"""Allreduce through a store: scatter-reduce, then all-gather, with no coordinator.

The tensors of a call are flattened (per dtype) into one vector and cut into `world`
slices. Rank i uploads slice j of its vector for rank j (keeping its own slice j = i in
memory); rank j downloads the other world - 1 contributions to its slice, reduces them,
uploads the reduced slice; every rank then downloads the world - 1 reduced slices it does
not own. A rank uploads one model size and downloads 2 (world - 1) / world of one, and
never holds more than one model's worth of contributions.

Keys of one call live under `prefix` (e.g. `runs/<id>/sync/e3/r7`):
`{prefix}/part/{j}/{i}` (rank i's piece of slice j) and `{prefix}/mean/{j}` (slice j reduced).
Cleanup keeps every key until its last reader is done:

- a part key has one reader, rank j, which deletes it right after reading it;
- `mean/j` is read by every rank. Rank j deletes it during the next call on the same
  group (`previous_prefix`), once it holds all of that call's parts: a peer that posted a
  part of call r + 1 has finished reading the results of call r;
- after the last call, `release_group` lets every rank post `{group}/done/{rank}`; rank 0
  waits for all of them and deletes the whole group prefix.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from training.errors import StoreTimeout, ZooidValueError
from training.store import Store
from training.tensor_codec import decode_tensors, encode_tensors


@dataclass
class SyncStats:
    """Traffic and time a rank spent in collectives (accumulated over calls)."""

    bytes_up: int = 0
    bytes_down: int = 0
    upload_s: float = 0.0
    download_s: float = 0.0
    seconds: float = 0.0
    calls: int = 0

    @property
    def bytes_total(self) -> int:
        """Bytes uploaded plus downloaded."""
        return self.bytes_up + self.bytes_down


class _Traffic:
    """Store access that counts bytes and seconds and names the missing key on a timeout."""

    def __init__(self, store: Store, rank: int, timeout: float, stats: SyncStats):
        self.store, self.rank, self.timeout, self.stats = store, rank, timeout, stats

    def put(self, key: str, tensors: dict[str, torch.Tensor]) -> None:
        t0 = time.perf_counter()
        blob = encode_tensors(tensors)
        self.store.put(key, blob)
        self.stats.upload_s += time.perf_counter() - t0
        self.stats.bytes_up += len(blob)

    def get(self, key: str) -> dict[str, torch.Tensor]:
        t0 = time.perf_counter()
        try:
            blob = self.store.get(key, timeout=self.timeout)
        except (StoreTimeout, KeyError):
            raise StoreTimeout(
                f"rank {self.rank} waited {self.timeout:g}s for {key}; a peer is missing or slow"
            ) from None
        tensors, _ = decode_tensors(blob)
        self.stats.download_s += time.perf_counter() - t0
        self.stats.bytes_down += len(blob)
        return tensors


def _flatten(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One flat CPU vector per dtype, the tensors concatenated in sorted-name order."""
    groups: dict[str, list[torch.Tensor]] = {}
    for name in sorted(tensors):
        t = tensors[name]
        groups.setdefault(str(t.dtype).removeprefix("torch."), []).append(t.detach().to("cpu").reshape(-1))
    return {dtype: torch.cat(parts) for dtype, parts in groups.items()}


def _unflatten(flat: dict[str, torch.Tensor], like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    offsets = {dtype: 0 for dtype in flat}
    out = {}
    for name in sorted(like):
        t = like[name]
        dtype = str(t.dtype).removeprefix("torch.")
        start = offsets[dtype]
        out[name] = flat[dtype][start : start + t.numel()].reshape(t.shape).clone()
        offsets[dtype] = start + t.numel()
    return out


def _slice(flat: dict[str, torch.Tensor], j: int, world: int) -> dict[str, torch.Tensor]:
    return {dtype: torch.tensor_split(v, world)[j].contiguous() for dtype, v in flat.items()}


def _allreduce(
    store: Store,
    prefix: str,
    rank: int,
    world: int,
    tensors: dict[str, torch.Tensor],
    timeout: float,
    reduce: Callable[[torch.Tensor], torch.Tensor],
    stats: SyncStats | None,
    previous_prefix: str | None,
) -> dict[str, torch.Tensor]:
    if not 0 <= rank < world:
        raise ZooidValueError("rank", f"must be in 0..{world - 1}, got {rank}")
    if world == 1:
        return tensors
    stats = stats if stats is not None else SyncStats()
    t0 = time.perf_counter()
    io = _Traffic(store, rank, timeout, stats)
    flat = _flatten(tensors)

    # Scatter: my piece of every other rank's slice.
    for j in range(world):
        if j != rank:
            io.put(f"{prefix}/part/{j}/{rank}", _slice(flat, j, world))
    # Reduce my slice from every rank's piece, in rank order so every run sums alike.
    pieces = []
    for i in range(world):
        if i == rank:
            pieces.append(_slice(flat, rank, world))
        else:
            key = f"{prefix}/part/{rank}/{i}"
            pieces.append(io.get(key))
            store.delete(key)
    if previous_prefix is not None:
        store.delete(f"{previous_prefix}/mean/{rank}")
    mine = {dtype: reduce(torch.stack([p[dtype] for p in pieces])) for dtype in flat}
    del pieces
    io.put(f"{prefix}/mean/{rank}", mine)
    # Gather every reduced slice.
    reduced = {dtype: [] for dtype in flat}
    for j in range(world):
        part = mine if j == rank else io.get(f"{prefix}/mean/{j}")
        for dtype in flat:
            reduced[dtype].append(part[dtype])
    out = _unflatten({d: torch.cat(v) for d, v in reduced.items()}, tensors)
    stats.seconds += time.perf_counter() - t0
    stats.calls += 1
    return out


def allreduce_mean(
    store: Store,
    prefix: str,
    rank: int,
    world: int,
    tensors: dict[str, torch.Tensor],
    timeout: float,
    *,
    stats: SyncStats | None = None,
    previous_prefix: str | None = None,
) -> dict[str, torch.Tensor]:
    """Elementwise mean of `tensors` over the `world` ranks (every rank passes the same names
    and shapes), reduced in each tensor's own dtype. world == 1 returns `tensors` untouched
    without store traffic. A peer that posts nothing within `timeout` raises StoreTimeout
    naming the key. `previous_prefix` is this group's previous call, whose results this call
    cleans up (see the module docstring)."""
    for name, t in tensors.items():
        if not t.is_floating_point():
            raise ZooidValueError("tensors", f"{name!r} is {t.dtype}; a mean needs floating tensors")
    return _allreduce(
        store, prefix, rank, world, tensors, timeout, lambda s: s.mean(0), stats, previous_prefix
    )


def allreduce_sum(
    store: Store,
    prefix: str,
    rank: int,
    world: int,
    tensors: dict[str, torch.Tensor],
    timeout: float,
    *,
    stats: SyncStats | None = None,
    previous_prefix: str | None = None,
) -> dict[str, torch.Tensor]:
    """Elementwise sum of `tensors` over the ranks; otherwise as `allreduce_mean`."""
    return _allreduce(
        store, prefix, rank, world, tensors, timeout, lambda s: s.sum(0), stats, previous_prefix
    )


def release_group(
    store: Store, group: str, rank: int, world: int, timeout: float, *, stats: SyncStats | None = None
) -> None:
    """End a group of calls under prefix `group`: every rank says it is done; rank 0 waits
    for all ranks and deletes everything under `group`. No-op for world == 1."""
    if world == 1:
        return
    store.put(f"{group}/done/{rank}", b"1")
    if rank != 0:
        return
    t0 = time.perf_counter()
    for i in range(1, world):
        key = f"{group}/done/{i}"
        try:
            store.get(key, timeout=timeout)
        except (StoreTimeout, KeyError):
            raise StoreTimeout(f"rank 0 waited {timeout:g}s for {key}; a peer is missing") from None
    store.delete_prefix(f"{group}/")
    if stats is not None:
        stats.seconds += time.perf_counter() - t0
