"""What a run will take and cost, start-up included: the plan's epoch as the sum of its parts.

The strategy planners predict the workers' compute and communication per epoch (the
plan's `predicted_compute_epoch_s`). A user pays for more: the workers' start-up (cold, or
once when they stay warm), the per-epoch overhead around the compute (sending the epoch,
loading data, validating, writing the checkpoint, collecting replies), the coordinator's
time between epochs, before the first and after the last, and the coordinator itself,
billed like one worker. `RunTerms` holds those figures, measured on the target and offer
(cached from earlier runs, `coordinator.plan.run_terms`) or assumed until measured; `predict_run`
turns a plan and the terms into the epoch's wall time and the whole run's time and bill.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Sequence

from core.plan import Plan


@dataclass(frozen=True, kw_only=True)
class RunTerms:
    """Per target and offer: seconds a run spends outside the workers' compute."""

    startup_s: float
    """A worker's launch to ready (imports, model, CUDA context)."""
    epoch_overhead_s: float
    """Epoch wall time beyond the slowest worker's compute and sync: dispatch, data,
    validation, checkpoint, replies."""
    gap_s: float
    """Coordinator seconds between two epochs (checkpoint, rescale, history, bill)."""
    provision_s: float
    """Coordinator seconds from the plan to the first epoch sent."""
    teardown_s: float
    """Coordinator seconds after the last epoch (workers stopped, ledger, report)."""
    stop_s: float = 1.0
    """A worker's seconds from the last epoch's end to its stop."""
    warmup_s: float = 0.0
    """What a worker's first epoch adds: building the model, reading its data, first calls."""
    exposed_s: float | None = None
    """Start-up the first epoch waited for, as measured by earlier runs on this target (None:
    not measured; `startup_s` less what the plan and provisioning hide is taken instead)."""
    startup_one_s: float | None = None
    """A typical single worker's start-up (the median of the samples; None: `startup_s`), the
    base that `started_together` stretches where workers share the coordinator's cores."""
    own_store_ops: dict = field(default_factory=dict)
    """The run's own store requests beyond its epochs' protocol and warm channel, by part
    (`epoch`, `staging`, `teardown`) and store role, as earlier runs on this target measured
    them (`coordinator.plan.own_requests`); empty until one did."""
    measured: dict = field(default_factory=dict)
    """Term name -> True where measured on this target and offer, False where assumed."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True, kw_only=True)
class RunPrediction:
    epoch_s: float
    """A steady-state epoch's wall time (what `EpochSummary.seconds` measures)."""
    first_epoch_s: float
    """The first epoch, with the start-up it cannot hide."""
    run_s: float
    """From now to the run's end."""
    worker_s: float
    """Worker-seconds billed from now on."""
    cost_usd: float
    """The whole run's bill: what is already billed plus workers and coordinator from now on."""
    cost_by_epoch_usd: tuple[float, ...] = ()
    """The bill at the end of each of the epochs (before teardown): what is already billed plus
    workers and coordinator up to that epoch's end."""
    store_usd: float = 0.0
    """The store's part of `cost_usd`: each epoch's requests and its server for the run."""


def started_together(terms: RunTerms, workers: int, host_cores: int | None) -> float:
    """Seconds until the last of `workers` workers launched at once is ready. Where they share
    a host of `host_cores` cores with the coordinator (None: each has its own machine), a
    start-up is mostly CPU (imports, the model): each of the `workers` starts, beside the
    coordinator, gets `host_cores / (workers + 1)` of the cores, so a single start-up stretches
    by `(workers + 1) / host_cores` when that exceeds 1; never less than the slowest start-up
    measured (`startup_s`, which may hold such starts already)."""
    if not host_cores or workers <= 0:
        return terms.startup_s
    one = terms.startup_s if terms.startup_one_s is None else terms.startup_one_s
    return max(terms.startup_s, one * max(1.0, (workers + 1) / host_cores))


