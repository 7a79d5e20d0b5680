"""Spot preemptions within one epoch: which capacity a preempted worker's replacement runs on,
the work the replacements did again, and the ledger's marks.

A worker the provider takes back (`coordinator.workers.failures.FailureKind.PREEMPTED`) is
replaced at once: a Local-SGD replica alone (its replacement continues from its handover, or
from the epoch's sync checkpoint when it had no grace), a pipeline stage or a ring's rank by
rerunning the epoch's attempt (`coordinator.workers.epoch_run.run_epoch_on_target`). The
replacement runs on spot again until that rank was preempted `before_on_demand` times in the
epoch (the job's `spot_preemptions_before_on_demand`, default `SPOT_PREEMPTIONS_BEFORE_ON_DEMAND`),
then on-demand. Preemptions never count against the crash relaunch limit.

The ledger (`core.cost_record.CostRecord`) marks a preempted attempt's interval with status
`preempted` and each replacement's row with `redone_s`: the seconds of training it repeated,
from the step its predecessor reached (the preempted or injected fault's marker) back to the
step it started from (its history record; 0 for a rerun attempt of a pipeline), at its own
seconds per step. A clean handover leaves 0.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable

from core.cost_record import CostRecord
from core.kinds import Capacity
from core.specs import WorkerSpec

SPOT_PREEMPTIONS_BEFORE_ON_DEMAND = 2
"""A rank preempted this many times in one epoch is replaced on on-demand capacity."""

PREEMPTED = "preempted"
"""The ledger status of a preempted attempt's interval."""


def spot_spares(job, plan) -> int:
    """The warm spares `plan` keeps on spot capacity (`coordinator.workers.warm_pool`): the job's
    `spot_spares`; none where the plan sizes each stage apart (no one launch that every rank
    shares)."""
    if getattr(plan, "stage_memory_gb", ()):
        return 0
    return int(getattr(job, "spot_spares", 0) or 0)


def before_on_demand(job) -> int:
    """The job's `spot_preemptions_before_on_demand` (the default where the job has none)."""
    value = getattr(job, "spot_preemptions_before_on_demand", None)
    return SPOT_PREEMPTIONS_BEFORE_ON_DEMAND if value is None else int(value)


class Preemptions:
    """One epoch's preemptions by rank, and the capacity each rank's next attempt runs on."""

    def __init__(self, before_on_demand: int = SPOT_PREEMPTIONS_BEFORE_ON_DEMAND):
        self.before_on_demand = before_on_demand
        self.counts: dict[int, int] = {}

    def record(self, rank: int) -> int:
        """Count one preemption of `rank`; return its count in the epoch."""
        self.counts[rank] = self.counts.get(rank, 0) + 1
        return self.counts[rank]

    def capacity(self, rank: int, planned: str) -> str:
        """What `rank`'s next attempt runs on: `planned`, or on-demand once a spot rank was
        preempted `before_on_demand` times."""
        if planned == Capacity.SPOT and self.counts.get(rank, 0) >= self.before_on_demand:
            return str(Capacity.ON_DEMAND)
        return planned

    def respec(self, spec: WorkerSpec) -> WorkerSpec:
        """`spec` on the capacity its rank's next attempt runs on."""
        capacity = self.capacity(spec.rank, spec.capacity)
        return spec if capacity == spec.capacity else dataclasses.replace(spec, capacity=capacity)

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def reached_step(marker: dict | None) -> int | None:
    """The step a preempted attempt had reached, from its preempted or fault marker."""
    return None if not marker or marker.get("step") is None else int(marker["step"])


def redone_seconds(reached: int | None, start_step: int, seconds_per_step: float) -> float:
    """Training seconds a replacement repeats: the steps between where it started and where its
    predecessor had got to, at its own pace; 0 when the predecessor's reach is unknown or the
    replacement started there (a clean handover)."""
    if reached is None:
        return 0.0
    return max(0, reached - start_step) * max(0.0, seconds_per_step)


def mark_ledger(rows: list[CostRecord], epoch: int, preempted: Iterable[tuple[int, int]],
                redone: dict[tuple[int, int], float],
                priced: dict[tuple[int, int], tuple[str, float, str, float]] | None = None,
                workers: Iterable[str] = ()) -> list[CostRecord]:
    """The ledger with epoch `epoch`'s preempted attempts' rows (`(rank, attempt)`) at status
    `preempted`, the replacements' rows with their `redone_s`, and each attempt in `priced` billed
    as what it ran on (offer name, dollars per second, capacity, the on-demand dollars per second
    of the same worker: a spot attempt, a replacement moved to on-demand); a warm worker's row on
    the cloud's clock (no epoch: its whole life) is marked through `workers`, the ids (`worker`) of
    preempted warm workers; every other row as it was."""
    preempted, priced, workers = set(preempted), priced or {}, set(workers)
    out, credited = [], set()
    for r in rows:
        key = (r.rank, r.attempt)
        if r.worker and r.worker in workers and r.epoch is None and r.kind in ("worker", "failed_attempt"):
            out.append(dataclasses.replace(r, status=PREEMPTED, kind="worker"))
            continue
        if r.epoch != epoch or r.kind not in ("worker", "failed_attempt") or r.attempt is None:
            out.append(r)
            continue
        changes: dict = {}
        if key in preempted:
            changes.update(status=PREEMPTED, kind="worker")
        if redone.get(key) and key not in credited:  # once per attempt, on its first row
            changes["redone_s"] = redone[key]
            credited.add(key)
        if key in priced:
            offer, price, capacity, list_price = priced[key]
            changes.update(offer=offer, unit_price_per_s=price, capacity=capacity, list_price_per_s=list_price)
        out.append(dataclasses.replace(r, **changes) if changes else r)
    return out
