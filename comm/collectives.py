"""Allreduce through a store: scatter-reduce, then all-gather, with no coordinator.

The tensors of a call are flattened (per dtype) into one vector and cut into `world`
slices. Rank i uploads slice j of its vector for rank j (keeping its own slice j = i in
memory); rank j downloads the other world - 1 contributions to its slice, reduces them,
uploads the reduced slice; every rank then downloads the world - 1 reduced slices it does
not own. A rank uploads one model size and downloads 2 (world - 1) / world of one, and
never holds more than one model's worth of contributions.

Keys of one call live under `prefix` (e.g. `runs/<id>/sync/e3/r7`):
`{prefix}/part-{j}-{i}` (rank i's piece of slice j, `part_key`) and `{prefix}/mean-{j}` (slice j
reduced, `mean_key`), side by side: the directory store makes a directory per key segment, and
each directory a round adds costs a create and a removal (0.11 and 0.15 ms measured here), which
a `part/{j}/{i}` layout paid four times a round.

Every key of a call is idempotent: it is written by one rank, from state every attempt of
that rank computes alike, so a relaunched rank may post it again. Three rules make a call
safe to rejoin by a rank that died in it and was relaunched from an earlier state:

- `mean-j` is the round's result for slice j. When it is already there, a replaying rank j
  (`replay=True`: a relaunch) adopts it
  instead of reducing again (its first life got that far), and no rank posts a piece of
  slice j any more (its reader no longer needs one);
- a part key has one reader, rank j, which deletes its parts only *after* it posted
  `mean-j`: a rank that dies half-way through reading finds every piece again;
- `mean-j` is read by every rank. With `previous_prefix` rank j deletes it during the next
  call of the group, once it holds all of that call's parts (a peer that posted a part of
  call r + 1 has finished reading call r). Without it the results stay until the caller
  deletes the call's prefix: Local-SGD (`engine.local_sgd`) deletes round r - 1 only
  once the checkpoint of round r exists, because a relaunched replica restarts from that
  checkpoint and must be able to replay every later round;
- after the last call, `release_group` lets every rank post `{group}/done/{rank}`; rank 0
  waits for all of them and deletes the whole group prefix, the calls before the done keys
  (so a relaunched rank 0 that finds no call keys knows the release already happened).
  While it waits, call keys that are gone mean the store lost the group (only rank 0
  deletes them): the done keys posted before the loss are gone too, so it stops waiting
  instead of sitting out the whole timeout (`sync_timeout_s`, 17 minutes by default).

Compressed calls (`compressor=`, `comm.compression`): every piece and reduced slice travels
in the compressor's wire dtype with its error feedback, and every rank uses the decoded
reduced slices, its own included. The parts of a call then stay until the group's next
call (`previous_prefix`) or the caller deletes the call's prefix, so that a relaunched rank
j that finds `mean-j` already posted recomputes it from the same parts instead of adopting
it: the residual its first life kept is rebuilt with it (adopted only if the parts are gone).

Lost scratch keys (a Redis restarted without persistence). A `PostLog` remembers what this
rank posted in the current and the previous call. While a wait stalls for `repost_s`
seconds, the rank posts again every logged key that is gone (skipping pieces whose
`mean-j` exists): every key a peer can still be waiting for is held by its writer, since a
peer waits at most on the call its writer is in or the one before. So the round completes
after the restart; only when a wait reaches `timeout` does the call raise `StoreTimeout`,
and the coordinator then relaunches the epoch from the last sync checkpoint.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from comm.bandwidth import TransferStats
from comm.compression import Compressor
from comm.store import Store
from comm.tensor_codec import decode_tensors, encode_tensors
from core.errors import StoreTimeout, ZooidValueError


def part_key(prefix: str, j: int, i: int) -> str:
    """The key of rank `i`'s piece of slice `j` in the call under `prefix`."""
    return f"{prefix}/part-{j}-{i}"


