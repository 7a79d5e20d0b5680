"""Continue a run from its last complete checkpoint (`resume=<run_id>`, or a Prefect retry of
the same flow run, which derives the same run id).

What the run left in the store says where to go on: `history.json` holds the epochs done, the
last of them naming the last complete epoch checkpoint (written after it was verified,
`coordinator.workers.retention`), `cost.json` what was billed. If the
epoch after it had started, its Local-SGD workers continue from that epoch's last sync
checkpoint (`ckpt/sync-e<E>`), so at most one sync interval of work is repeated.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from coordinator.run.context import RunContext
from core.cost_record import CostRecord
from core.epoch_summary import EpochSummary
from core.errors import ZooidValueError
from core.keys import (
    attempt_of,
    faults_prefix,
    history_key,
    init_checkpoint_key,
    ledger_key,
    run_doc_key,
    sync_checkpoint_key,
    worker_history_prefix,
)


@dataclass
class ResumePoint:
    """Where a resumed run starts."""

    next_epoch: int
    init_key: str
    lr: float
    workers: int
    history: list[EpochSummary] = field(default_factory=list)
    ledger: list[CostRecord] = field(default_factory=list)
    mid_epoch: bool = False
    """Whether `next_epoch` had started (its workers resume from its sync checkpoint; with another
    worker count, as a new phase over the samples the old ones had not reached)."""
    max_attempt: int = -1
    """Highest worker attempt number already used in `next_epoch`."""
    plan: dict = field(default_factory=dict)
    """The plan the run was using (a resumed epoch keeps it when the worker count is unchanged)."""


def write_history(store, run_id: str, history: list[EpochSummary]) -> None:
    """The per-epoch history so far (rewritten atomically after every epoch)."""
    store.put(history_key(run_id), json.dumps([e.to_dict() for e in history], default=str).encode())


def read_history(store, run_id: str) -> list[EpochSummary]:
    """The per-epoch history `write_history` wrote (empty when none)."""
    return [EpochSummary.from_dict(e) for e in (_json(store, history_key(run_id)) or [])]


def _json(store, key: str):
    return json.loads(store.get(key)) if store.exists(key) else None


def _attempts(ctx: RunContext, epoch: int) -> list[int]:
    """The attempt numbers `epoch`'s workers left records or markers of, on the run's store
    (`core.keys`: the workers' records; none where that store lost its keys)."""
    store = ctx.open_store()
    try:
        keys = store.list(worker_history_prefix(ctx.run_id, epoch)) + store.list(faults_prefix(ctx.run_id) + "/")
    finally:
        store.close()
    return [a for k in keys if (a := attempt_of(k, epoch)) is not None]


def find_resume_point(ctx: RunContext, *, required: bool) -> ResumePoint | None:
    """The resume point of `ctx.run_id`, or None when the run has not started (an error
    naming `resume` when `required`)."""
    store = ctx.open_durable()
    try:
        run = _json(store, run_doc_key(ctx.run_id))
        if run is None:
            if required:
                raise ZooidValueError("resume", f"no run {ctx.run_id!r} in {ctx.store_ref.split('@')[-1]}")
            return None
        old = run["job"]
        for name in ("model", "dataset", "batch_size", "optimizer", "seed"):
            if old.get(name) != getattr(ctx.job, name):
                raise ZooidValueError("resume", f"run {ctx.run_id} trained {name}={old.get(name)!r}, "
                                      f"this job asks {getattr(ctx.job, name)!r}")
        history = read_history(store, ctx.run_id)
        latest = ({"epoch": history[-1].epoch, "key": history[-1].checkpoint_key} if history
                  else {"epoch": -1, "key": init_checkpoint_key(ctx.run_id)})
        ledger = []
        doc = _json(store, ledger_key(ctx.run_id))
        if doc:
            fields = CostRecord.__dataclass_fields__
            ledger = [CostRecord(**{k: v for k, v in r.items() if k in fields}) for r in doc["rows"]]
        nxt = latest["epoch"] + 1
        attempts = _attempts(ctx, nxt)
        last = history[-1] if history else None
        decision = last.rescale if last is not None else None
        return ResumePoint(next_epoch=nxt, init_key=latest["key"], lr=decision.lr if decision else ctx.job.lr,
                           workers=(decision.workers if decision else last.workers if last else ctx.job.workers),
                           history=history, ledger=ledger,
                           mid_epoch=store.exists(sync_checkpoint_key(ctx.run_id, nxt)),
                           max_attempt=max(attempts, default=-1),
                           plan=((last.plan if last else None) or run.get("plan") or {}))
    finally:
        store.close()