def predict_run(plan: Plan, terms: RunTerms, *, epochs: int, warm: bool, workers_launched_s: float | None,
                billed_usd: float = 0.0, coordinator_price_per_s: float | None = None,
                per_epoch: Sequence[Plan] | None = None, host_cores: int | None = None,
                store_usd_per_epoch: float = 0.0, store_usd_per_s: float = 0.0, store_usd_before: float = 0.0,
                store_usd_after: float = 0.0) -> RunPrediction:
    """The run's time and bill for `epochs` more epochs of `plan`, from now.

    Warm: the workers (launched `workers_launched_s` seconds ago; None: launched at the
    plan) are ready after `startup_s`; the first epoch is sent after `provision_s` and
    waits for what start-up is left; each worker is billed until `stop_s` after the last
    epoch. Cold: every epoch starts its workers again, each billed for its start-up and the
    epoch. The coordinator is billed over the whole run like one worker
    (`coordinator_price_per_s`, default the plan's worker price). `billed_usd` is what the
    run has used up to now (the ledger, open worker intervals, the coordinator so far): the
    prediction adds what is to come.

    `per_epoch`: the plan of each of the `epochs` epochs where a scaling policy decided in
    advance (adabatch) changes the worker count (default: `plan` throughout). A warm run's
    added workers are started during the epoch before theirs (pre-start: billed from their
    launch, the start-up that epoch and its gap do not cover is waited for), pay the first
    epoch's warm-up, and workers no longer needed stop after `stop_s`; where they share the
    coordinator's `host_cores`, the workers added together start slower (`started_together`).

    The store: `store_usd_per_epoch` for each epoch's requests (`planners.store_requests`
    priced by `planners.store_prices`), `store_usd_per_s` for its server over the run, and the
    run's own requests before its first epoch and after its last (`store_usd_before`, `_after`:
    staging and teardown, `coordinator.plan.own_requests`)."""
    if epochs < 0:
        raise ValueError(f"epochs: must be >= 0, got {epochs}")
    plans = list(per_epoch) if per_epoch is not None else [plan] * epochs
    if len(plans) != epochs:
        raise ValueError(f"per_epoch: must hold one plan per epoch ({epochs}), got {len(plans)}")
    coordinator_price = plan.price_per_worker_s if coordinator_price_per_s is None else coordinator_price_per_s
    t, usd, worker_s, prev_dur = terms.provision_s, 0.0, 0.0, 0.0
    ends, workers_usd_by_epoch, first = [], [], None
    for i, p in enumerate(plans):
        epoch_s = p.predicted_compute_epoch_s + terms.epoch_overhead_s
        price = p.price_per_worker_s
        if not warm:
            dur, start = epoch_s + terms.startup_s + terms.warmup_s, t + (terms.gap_s if i else 0.0)
            billed = p.workers * dur
        elif i == 0:
            launched = 0.0 if workers_launched_s is None else workers_launched_s
            exposed = (terms.exposed_s if terms.exposed_s is not None
                       else max(0.0, terms.startup_s - launched - terms.provision_s))
            dur, start = epoch_s + exposed + terms.warmup_s, t
            billed = p.workers * (t + dur)  # billed from the plan on
        else:
            before = plans[i - 1]
            added, kept = max(0, p.workers - before.workers), min(p.workers, before.workers)
            startup = started_together(terms, added, host_cores)
            hidden = min(startup, prev_dur + terms.gap_s) if added else 0.0
            exposed = startup - hidden if added else 0.0
            dur, start = epoch_s + exposed + (terms.warmup_s if added else 0.0), t + terms.gap_s
            billed = (kept * (terms.gap_s + dur) + added * (startup - exposed + dur)
                      + max(0, before.workers - p.workers) * terms.stop_s)
        worker_s, usd = worker_s + billed, usd + billed * price
        t, prev_dur = start + dur, dur
        ends.append(t)
        first = dur if first is None else first
        workers_usd_by_epoch.append(usd)
    if warm:  # the last workers stop after the last epoch (with no epoch: started, then stopped)
        last = plans[-1] if plans else plan
        tail = terms.stop_s + (0.0 if plans else terms.provision_s)
        worker_s, usd = worker_s + last.workers * tail, usd + last.workers * tail * last.price_per_worker_s
    run_s = t + terms.teardown_s  # (t: the last epoch's end, or the provisioning's with no epoch)
    if first is None:
        first = plan.predicted_compute_epoch_s + terms.epoch_overhead_s + (
            terms.warmup_s + (0.0 if warm else terms.startup_s))
    steady = plan.predicted_compute_epoch_s + terms.epoch_overhead_s + (
        0.0 if warm else terms.startup_s + terms.warmup_s)
    store = store_usd_before + epochs * store_usd_per_epoch + run_s * store_usd_per_s + store_usd_after
    cost = billed_usd + usd + run_s * coordinator_price + store
    cost_by_epoch = tuple(billed_usd + w + e * (coordinator_price + store_usd_per_s) + store_usd_before
                          + (i + 1) * store_usd_per_epoch for i, (w, e) in enumerate(zip(workers_usd_by_epoch, ends)))
    return RunPrediction(epoch_s=steady, first_epoch_s=first, run_s=run_s, worker_s=worker_s, cost_usd=cost,
                         cost_by_epoch_usd=cost_by_epoch, store_usd=store)


def with_run_prediction(plan: Plan, terms: RunTerms, store_ops: dict | None = None, store_billed_usd: float = 0.0,
                        **kwargs) -> Plan:
    """`plan` with its epoch and run predictions start-up aware (`predict_run`); `store_ops`:
    one epoch's store requests by kind, kept beside the store's dollars; `store_billed_usd`: the
    store's part of `billed_usd` (the profile's requests), so that `predicted_store_usd` is the
    whole run's, as `predicted_run_cost_usd` is."""
    p = predict_run(plan, terms, **kwargs)
    return dataclasses.replace(plan, predicted_store_usd=store_billed_usd + p.store_usd,
                               predicted_store_ops=dict(store_ops or {}), predicted_epoch_s=p.epoch_s,
                               predicted_cost_per_epoch_usd=p.epoch_s * plan.workers * plan.price_per_worker_s,
                               predicted_run_s=p.run_s, predicted_run_cost_usd=p.cost_usd,
                               predicted_first_epoch_s=p.first_epoch_s,
                               predicted_cost_by_epoch_usd=p.cost_by_epoch_usd, run_terms=terms.to_dict())