def mean_key(prefix: str, j: int) -> str:
    """The key of slice `j` reduced, in the call under `prefix`."""
    return f"{prefix}/mean-{j}"


@dataclass
class _Post:
    key: str
    blob: bytes
    unless: str | None
    """Skip re-posting while this key exists (the piece's reader is past needing it)."""


class PostLog:
    """What one rank posted in its current and previous call of a group, so that it can
    post the keys again after the scratch store lost them (see the module docstring)."""

    def __init__(self) -> None:
        self.current: list[_Post] = []
        self.previous: list[_Post] = []

    def start_call(self) -> None:
        """Forget the call before the previous one: no peer can still wait for it."""
        self.previous, self.current = self.current, []

    def add(self, key: str, blob: bytes, unless: str | None = None) -> None:
        """Remember a key this rank posted in the current call."""
        self.current.append(_Post(key, blob, unless))

    def repost_missing(self, store: Store) -> int:
        """Post again every remembered key that is gone; return how many were posted."""
        n = 0
        for post in self.previous + self.current:
            if store.exists(post.key) or (post.unless and store.exists(post.unless)):
                continue
            store.put(post.key, post.blob, scratch=True)
            n += 1
        return n


class _Traffic:
    """Store access that counts bytes and seconds, names the missing key on a timeout and,
    with a PostLog, re-posts this rank's lost keys whenever a wait stalls."""

    def __init__(self, store: Store, rank: int, timeout: float, stats: TransferStats,
                 log: PostLog | None = None, repost_s: float | None = None):
        self.store, self.rank, self.timeout, self.stats = store, rank, timeout, stats
        self.log, self.repost_s = log, repost_s

    def put(self, key: str, tensors: dict[str, torch.Tensor], unless: str | None = None) -> None:
        t0 = time.perf_counter()
        blob = encode_tensors(tensors)
        self.store.put(key, blob, scratch=True)
        if self.log is not None:
            self.log.add(key, blob, unless)
        self.stats.upload_s += time.perf_counter() - t0
        self.stats.bytes_up += len(blob)

    def _wait(self, key: str) -> bytes:
        deadline = time.monotonic() + self.timeout
        while True:
            left = deadline - time.monotonic()
            stall = left if self.log is None or not self.repost_s else min(left, self.repost_s)
            try:
                return self.store.get(key, timeout=max(0.0, stall))
            except (StoreTimeout, KeyError):
                if time.monotonic() >= deadline:
                    raise StoreTimeout(
                        f"rank {self.rank} waited {self.timeout:g}s for {key}; a peer is missing or slow"
                    ) from None
            # Stalled: if the store lost our keys, a peer may be waiting for them as we wait.
            self.stats.reposts += self.log.repost_missing(self.store)

    def get(self, key: str) -> dict[str, torch.Tensor]:
        t0 = time.perf_counter()
        blob = self._wait(key)
        tensors, _ = decode_tensors(blob)
        self.stats.download_s += time.perf_counter() - t0
        self.stats.bytes_down += len(blob)
        return tensors


