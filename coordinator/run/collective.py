"""How a job's replicas average: the store collectives or a direct ring (the job's `collective`).

`store` and `ring` are the user's choice; `auto` lets the planner compare the two for each plan
of several replicas, by predicted epoch time and dollars, the store's requests included
(`planners.strategy.over_collectives`; the ring makes none). The planner considers the ring only
where it can run and is allowed (`ring_refusal`), and the plan it chooses names its collective
(`Plan.collective`), which the workers' specs follow (`uses_ring`).
"""
from __future__ import annotations

from clouds.registry import is_cloud
from core.kinds import Capacity
from core.plan import Plan

AUTO = "auto"
STORE = "store"
RING = "ring"


def ring_refusal(job, target) -> str:
    """Why `collective=auto` may not put `job`'s syncs on the ring on `target` (a
    `ComputeTarget`), in a few words; empty when it may:

    - a compressed `sync_dtype` travels through the store (the ring moves float32);
    - a cloud target's workers are not known to reach each other (`collective=ring` says they do);
    - spot capacity (where the job has it) relaunches a reclaimed worker alone mid-epoch, which
      only the store collective takes (a ring reruns the epoch)."""
    if job.sync_dtype != "float32":
        return f"sync_dtype {job.sync_dtype} travels through the store"
    if is_cloud(target):
        return (f"workers on target kind {target.kind} are not known to reach each other "
                f"(collective=ring says they do)")
    capacity = getattr(job, "capacity", Capacity.ON_DEMAND)
    if capacity != Capacity.ON_DEMAND:
        return f"capacity {capacity}: a reclaimed worker is relaunched alone, which only the store takes"
    return ""


def planned_collectives(job, target) -> tuple[tuple[str, ...], str]:
    """The collectives the planner compares for `job` on `target`, and why the ring is not
    among them under `auto` (empty otherwise): the job's own when it names one."""
    if job.collective != AUTO:
        return (job.collective,), ""
    why = ring_refusal(job, target)
    return ((STORE,), why) if why else ((STORE, RING), "")


def uses_ring(job, plan: Plan) -> bool:
    """Whether `plan`'s replicas average over the ring: the job's `collective=ring`, or the
    planner's choice under `auto`."""
    return job.collective == RING or (job.collective == AUTO and plan.collective == RING)
