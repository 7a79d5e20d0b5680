"""A Local-SGD round whose collective runs behind the next round's steps (`sync.overlap`).

Without overlap a replica waits at every sync for the collective (the puts, the peers'
pieces, the gets) and starts the next round from its result. With overlap, round t's
collective runs on a thread while the replica trains round t + 1 from its own weights; at the
end of round t + 1 it joins round t and re-bases: its tensors become round t's result plus what
round t + 1 changed in them since they were posted,

    θ_i ← R(t) + (θ_i − θ_i(posted t)),

and round t + 1's change is posted against R(t) (the outer step's snapshot). The outer step
(`engine.outer`) is the same one, applied one round late: each round's mean change drives it
exactly once, and each replica's steps run on weights that miss only the last round's
average (the delayed-update variant of DiLoCo, Streaming DiLoCo's overlapped
communication). The epoch's last round is joined at once with nothing trained since its post,
so every replica ends the epoch with the same tensors, as without overlap, and the epoch
checkpoint, the next epoch and a rescale see equal weights.

What the replica waits for is what the join waits for: the collective's time less the steps
it hid. `join` counts that as the round's sync seconds and adds the thread's bytes and calls.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Callable

import torch

from comm.bandwidth import TransferStats


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
        mean = self.future.result()
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
