"""A worker's ledger rows on the cloud's clock.

Each cloud adapter (`clouds.registry.adapter_for`) turns its API's view of one worker's infrastructure (an ECS task, an ACI
container group, a pod) into a `CloudInterval`: when the cloud started billing, when it
stopped, and whether the worker was ever placed. `cloud_records` prices the intervals with
the catalog into `CostRecord` rows (each names its infrastructure id: `worker e0 r1 a0 on <id>`),
one per attempt (a retried epoch is billed for every
attempt), with placements that never started listed separately as `failed_placement` at
zero dollars. `replace_measured` swaps the coordinator's launch-to-exit estimates for the
cloud's own numbers where the cloud reported them. `CloudInterval` lives in `clouds.adapter`.
"""
from __future__ import annotations

import dataclasses
import re
import time
from typing import Iterable

from clouds.adapter import CloudInterval
from core.cost_record import CostRecord

_ATTEMPT_NAME = re.compile(r"-e(?P<epoch>\d+)-r(?P<rank>\d+)-a(?P<attempt>\d+)$")


def attempt_of(flow_run_name: str | None) -> tuple[int, int, int] | None:
    """(epoch, rank, attempt) from a worker flow run name `<run_id>-e<E>-r<R>-a<A>`."""
    m = _ATTEMPT_NAME.search(flow_run_name or "")
    return (int(m["epoch"]), int(m["rank"]), int(m["attempt"])) if m else None


def cloud_records(run_id: str, intervals: Iterable[CloudInterval], attempts: dict[str, tuple],
                  offer, price_per_s: float, now: float | None = None,
                  asked_to_stop: Iterable[str] = ()) -> list[CostRecord]:
    """Ledger rows from the cloud's clock.

    `attempts` maps a worker flow run id to its (epoch, rank, attempt[, price per second[,
    capacity, on-demand price per second]]), as the launcher knows it (the price of the size and
    capacity it launched, where a plan sizes its stages apart or runs it on spot); intervals of unknown flow runs (a straggler found by the sweep) are billed too,
    with no epoch, at `price_per_s`. A worker still running is billed up to `now`. A warm worker
    the coordinator told to stop with its work done (`asked_to_stop`: flow run ids) completed,
    whatever its exit: one that was still exiting when its container was stopped is no failed attempt.
    """
    now = time.time() if now is None else now
    asked_to_stop = set(asked_to_stop)
    rows = []
    for iv in intervals:
        known = attempts.get(iv.flow_run_id or "", (None, None, None))
        epoch, rank, attempt = known[:3]
        price = known[3] if len(known) > 3 else price_per_s
        capacity, list_price = (known[4], known[5]) if len(known) > 5 else ("", 0.0)
        infra = iv.resource.rsplit("/", 1)[-1]  # task, container group, pod or container id
        label = (f"e{epoch} r{rank} a{attempt}" if epoch is not None
                 else f"r{rank} on {infra}" if rank is not None else infra)
        if epoch is not None:
            label += f" on {infra}"
        if iv.status == "failed_placement":
            at = iv.created or iv.stopped or now
            rows.append(CostRecord(run_id=run_id, resource=f"placement {label}", kind="failed_placement",
                                   offer=offer.name, start=at, stop=iv.stopped or at, unit_price_per_s=0.0,
                                   status="failed_placement", epoch=epoch, rank=rank, attempt=attempt))
            continue
        start = iv.billed_from if iv.billed_from is not None else (iv.started or iv.created or now)
        status = "completed" if iv.status == "failed" and iv.flow_run_id in asked_to_stop else iv.status
        kind = "failed_attempt" if status == "failed" else "worker"  # running: billed up to now
        rows.append(CostRecord(run_id=run_id, resource=f"worker {label}", kind=kind, offer=offer.name,
                               start=start, stop=iv.stopped if iv.stopped is not None else now,
                               unit_price_per_s=price, status=status, epoch=epoch, rank=rank,
                               attempt=attempt, worker=iv.flow_run_id or "", capacity=capacity,
                               list_price_per_s=list_price))
    return rows


def replace_measured(rows: list[CostRecord], cloud_rows: list[CostRecord]) -> list[CostRecord]:
    """The ledger with each worker attempt the cloud reported billed on the cloud's clock.

    Rows of the same (epoch, rank, attempt) measured by the coordinator, every row of a warm
    worker whose flow run the cloud reported, and the rows an earlier reading made of the same
    resource (a failed placement is listed once, however often the run is billed) are dropped
    in favour of the cloud's; every other row (coordinator, attempts the cloud no longer lists)
    is kept.
    """
    reported = {(r.epoch, r.rank, r.attempt) for r in cloud_rows if r.epoch is not None}
    workers = {r.worker for r in cloud_rows if r.worker}  # a warm worker: every row of its life
    resources = {r.resource for r in cloud_rows}  # the cloud's own rows of an earlier reading
    kept = [r for r in rows if r.resource not in resources and (
            r.kind not in ("worker", "failed_attempt")
            or ((r.epoch, r.rank, r.attempt) not in reported and not (r.worker and r.worker in workers)))]
    # what the epoch's end marked on a row (`coordinator.workers.preemptions`) outlives a re-reading
    marked = {r.resource: r for r in rows if r.status == "preempted" or r.redone_s}
    # a warm worker preempted outside an epoch (idle, profiling): the warm pool's last row of it says
    # so, and its whole life on the cloud's clock (no epoch) is that preempted interval
    for r in rows:
        if r.status == "preempted" and r.worker and r.epoch is None:
            for c in cloud_rows:
                if c.worker == r.worker and c.epoch is None and c.resource not in marked:
                    marked[c.resource] = r
    return kept + [_marks_of(marked.get(r.resource), r) for r in cloud_rows]


def _marks_of(before: CostRecord | None, row: CostRecord) -> CostRecord:
    """`row` with the preemption marks an earlier reading of its resource carried."""
    if before is None:
        return row
    marks = {"redone_s": before.redone_s}
    if before.status == "preempted":
        marks.update(status="preempted", kind="worker")
    return dataclasses.replace(row, **marks)
