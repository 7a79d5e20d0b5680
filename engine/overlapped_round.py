"""A Local-SGD round whose collective runs behind the next round's first steps (`sync.overlap_steps`).

Without overlap a replica waits at every sync for the collective (the puts, the peers'
pieces, the gets) and starts the next round from its result. With `overlap_steps` = n, round
t's collective runs on a thread while the replica takes the next round's first n steps from
its own weights; after them (at the next sync at the latest) it joins round t and re-bases:
its tensors become round t's result plus what those steps changed since the post,

    θ_i ← R(t) + (θ_i − θ_i(posted t)),

and the next round's change is posted against R(t) (the outer step's snapshot). The outer
step (`engine.outer`) is the same one, applied n steps late: each round's mean change drives
it exactly once, and n steps of each round run on weights that miss the last round's average
(the delayed outer step of Streaming DiLoCo's overlapped communication). Measured on
`gpt_mini` (K-AVG every 8 steps, momentum SGD, 300 steps of two replicas): perplexity 10.86
joined at once, 10.92 one step late, 11.40 two, 13.55 four and 20.18 a whole round late, so a
step or two hides a store's round trip at little cost where a whole round does not. The
epoch's last round is joined at once with nothing trained since its post, so every replica
ends the epoch with the same tensors, as without overlap, and the epoch checkpoint, the next
epoch and a rescale see equal weights.

What the replica waits for is what the join waits for: the collective's time less the steps
it hid. `join` counts that as the round's sync seconds and adds the thread's bytes and calls.
While it waits, the training thread beats as a store wait does (`comm.heartbeat`), so its
guards still run there: a warm worker's expired lease stops the epoch, and a spot notice that
comes while a peer is missing leaves from the wait (`engine.preemption.stop_waiting`).
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, TimeoutError as FutureTimeout
from typing import Callable

import torch

from comm import heartbeat
from comm.bandwidth import TransferStats

JOIN_BEAT_S = 0.1
"""Seconds between the training thread's beats while it waits for a round (the join returns as
soon as the round is done, whatever this is)."""


def _own(payload: dict[str, torch.Tensor], live: dict[str, torch.Tensor],
         posted: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`payload` with every tensor that is a live one's memory taken from `posted` (the live
    tensors' copy as posted): training goes on writing the live tensors while the thread reads
    the payload, and the collective only reads it."""
    ptrs = {t.data_ptr(): n for n, t in live.items() if t.numel()}
    return {n: posted[ptrs[t.data_ptr()]] if t.numel() and t.data_ptr() in ptrs else t for n, t in payload.items()}


class PendingRound:
    """One posted round: its collective on the thread, and the replica's tensors as posted."""

    def __init__(self, future: Future, posted: dict[str, torch.Tensor], stats: TransferStats, round_: int, step: int):
        self.future, self.posted, self.stats, self.round, self.step = future, posted, stats, round_, step

    def join(self, live: dict[str, torch.Tensor], apply: Callable[[dict[str, torch.Tensor]], None],
             stats: TransferStats) -> None:
        """Wait for the round's mean, `apply` it to `live` (the outer step: `live` becomes the
        round's result), add back what `live` changed since the post, and count the wait and
        the thread's transfers into `stats`. The collective's error, if any, is raised here."""
        began = time.perf_counter()
        while True:
            try:
                mean = self.future.result(timeout=JOIN_BEAT_S)
                break
            except FutureTimeout:
                heartbeat.beat(waiting=True)  # this thread's guards: an expired lease, a notice
        waited = time.perf_counter() - began
        names = list(live)
        with torch.no_grad():
            since = torch._foreach_sub([live[n] for n in names], [self.posted[n] for n in names])
            apply(mean)
            torch._foreach_add_([live[n] for n in names], since)
        for name in ("bytes_up", "bytes_down", "upload_s", "download_s", "seconds_waiting", "calls", "reposts"):
            setattr(stats, name, getattr(stats, name) + getattr(self.stats, name))
        stats.seconds += waited


def _run(future: Future, call: Callable, *args) -> None:
    try:
        future.set_result(call(*args))
    except BaseException as exc:  # handed to the join, which raises it in the training thread
        future.set_exception(exc)


def post(collective: Callable[[dict[str, torch.Tensor], TransferStats], dict[str, torch.Tensor]],
         payload: dict[str, torch.Tensor], live: dict[str, torch.Tensor], round_: int, step: int) -> PendingRound:
    """Start `collective(payload, stats)` on a thread of its own with what it reads copied, and
    keep the live tensors as posted. The thread is a daemon: a replica that leaves (a notice, an
    error) while a round is in flight is not held at exit by a collective waiting for peers."""
    stats, future = TransferStats(), Future()
    posted = {n: t.detach().clone() for n, t in live.items()}
    threading.Thread(target=_run, args=(future, collective, _own(payload, live, posted), stats),
                     name=f"zooid-round-{round_}", daemon=True).start()
    return PendingRound(future, posted, stats, round_, step)
