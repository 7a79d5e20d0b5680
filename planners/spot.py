"""On-demand or spot: the expected re-done work of preemptions priced against the discount.

A spot worker costs less per second but is taken back now and then; each preemption costs a
replacement's start-up and some work done again. `choose_capacity` prices both for one plan:

- on-demand: `price_on_demand_per_s x worker_s`, where `worker_s` is the plan's workers times
  its predicted run;
- spot: `price_spot_per_s x (worker_s + preemptions x redo_worker_s)`, where
  `preemptions = rate_per_worker_hour x worker_s / 3600` and `redo_worker_s` is what one
  preemption costs in worker-seconds (`redo_worker_s`):
  - `handover` (Local-SGD over the store collective: the preempted replica hands its state over
    at its next step boundary and a replacement continues from there): the replacement's
    start-up, the other workers' wait for it at their next sync (`(workers - 1) x startup_s`)
    and about one step done again (`step_s`): `workers x startup_s + step_s`;
  - `rerun` (the ring collective, which takes no new rank, and a pipeline or hybrid, whose
    stages depend on each other every step: the epoch attempt is run again): on average half
    an epoch of every worker, plus every worker's wait for the replacement's start-up:
    `workers x (startup_s + epoch_s / 2)`.

With `spares` warm spares (`coordinator.workers.warm_pool`: each takes a preempted worker's rank
at once and a new one starts in its place), every spare is billed for the whole run at the spot
price, and a preemption waits for a start-up only when it finds no spare ready: when `spares` or
more other preemptions came within the last `startup_s` (the spares taken are still starting).
Preemptions arrive as a Poisson process of rate `rate x workers`, so that share is the Poisson
tail `P(N >= spares)` with mean `rate x workers x startup_s` (`waits_for_startup`); the start-up
terms above are multiplied by it. A spare is spot capacity too and is preempted like any worker
(its replacement is another spare's start, which no rank waits for); that and the CPU its start
takes from the ranks' are not modelled.

Working through the notice (`notice_s` > 0: a warm run, whose workers keep working after the
notice while their pool starts each one's successor, `coordinator.workers.warm_pool`): the
successor's start-up overlaps the preempted worker's last `core.notice.work_through_s(notice_s)`
seconds, so a preemption costs the successor's start-up (`startup_s`, billed beside the worker
it succeeds) and the others wait only for what is left of it, `exposed = max(0, startup_s -
work_through_s)`: `startup_s + workers x exposed + step_s` (`handover`), `startup_s + workers x
(exposed + epoch_s / 2)` (`rerun`). A notice in the run's last working time costs nothing: the
worker works through it to the run's end and no successor starts (the pool decides as late as a
successor's start-up allows, `coordinator.workers.warm_pool`), so for notices spread evenly over
a run of `run_s`, the cost is multiplied by `1 - work_through_s / run_s` (`replaced_share`). A
cold run's workers leave at once (`notice_s` 0).

Spot is chosen when its expected bill is below on-demand's. Pure: the caller passes the
prices, the plan's figures, and the rate (measured on the target where a run measured it,
else the catalog's assumed one).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from core.kinds import Capacity, Strategy
from core.notice import work_through_s

HANDOVER = "handover"
"""A preempted worker's replacement continues where it handed over (Local-SGD, store collective)."""
RERUN = "rerun"
"""A preemption reruns the epoch attempt (the ring collective, a pipeline, a hybrid)."""


@dataclass(frozen=True, kw_only=True)
class CapacityChoice:
    """Both capacities' predicted worker bills for one plan, and the one chosen."""

    capacity: str
    """`spot` or `on_demand` (`core.kinds.Capacity`)."""
    on_demand_usd: float
    """The workers' predicted bill on on-demand capacity."""
    spot_usd: float
    """The workers' predicted bill on spot capacity, the expected re-done work included."""
    expected_preemptions: float
    redo_worker_s: float
    """Worker-seconds one preemption costs (start-up, waits, work done again)."""
    spares: int = 0
    """Warm spares the spot bill includes (each for the whole run)."""
    recovery: str
    """`handover` or `rerun` (see the module)."""
    rate_per_worker_hour: float
    rate_measured: bool
    """The rate was measured on this target by earlier runs (False: the catalog's assumed one)."""
    spot_offer: str = ""
    reason: str = ""
    """Why the capacity was chosen (the job asked for it, or the bills compared)."""

    def to_dict(self) -> dict:
        return asdict(self)


def recovery_of(strategy: str, collective: str) -> str:
    """How a preempted worker's work is recovered: `handover` for Local-SGD over the store
    collective, `rerun` otherwise (the ring, a pipeline, a hybrid)."""
    return HANDOVER if strategy == Strategy.LOCAL_SGD and collective == "store" else RERUN


