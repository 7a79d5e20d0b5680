"""Average gradients over data-parallel replicas in buckets, while the backward pass runs (DDP's
reducer, for Local-SGD at period 1 and a hybrid's stage syncs).

The parameters are cut into buckets of about `bucket_bytes` (25 MiB by default, DDP's
`bucket_cap_mb`) in reverse registration order, the order in which backward produces their
gradients; a parameter larger than the cap is a bucket of its own, so a small model is one
bucket. A hook on every parameter (`Tensor.register_post_accumulate_grad_hook`) marks its
gradient ready once the backward pass has accumulated it; when every gradient of a bucket is
ready the bucket's allreduce starts at once (`comm.bucket_allreduce`: the ring's asynchronous
work, or a store call on a background thread), while backward goes on computing the earlier
layers' gradients. Buckets start strictly in index order (a bucket that completes early waits
for the ones before it), so every rank launches the same calls in the same order. `finish()`
(before the optimizer step) starts what is left, waits for every bucket and writes the
means back into `.grad`.

`arm(round_)` says that the next backward pass is the last before a step, whose gradients
are to be averaged as round `round_`: Local-SGD arms every step; a pipeline stage that
accumulates gradients over several micro-batches arms before its last micro-batch's backward
only, so the earlier backwards launch nothing. A parameter whose gradient is accumulated twice
while armed is refused (that would send a partial gradient).

`extras` are tensors that are not gradients but must agree across replicas too (batch-norm
running statistics): they are final once the forward pass is done, so they travel in bucket 0
and the mean replaces them in place.

A parameter that gets no gradient in a step contributes zeros, and receives the mean (as
every replica's `.grad`), so replicas stay identical.

Accounting (`stats`): bytes and calls of every bucket call; `seconds` is the time the
training thread is held by the sync, launching buckets in the hooks and waiting in
`finish`, not the calls' own time, which overlaps with backward (the communication a
profiler of DDP calls exposed).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

import torch
from torch import nn

from comm.bandwidth import TransferStats
from comm.bucket_allreduce import BucketCollective, PendingMean
from core.errors import ZooidValueError
from core.outer_sync import DEFAULT_BUCKET_MB

PARAM, EXTRA = "param/", "extra/"
"""Name prefixes inside a bucket call."""


def plan_buckets(sizes: list[tuple[str, int]], bucket_bytes: int) -> list[list[str]]:
    """Cut parameters `(name, nbytes)`, given in registration order, into buckets in reverse
    order; a bucket closes before a parameter that would take it past `bucket_bytes`."""
    if bucket_bytes <= 0:
        raise ZooidValueError("sync.bucket_mb", f"must be positive, got {bucket_bytes / 2**20:g} MiB")
    buckets: list[list[str]] = []
    filled = 0
    for name, nbytes in reversed(sizes):
        if not buckets or (filled and filled + nbytes > bucket_bytes):
            buckets.append([])
            filled = 0
        buckets[-1].append(name)
        filled += nbytes
    return buckets


def merge_traffic(into: TransferStats, call: TransferStats) -> None:
    """Add a call's bytes, transfer times, calls and re-posts to `into`, not its seconds."""
    for f in dataclasses.fields(TransferStats):
        if f.name != "seconds":
            setattr(into, f.name, getattr(into, f.name) + getattr(call, f.name))


class GradientBuckets:
    """The bucketed gradient averaging of one replica's `params` (see the module docstring)
    through `collective`; `remove()` takes the hooks off."""

    def __init__(self, params: dict[str, nn.Parameter], collective: BucketCollective, *,
                 stats: TransferStats, bucket_bytes: int = int(DEFAULT_BUCKET_MB * 2**20),
                 extras: Callable[[], dict[str, torch.Tensor]] | None = None):
        self.params = {n: p for n, p in params.items() if p.requires_grad}
        self.collective, self.stats, self.extras = collective, stats, extras
        self.buckets = plan_buckets([(n, p.numel() * p.element_size()) for n, p in self.params.items()],
                                    bucket_bytes)
        self.bucket_of = {n: k for k, names in enumerate(self.buckets) for n in names}
        self.round: int | None = None
        """The armed round; None: gradients accumulated now are not the step's last."""
        self._ready: set[str] = set()
        self._missing = [len(names) for names in self.buckets]
        self._next = 0
        self._pending: list[tuple[PendingMean, TransferStats, dict[str, torch.Tensor]]] = []
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook(n)) for n, p in self.params.items()]

    def _hook(self, name: str) -> Callable[[torch.Tensor], None]:
        def ready(param: torch.Tensor) -> None:
            if self.round is not None:
                self._mark_ready(name)
        return ready

    def arm(self, round_: int) -> None:
        """Average the gradients of the next backward pass as round `round_`."""
        self.round = round_
        self._ready.clear()
        self._missing = [len(names) for names in self.buckets]
        self._next = 0
        self._pending = []

    @property
    def launched(self) -> int:
        """Buckets of the armed round started so far."""
        return self._next

    def _mark_ready(self, name: str) -> None:
        if name in self._ready:
            raise ZooidValueError("sync_period", f"{name}'s gradient was accumulated twice in round "
                                  f"{self.round}; averaging gradients needs one backward pass per "
                                  f"optimizer step (arm before the last one)")
        self._ready.add(name)
        self._missing[self.bucket_of[name]] -= 1
        began = time.perf_counter()
        while self._next < len(self.buckets) and not self._missing[self._next]:
            self._launch(self._next)
        self.stats.seconds += time.perf_counter() - began

    def _launch(self, k: int) -> None:
        live = {}
        for n in self.buckets[k]:
            p = self.params[n]
            live[PARAM + n] = p.grad if p.grad is not None else torch.zeros_like(p)
        if k == 0 and self.extras is not None:
            live.update({EXTRA + n: t for n, t in self.extras().items()})
        call = TransferStats()
        pending = self.collective.start(self.round, k, {n: t.detach() for n, t in live.items()}, call,
                                        last=k == len(self.buckets) - 1)
        self._pending.append((pending, call, live))
        self._next = k + 1

    def finish(self) -> None:
        """Start the buckets not started yet, wait for all, and write the means into `.grad`
        (and the extras). No-op unless armed; disarms."""
        if self.round is None:
            return
        began = time.perf_counter()
        try:
            while self._next < len(self.buckets):
                self._launch(self._next)
            with torch.no_grad():
                for pending, call, live in self._pending:
                    mean = pending.wait()
                    merge_traffic(self.stats, call)
                    for name, t in live.items():
                        if name.startswith(PARAM):
                            p = self.params[name.removeprefix(PARAM)]
                            if p.grad is None:
                                p.grad = mean[name].to(p.device).clone()
                            elif mean[name] is not t:
                                p.grad.copy_(mean[name])
                        elif mean[name] is not t:
                            t.copy_(mean[name])
        finally:
            self.round = None
            self._pending = []
            self.stats.seconds += time.perf_counter() - began

    def remove(self) -> None:
        """Take the hooks off the parameters (idempotent)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
