"""Pipelined scatter-reduce through a store (FuncPipe Sec. 3.3), beside the plain baseline.

Both reduce a dict of tensors over `world` ranks with the signature of
`comm.collectives.allreduce_mean` / `allreduce_sum`, so Local-SGD averaging and the
gradient sync of a hybrid D x M pipeline can use either:

- plain (LambdaML's three phases, `comm.collectives`): upload the world - 1 foreign
  slices, then download the world - 1 pieces of one's own slice, then upload the reduced
  slice and download the others. Upload and download never overlap, so with a link of
  bandwidth w per direction a model of s bytes takes 3 s/w - 2 s/(n w) + 4 latencies
  (FuncPipe Eq. 1).
- pipelined (this module): phases 1 and 2 run as n steps on two threads. In step k the
  upload thread sends slice rank + k while the download thread fetches this rank's slice
  from rank - (k - 1), which that rank uploaded in its step k - 1; both directions of the
  link are busy at once, so the two phases cost s/w + n latencies together and the whole
  sync 2 s/w + (n + 2) latencies (FuncPipe Eq. 2). Phase 3 is unchanged.

Keys, cleanup and fault handling are those of `comm.collectives`: `{prefix}/part-{j}-{i}`
is rank i's piece of slice j, deleted by its one reader once it has posted
`{prefix}/mean-{j}`, slice j reduced, which rank j deletes in the group's next call
(`previous_prefix`) or `release_group` after the last; a `PostLog` re-posts keys a scratch
store lost, and `replay` lets a relaunched rank adopt results already posted. A group may
therefore mix the two algorithms. The pieces of a slice are reduced in rank order with the
plain version's arithmetic, so both give bitwise-equal results on every rank.

`allreduce_for` also hands out the direct ring (`comm.ring_allreduce`) behind the same
signature, for targets whose workers can reach each other.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from typing import TYPE_CHECKING, Callable, Protocol

import torch

from comm import collectives
from comm.bandwidth import TransferStats
# The plain version's store access (counting, timeouts naming the key, re-posting lost
# keys) and its flat layout, reused so that both algorithms behave alike in every respect
# but the overlap. Private to comm.collectives: see the report asking to publish them.
from comm.collectives import PostLog, Wire, flatten_by_dtype, mean_key, part_key, _release_and_gather, _Traffic
from comm.compression import Compressor
from comm.store import Store
from comm.tensor_codec import encode_tensors
from core.errors import ZooidValueError

if TYPE_CHECKING:
    from comm.ring_allreduce import RingGroup

Flat = dict[str, torch.Tensor]
"""One flat vector per dtype name."""


class Allreduce(Protocol):
    """The signature every store collective here shares."""

    def __call__(self, store: Store, prefix: str, rank: int, world: int,
                 tensors: dict[str, torch.Tensor], timeout: float, *,
                 stats: TransferStats | None = None, previous_prefix: str | None = None,
                 log: PostLog | None = None, repost_s: float | None = None,
                 replay: bool = False, compressor: Compressor | None = None) -> dict[str, torch.Tensor]: ...


def pipelined_allreduce_mean(
    store: Store, prefix: str, rank: int, world: int, tensors: dict[str, torch.Tensor],
    timeout: float, *, stats: TransferStats | None = None, previous_prefix: str | None = None,
    log: PostLog | None = None, repost_s: float | None = None, replay: bool = False,
    compressor: Compressor | None = None,
) -> dict[str, torch.Tensor]:
    """Elementwise mean of `tensors` over `world` ranks by the pipelined scatter-reduce.

    Every rank passes the same names, shapes and dtypes; world == 1 returns `tensors`
    untouched. A peer that posts nothing within `timeout` raises `StoreTimeout` naming the
    missing key. `previous_prefix`, `log`, `repost_s` and `replay` mean what they mean for
    `comm.collectives.allreduce_mean` (cleanup of the previous call, re-posting keys a
    scratch store lost, adopting results when a relaunched rank replays a call).
    """
    for name, t in tensors.items():
        if not t.is_floating_point():
            raise ZooidValueError("tensors", f"{name!r} is {t.dtype}; a mean needs floating tensors")
    return _pipelined(store, prefix, rank, world, tensors, timeout, lambda s: s.mean(0),
                      stats, previous_prefix, log, repost_s, replay, compressor)


def pipelined_allreduce_sum(
    store: Store, prefix: str, rank: int, world: int, tensors: dict[str, torch.Tensor],
    timeout: float, *, stats: TransferStats | None = None, previous_prefix: str | None = None,
    log: PostLog | None = None, repost_s: float | None = None, replay: bool = False,
    compressor: Compressor | None = None,
) -> dict[str, torch.Tensor]:
    """Elementwise sum of `tensors` over `world` ranks; otherwise as the mean."""
    return _pipelined(store, prefix, rank, world, tensors, timeout, lambda s: s.sum(0),
                      stats, previous_prefix, log, repost_s, replay, compressor)


plain_allreduce_mean: Allreduce = collectives.allreduce_mean
"""The three-phase baseline (LambdaML), kept in `comm.collectives`."""
plain_allreduce_sum: Allreduce = collectives.allreduce_sum
"""The three-phase baseline for sums."""

ALGORITHMS = ("pipelined", "plain")
"""The collectives through a store."""
COLLECTIVES = ALGORITHMS + ("ring",)
"""Every collective `allreduce_for` knows: the store ones and the direct ring
(`comm.ring_allreduce`), which needs workers that can reach each other."""


def allreduce_for(algorithm: str, op: str = "mean", *, ring: "RingGroup | None" = None) -> Allreduce:
    """The collective named `algorithm` (`pipelined`, `plain` or `ring`) for `op` (`mean`
    or `sum`). `ring` must be given for `ring`: the open `comm.ring_allreduce.RingGroup`
    the calls go through (it ignores the store arguments)."""
    table = {("pipelined", "mean"): pipelined_allreduce_mean,
             ("pipelined", "sum"): pipelined_allreduce_sum,
             ("plain", "mean"): plain_allreduce_mean,
             ("plain", "sum"): plain_allreduce_sum}
    if algorithm not in COLLECTIVES:
        raise ZooidValueError("sync", f"unknown algorithm {algorithm!r}; valid: {', '.join(COLLECTIVES)}")
    if op not in ("mean", "sum"):
        raise ZooidValueError("op", f"must be 'mean' or 'sum', got {op!r}")
    if algorithm == "ring":
        if ring is None:
            raise ZooidValueError("ring", "sync 'ring' needs the open RingGroup it runs on "
                                  "(comm.ring_allreduce.open_ring)")
        return ring.as_allreduce(op)
    return table[(algorithm, op)]


def _pipelined(
    store: Store, prefix: str, rank: int, world: int, tensors: dict[str, torch.Tensor],
    timeout: float, reduce: Callable[[torch.Tensor], torch.Tensor], stats: TransferStats | None,
    previous_prefix: str | None, log: PostLog | None, repost_s: float | None, replay: bool,
    compressor: Compressor | None = None,
) -> dict[str, torch.Tensor]:
    if not isinstance(world, int) or world < 1:
        raise ZooidValueError("world", f"must be a positive integer, got {world!r}")
    if not isinstance(rank, int) or not 0 <= rank < world:
        raise ZooidValueError("rank", f"must be in 0..{world - 1}, got {rank!r}")
    if world == 1:
        return tensors
    stats = stats if stats is not None else TransferStats()
    began = time.perf_counter()
    if log is not None:
        log.start_call()
    # Two store users, one per thread, each with its own counters (merged at the end).
    up_stats = TransferStats()
    up = _Traffic(store, rank, timeout, up_stats, log, repost_s)
    down = _Traffic(store, rank, timeout, stats, log, repost_s)
    flat = flatten_by_dtype(tensors)
    wire = Wire(compressor, flat, world)
    slices = {dtype: torch.tensor_split(v, world) for dtype, v in flat.items()}

    def piece(j: int) -> Flat:
        return {dtype: parts[j].contiguous() for dtype, parts in slices.items()}

    # As in the plain version, a relaunched rank skips slices already reduced (see
    # comm.collectives); only a replay pays for the lookups. Encoded on this thread in
    # slice order (the residual moves even for a piece not sent), uploaded on the other.
    reduced_already = (lambda key: store.exists(key)) if replay else (lambda key: False)
    order = [(rank + k) % world for k in range(1, world)]
    encoded = {j: wire.encode(piece(j), j) for j in order}
    uploads = [j for j in order if not reduced_already(mean_key(prefix, j))]
    uploader = _Uploader(up, [(part_key(prefix, j, rank), encoded[j], mean_key(prefix, j))
                              for j in uploads])
    uploader.start()
    mine_key = mean_key(prefix, rank)
    mine = None
    adopt = reduced_already(mine_key) and not wire.recomputable(store, prefix, rank, world)
    try:
        if adopt:
            posted = down.get(mine_key)  # reduced by this rank's previous life: adopt it
            mine = wire.decode(posted)
            if log is not None:
                log.add(mine_key, encode_tensors(posted))
        else:
            # Phases 1 and 2, pipelined: download step k waits for rank - k's upload step k.
            pieces = {rank: piece(rank)}
            for k in range(1, world):
                source = (rank - k) % world
                pieces[source] = wire.decode(down.get(part_key(prefix, rank, source)))
    finally:
        uploader.join()
    uploader.raise_error()
    if mine is None:
        # Reduce in rank order, with the plain version's arithmetic: the same bits.
        mine = {dtype: reduce(torch.stack([pieces[i][dtype] for i in range(world)]))
                for dtype in flat}
        del pieces
        posted, mine = wire.result(mine, rank)
        if not reduced_already(mine_key):
            down.put(mine_key, posted)
    # Phase 3: release the parts, gather the other reduced slices (as the plain version).
    out = _release_and_gather(store, down, prefix, rank, world, flat, mine, tensors, previous_prefix, wire)
    for f in dataclasses.fields(TransferStats):
        if f.name not in ("seconds", "calls"):
            setattr(stats, f.name, getattr(stats, f.name) + getattr(up_stats, f.name))
    stats.seconds += time.perf_counter() - began
    stats.calls += 1
    return out


class _Uploader(threading.Thread):
    """Posts the pieces in order on its own thread; keeps an error for the caller."""

    def __init__(self, traffic: "_Traffic", uploads: list[tuple[str, Flat, str]]):
        super().__init__(name=f"scatter-up-{traffic.rank}", daemon=True)
        self.traffic, self.uploads = traffic, uploads
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for key, tensors, unless in self.uploads:
                self.traffic.put(key, tensors, unless=unless)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the calling thread
            self.error = exc

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error
