"""How often rank 0 writes a Local-SGD sync checkpoint over the store.

A sync checkpoint only matters when a worker is lost with nothing handed over (a crash, or a
preemption whose notice leaves no time to hand over): its replacement resumes from the last one
and replays the rounds since. Written every round, it costs a request on the durable store and a
stall of the step after it each round; written rarely, a crash redoes more. Young's first-order
optimum balances the two: with a checkpoint costing `delta` seconds of the group's time and hard
failures arriving at `lam` per second across the group, the interval

    T* = sqrt(2 * delta / lam)

minimises the expected loss per second, `delta / T + lam * T / 2` (Young, 1974; Daly's
higher-order terms change T* by under 1 % while delta << 1 / lam, as here). Here `delta` is the
measured stall of the step after a checkpoint's write (`profiling.store_probe`) plus the
request's price in seconds of the group's bill, and `lam` counts crashes at the catalog's
assumed rate (`ASSUMED_CRASH_RATE_PER_WORKER_HOUR`) and, on spot capacity, interruptions whose
notice leaves no time to hand over (`core.notice.work_through_s`: a worker with working time
hands over its own state, which needs no sync checkpoint).

The interval's clock starts at each epoch's start, whose checkpoint is one; the epoch's last
round is not checkpointed as such (the epoch checkpoint follows it, and a rank lost in between
replays the rounds kept since the last checkpoint), and one is written sooner when the rounds
kept for a replay reach their bound (`engine.local_sgd_epoch.cadence_for`).

A compressed sync (bfloat16, int8) keeps to rounds instead: every rank writes its error-feedback
residual at the rounds rank 0 checkpoints, so the ranks must agree on them, which no rank's own
clock gives. The interval becomes a count of rounds at the plan's pace
(`rounds_between_checkpoints`), which every rank of an epoch is given; the epoch's last round is
checkpointed with the residuals the next epoch continues from. Written every round, as before
this count, an int8 sync of `gpt_mini` put three objects on the durable store a round (rank 0's
checkpoint and each rank's residual, all float32) beside its quarter-size pieces.
"""
from __future__ import annotations

import math

ASSUMED_CRASH_RATE_PER_WORKER_HOUR = 1e-3
"""Assumed: a worker lost with nothing handed over (a crash, an out-of-memory kill, a lost node)
once in 1,000 worker-hours; no run of Zooid has measured it."""
MIN_INTERVAL_S = 1.0
"""The shortest interval: at most one sync checkpoint a second, as over the ring."""
MAX_INTERVAL_S = 86400.0
"""The longest (a day): where nothing is expected to fail, the epochs' own checkpoints alone."""


def young_interval_s(checkpoint_cost_s: float, failures_per_s: float) -> float:
    """Young's optimum `sqrt(2 * cost / rate)`; infinite where nothing fails."""
    if failures_per_s <= 0:
        return math.inf
    return math.sqrt(2.0 * max(0.0, checkpoint_cost_s) / failures_per_s)


def sync_checkpoint_interval_s(*, workers: int, checkpoint_s: float | None, put_usd: float,
                               price_per_worker_s: float, spot_rate_per_worker_hour: float = 0.0,
                               handover: bool = True,
                               crash_rate_per_worker_hour: float = ASSUMED_CRASH_RATE_PER_WORKER_HOUR) -> float:
    """The interval in seconds between a replica group's sync checkpoints (module docstring):
    `workers` replicas, `checkpoint_s` the measured stall of the step after a write (None: not
    measured, 0), `put_usd` the requests of one checkpoint on the durable store, the group's
    price `workers x price_per_worker_s`; on spot, `spot_rate_per_worker_hour` interruptions,
    hard failures only where the worker cannot `handover` within its notice."""
    workers = max(1, int(workers))
    group_usd_per_s = workers * max(0.0, price_per_worker_s)
    cost_s = max(0.0, checkpoint_s or 0.0) + (put_usd / group_usd_per_s if group_usd_per_s > 0 else 0.0)
    rate_per_hour = crash_rate_per_worker_hour + (0.0 if handover else max(0.0, spot_rate_per_worker_hour))
    return min(MAX_INTERVAL_S, max(MIN_INTERVAL_S, young_interval_s(cost_s, workers * rate_per_hour / 3600.0)))


def checkpoints_per_epoch(rounds: int, epoch_s: float, interval_s: float) -> int:
    """Sync checkpoints one epoch of `rounds` rounds over `epoch_s` seconds writes at `interval_s`:
    one at each interval since the epoch's start (whose checkpoint starts the clock; the last
    round is not due as such, `engine.local_sgd_epoch.cadence_for`), never more than one a round;
    every round when `interval_s` is 0."""
    if rounds <= 0:
        return 0
    if interval_s <= 0:  # by rounds, every one
        return rounds
    return min(rounds, math.floor(max(0.0, epoch_s) / interval_s))


def rounds_between_checkpoints(interval_s: float, epoch_s: float, rounds: int) -> int:
    """A compressed sync's checkpoint cadence in rounds (module docstring): as many rounds as
    `interval_s` holds at the pace of an epoch of `rounds` rounds in `epoch_s` seconds, at least
    one; every round where the interval is 0 (the job's `sync_checkpoint_s` 0) or the pace is
    not known."""
    if interval_s <= 0 or epoch_s <= 0 or rounds <= 0:
        return 1
    if math.isinf(interval_s):
        return rounds
    return max(1, math.floor(interval_s * rounds / epoch_s))