def waits_for_startup(spares: int, rate_per_worker_hour: float, workers: int, startup_s: float) -> float:
    """The share of preemptions that find no warm spare ready (see the module): 1 without spares."""
    if spares <= 0:
        return 1.0
    mean = max(0.0, rate_per_worker_hour) * workers * max(0.0, startup_s) / 3600.0
    below = sum(math.exp(-mean) * mean ** i / math.factorial(i) for i in range(spares))
    return max(0.0, 1.0 - below)


def replaced_share(run_s: float, notice_s: float) -> float:
    """The share of a run's preemptions whose worker needs a successor (see the module): with
    notice time, 1 - work_through_s / run_s for notices spread evenly over the run (none for a
    run no longer than the working time); 1 without notice time or a run time."""
    work_s = work_through_s(notice_s)
    if work_s <= 0 or run_s <= 0:
        return 1.0
    return max(0.0, 1.0 - work_s / run_s)


def redo_worker_s(recovery: str, workers: int, startup_s: float, step_s: float, epoch_s: float,
                  waits: float = 1.0, notice_s: float = 0.0, run_s: float = 0.0) -> float:
    """Worker-seconds one preemption costs on average (see the module); `waits`: the share of
    preemptions that wait for a start-up (`waits_for_startup`); `notice_s`: the notice the
    workers work through (0: they leave at once); `run_s`: the run's length, whose last working
    time's notices cost nothing (`replaced_share`; 0: not counted)."""
    startup_s *= waits
    work_s = work_through_s(notice_s)
    if work_s > 0:
        exposed = max(0.0, startup_s - work_s)
        waited = workers * exposed + step_s if recovery == HANDOVER else workers * (exposed + epoch_s / 2.0)
        return (startup_s + waited) * replaced_share(run_s, notice_s)
    if recovery == HANDOVER:
        return workers * startup_s + step_s
    return workers * (startup_s + epoch_s / 2.0)


def choose_capacity(*, asked: str, workers: int, run_s: float, epoch_s: float, steps_per_epoch: int,
                    startup_s: float, price_on_demand_per_s: float, price_spot_per_s: float,
                    rate_per_worker_hour: float, rate_measured: bool, strategy: str, collective: str,
                    spot_offer: str = "", spares: int = 0, notice_s: float = 0.0) -> CapacityChoice:
    """Both bills of a plan of `workers` workers running `run_s` seconds (epochs of `epoch_s`,
    `steps_per_epoch` steps each), and the capacity: `asked` itself where the job named one
    (`spot`, `on_demand`), else (`auto`) the cheaper expected bill (on-demand on a tie); the spot
    bill with `spares` warm spares and the workers working through `notice_s` (see the module)."""
    worker_s = workers * run_s
    preemptions = rate_per_worker_hour * worker_s / 3600.0
    recovery = recovery_of(strategy, collective)
    step_s = epoch_s / steps_per_epoch if steps_per_epoch else epoch_s
    redo = redo_worker_s(recovery, workers, startup_s, step_s, epoch_s,
                         waits_for_startup(spares, rate_per_worker_hour, workers, startup_s), notice_s, run_s)
    on_demand = price_on_demand_per_s * worker_s
    spot = price_spot_per_s * (worker_s + spares * run_s + preemptions * redo)
    if asked != Capacity.AUTO:
        capacity, reason = Capacity(asked), "the job's capacity"
    elif spot < on_demand:
        capacity, reason = Capacity.SPOT, "spot's expected bill, re-done work included, is below on-demand's"
    else:
        capacity, reason = Capacity.ON_DEMAND, "the expected re-done work outweighs spot's discount"
    return CapacityChoice(capacity=str(capacity), on_demand_usd=on_demand, spot_usd=spot, expected_preemptions=preemptions,
                          redo_worker_s=redo, spares=spares, recovery=recovery, rate_per_worker_hour=rate_per_worker_hour,
                          rate_measured=rate_measured, spot_offer=spot_offer, reason=reason)


def choice_words(choice: dict) -> str:
    """A plan's capacity choice (`CapacityChoice.to_dict`) in one line, both bills beside each other."""
    if not choice:
        return ""
    rate = (f"{choice['rate_per_worker_hour']:g} interruptions per worker-hour "
            f"({'measured on this target' if choice['rate_measured'] else 'assumed'})")
    return (f"Capacity: {choice['capacity']} ({choice['reason']}): on-demand ${choice['on_demand_usd']:.4f}, "
            f"spot ({choice['spot_offer']}) ${choice['spot_usd']:.4f} with {choice['expected_preemptions']:.2f} "
            f"expected preemptions at {rate}, each {choice['redo_worker_s']:.1f} worker-s redone "
            f"({choice['recovery']})" + (f", {choice['spares']} warm spare(s) included" if choice.get("spares") else "")
            + ".")
