"""Start one bucket's allreduce mean and return at once; wait for it later.

The gradient buckets of `engine.gradient_buckets` launch each bucket while the backward
pass is still running and wait for all of them before the optimizer step. Two ways to run
a call in the background, behind one interface (`BucketCollective.start`):

- `RingBuckets`: the direct ring (`comm.ring_allreduce`); the ring's own thread (CPU) or
  NCCL's stream (CUDA) moves the bucket, as DDP's backend does, and the round's last bucket
  moves on the calling thread. Every rank starts its buckets in the same order, which is what
  matches calls across ranks.
- `StoreBuckets`: a store collective (`comm.collectives`, `comm.scatter_reduce`) run on a
  daemon thread per bucket, at most `MAX_IN_FLIGHT` at once; the round's last bucket runs on
  the calling thread, as nothing is left to overlap with it. Each bucket is one call of
  the collective with its own key prefix `{group}/r{round}/b{bucket}`
  (`core.keys.sync_call_prefix`), so the store collective's rules hold per bucket unchanged:
  idempotent keys, `replay` adopting a reduced slice a relaunched rank's previous life
  posted, and re-posting lost keys from a `PostLog` kept per bucket (bucket k's calls of
  consecutive rounds form the sequence that log's "current and previous call" refers to: a
  rank starts round r + 1 only after every bucket of round r is done). Without
  `replayable` each call deletes its bucket's results of the round before
  (`previous_prefix`); with it the caller deletes whole rounds (`{group}/r{round}/`).

Daemon threads, so that a call stuck waiting for a dead peer never keeps a failing worker
process from exiting; its `StoreTimeout` reaches the caller at `wait`.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Protocol

import torch

from comm.bandwidth import TransferStats
from comm.collectives import PostLog
from comm.ring_allreduce import RingGroup
from comm.scatter_reduce import Allreduce
from comm.store import Store
from core.keys import sync_call_prefix

MAX_IN_FLIGHT = 4
"""Store calls of one rank that run at once (more buckets queue behind them)."""


class PendingMean(Protocol):
    """One started call: `wait()` blocks until it is done and gives the means by name."""

    def wait(self) -> dict[str, torch.Tensor]: ...


class BucketCollective(Protocol):
    """Starts the mean of one bucket's tensors over the replicas without waiting."""

    def start(self, round_: int, bucket: int, tensors: dict[str, torch.Tensor],
              stats: TransferStats, last: bool = False) -> PendingMean:
        """Launch bucket `bucket` of round `round_`; count its traffic into `stats`. `last`:
        the round's last bucket, which nothing is left to overlap with."""
        ...


class RingBuckets:
    """Bucket calls over an open `RingGroup` (its asynchronous work)."""

    def __init__(self, ring: RingGroup):
        self.ring = ring

    def start(self, round_: int, bucket: int, tensors: dict[str, torch.Tensor],
              stats: TransferStats, last: bool = False) -> PendingMean:
        """Copy the bucket into the ring's buffer and launch it (see the module docstring)."""
        return self.ring.start_allreduce_mean(tensors, stats=stats, now=last)


class _Call:
    """A store call running on its own daemon thread."""

    def __init__(self, name: str, run, gate: threading.Semaphore):
        self.future: Future = Future()

        def body() -> None:
            with gate:
                try:
                    self.future.set_result(run())
                except BaseException as exc:  # noqa: BLE001 - re-raised by wait() in the caller's thread
                    self.future.set_exception(exc)

        threading.Thread(target=body, name=name, daemon=True).start()

    def wait(self) -> dict[str, torch.Tensor]:
        return self.future.result()


class _Done:
    """A store call that ran on the calling thread."""

    def __init__(self, means: dict[str, torch.Tensor]):
        self.means = means

    def wait(self) -> dict[str, torch.Tensor]:
        return self.means


class StoreBuckets:
    """Bucket calls of a store collective (`allreduce`, the `scatter_reduce.Allreduce`
    signature) for one rank of a sync `group`; see the module docstring. `replay` marks a
    relaunched rank, `repost_s` re-posts lost keys while a wait stalls (None: never)."""

    def __init__(self, allreduce: Allreduce, store: Store, group: str, rank: int, world: int,
                 timeout: float, *, replayable: bool = False, repost_s: float | None = None,
                 replay: bool = False):
        self.allreduce, self.store, self.group = allreduce, store, group
        self.rank, self.world, self.timeout = rank, world, timeout
        self.replayable, self.repost_s, self.replay = replayable, repost_s, replay
        self.logs: dict[int, PostLog] = {}
        self._gate = threading.Semaphore(MAX_IN_FLIGHT)

    def start(self, round_: int, bucket: int, tensors: dict[str, torch.Tensor],
              stats: TransferStats, last: bool = False) -> PendingMean:
        """Run the bucket's call on a daemon thread (the tensors are read there: leave them
        alone until `wait` returns); the round's `last` bucket on the calling thread, since
        only the wait for it is left (a thread would add its start and the interpreter lock's
        hand-overs to every step, which a small model's one bucket cannot hide)."""
        prefix = sync_call_prefix(self.group, round_, bucket)
        previous = sync_call_prefix(self.group, round_ - 1, bucket) if round_ and not self.replayable else None
        log = self.logs.setdefault(bucket, PostLog()) if self.repost_s else None

        def run() -> dict[str, torch.Tensor]:
            return self.allreduce(self.store, prefix, self.rank, self.world, tensors, self.timeout,
                                  stats=stats, previous_prefix=previous, log=log,
                                  repost_s=self.repost_s, replay=self.replay)

        if last:
            return _Done(run())
        return _Call(f"bucket-{self.rank}-r{round_}-b{bucket}", run, self._gate)