def flatten_by_dtype(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
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
    stats: TransferStats | None,
    previous_prefix: str | None,
    log: PostLog | None = None,
    repost_s: float | None = None,
    replay: bool = False,
    compressor: Compressor | None = None,
) -> dict[str, torch.Tensor]:
    if world == 1:
        return tensors
    stats = stats if stats is not None else TransferStats()
    t0 = time.perf_counter()
    if log is not None:
        log.start_call()
    io = _Traffic(store, rank, timeout, stats, log, repost_s)
    flat = flatten_by_dtype(tensors)
    wire = Wire(compressor, flat, world)

    # Scatter: my piece of every other rank's slice, unless that slice is already reduced
    # (this rank is a relaunch replaying a round its peers got further in). Only a replay
    # can find results of a round it has not contributed to, so only it pays the lookups.
    reduced_already = (lambda key: store.exists(key)) if replay else (lambda key: False)
    for j in range(world):
        if j != rank:
            piece = wire.encode(_slice(flat, j, world), j)  # the residual moves even when not sent
            if not reduced_already(mean_key(prefix, j)):
                io.put(part_key(prefix, j, rank), piece, unless=mean_key(prefix, j))
    mine_key = mean_key(prefix, rank)
    if reduced_already(mine_key) and not wire.recomputable(store, prefix, rank, world):
        posted = io.get(mine_key)  # reduced by this rank's previous life: adopt it
        mine = wire.decode(posted)
        if log is not None:
            log.add(mine_key, encode_tensors(posted))
    else:
        # Reduce my slice from every rank's piece, in rank order so every run sums alike.
        pieces = [_slice(flat, rank, world) if i == rank else wire.decode(io.get(part_key(prefix, rank, i)))
                  for i in range(world)]
        mine = {dtype: reduce(torch.stack([p[dtype] for p in pieces])) for dtype in flat}
        del pieces
        posted, mine = wire.result(mine, rank)
        if not reduced_already(mine_key):
            io.put(mine_key, posted)
    out = _release_and_gather(store, io, prefix, rank, world, flat, mine, tensors, previous_prefix, wire)
    stats.seconds += time.perf_counter() - t0
    stats.calls += 1
    return out


class Wire:
    """A call's wire format: the compressor's when given, else the tensors as they are."""

    def __init__(self, compressor: Compressor | None, flat: dict[str, torch.Tensor], world: int):
        self.compressor = compressor if compressor is not None and compressor.lossy else None
        if self.compressor is not None:
            self.compressor.begin(flat, world)

    @property
    def keeps_parts(self) -> bool:
        """Parts stay until the next call (see the module docstring)."""
        return self.compressor is not None

    def encode(self, piece: dict[str, torch.Tensor], j: int) -> dict[str, torch.Tensor]:
        return piece if self.compressor is None else self.compressor.encode(piece, j)

    def decode(self, wire: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return wire if self.compressor is None else self.compressor.decode(wire)

    def result(self, mean: dict[str, torch.Tensor], rank: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(what to post, what every rank uses) for this rank's reduced slice."""
        return (mean, mean) if self.compressor is None else self.compressor.result(mean, rank)

    def recomputable(self, store: Store, prefix: str, rank: int, world: int) -> bool:
        """Whether a compressed call's reduced slice can be rebuilt from its parts."""
        return self.compressor is not None and all(
            store.exists(part_key(prefix, rank, i)) for i in range(world) if i != rank)


def _release_and_gather(store: Store, io: "_Traffic", prefix: str, rank: int, world: int,
                        flat: dict[str, torch.Tensor], mine: dict[str, torch.Tensor],
                        tensors: dict[str, torch.Tensor], previous_prefix: str | None,
                        wire: Wire | None = None) -> dict[str, torch.Tensor]:
    """The end of a round once this rank has posted its reduced slice (`mean-<rank>`), shared
    by the plain and the pipelined scatter-reduce: delete the pieces of the slice (only now,
    so a rank that died before posting finds them all when relaunched; a compressed call
    deletes the previous call's instead) and the previous call's result (every peer posted
    a part of this call, so all have read it), then gather every reduced slice in rank order."""
    keep = wire is not None and wire.keeps_parts
    for i in range(world):
        if i != rank and not keep:
            store.delete(part_key(prefix, rank, i))
        elif i != rank and previous_prefix is not None:
            store.delete(part_key(previous_prefix, rank, i))
    if previous_prefix is not None:
        store.delete(mean_key(previous_prefix, rank))
    reduced = {dtype: [] for dtype in flat}
    for j in range(world):
        part = mine if j == rank else io.get(mean_key(prefix, j))
        if j != rank and wire is not None:
            part = wire.decode(part)
        for dtype in flat:
            reduced[dtype].append(part[dtype])
    return _unflatten({d: torch.cat(v) for d, v in reduced.items()}, tensors)


def allreduce_mean(
    store: Store,
    prefix: str,
    rank: int,
    world: int,
    tensors: dict[str, torch.Tensor],
    timeout: float,
    *,
    stats: TransferStats | None = None,
    previous_prefix: str | None = None,
    log: PostLog | None = None,
    repost_s: float | None = None,
    replay: bool = False,
    compressor: Compressor | None = None,
) -> dict[str, torch.Tensor]:
    """Elementwise mean of `tensors` over the `world` ranks (every rank passes the same names
    and shapes), reduced in each tensor's own dtype. world == 1 returns `tensors` untouched
    without store traffic. A peer that posts nothing within `timeout` raises StoreTimeout
    naming the key. `previous_prefix` is this group's previous call, whose results this call
    cleans up; `log` (kept across the group's calls) and `repost_s` re-post lost keys while
    a wait stalls; `replay` (a relaunched rank) adopts results already in the store (see
    the module docstring); `compressor` sends the pieces compressed (`comm.compression`)."""
    for name, t in tensors.items():
        if not t.is_floating_point():
            raise ZooidValueError("tensors", f"{name!r} is {t.dtype}; a mean needs floating tensors")
    return _allreduce(store, prefix, rank, world, tensors, timeout, lambda s: s.mean(0), stats,
                      previous_prefix, log, repost_s, replay, compressor)


def allreduce_sum(
    store: Store,
    prefix: str,
    rank: int,
    world: int,
    tensors: dict[str, torch.Tensor],
    timeout: float,
    *,
    stats: TransferStats | None = None,
    previous_prefix: str | None = None,
    log: PostLog | None = None,
    repost_s: float | None = None,
    replay: bool = False,
    compressor: Compressor | None = None,
) -> dict[str, torch.Tensor]:
    """Elementwise sum of `tensors` over the ranks; otherwise as `allreduce_mean`."""
    return _allreduce(store, prefix, rank, world, tensors, timeout, lambda s: s.sum(0), stats,
                      previous_prefix, log, repost_s, replay, compressor)


def release_group(
    store: Store, group: str, rank: int, world: int, timeout: float, *,
    stats: TransferStats | None = None, resumed: bool = False,
) -> None:
    """End a group of calls under prefix `group`: every rank says it is done; rank 0 waits
    for all ranks and deletes everything under `group`. No-op for world == 1.

    `resumed`: this rank is a relaunch that may have released the group in a previous life.
    If no call keys (`{group}/r...`) are left, the release already happened: a relaunched
    rank then posts nothing. Rank 0 stops waiting for done keys whenever the call keys
    are gone: released in a previous life, or lost by a scratch store that restarted (the
    done keys posted before it are lost with them; one posted later is scratch that
    the coordinator deletes with the epoch's group)."""
    if world == 1:
        return
    t0 = time.perf_counter()
    calls_left = lambda: bool(store.list(f"{group}/r"))  # noqa: E731 - used twice below
    if resumed and not calls_left():
        if rank == 0:
            store.delete_prefix(f"{group}/")  # done keys a previous life left behind
        return
    store.put(f"{group}/done/{rank}", b"1", scratch=True)
    if rank != 0:
        return
    for i in range(1, world):
        key = f"{group}/done/{i}"
        deadline = time.monotonic() + timeout
        while True:
            try:
                store.get(key, timeout=min(1.0, max(0.0, deadline - time.monotonic())))
                break
            except (StoreTimeout, KeyError):
                if not calls_left():
                    break  # released by our previous life, or lost by the store: nothing to wait for
                if time.monotonic() >= deadline:
                    raise StoreTimeout(f"rank 0 waited {timeout:g}s for {key}; a peer is missing") from None
    # Calls first, done keys last: see `resumed` above.
    store.delete_prefix(f"{group}/r")
    store.delete_prefix(f"{group}/")
    if stats is not None:
        stats.seconds += time.perf_counter() - t0
