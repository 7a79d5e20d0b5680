"""One billed interval of a run (`CostRecord`): made by the launchers, the warm pool and the
cloud clocks, kept in the run's state, written to `runs/<run_id>/cost.json` by the bill
(`coordinator.bill.cost`) and read back by resume and the report. A store's row bills its
requests as `fixed_usd` (with their counts in `store_ops`) and a store server by the second."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class CostRecord:
    """One billed interval."""

    run_id: str
    resource: str
    """e.g. `worker e1 r0 a0`, `coordinator`."""
    kind: str
    """`worker`, `coordinator`, `failed_attempt`, `failed_placement` or `store`. A worker row's
    `status` is `preempted` for an attempt the provider took back (it may have handed over)."""
    # A warm worker's rows split its life: status `startup`, `busy`, `idle` (and a failed
    # attempt's `failed_attempt` row); together they cover its launch to its stop.
    offer: str
    start: float
    stop: float
    unit_price_per_s: float
    status: str = "completed"
    epoch: int | None = None
    rank: int | None = None
    attempt: int | None = None
    worker: str = ""
    """The worker process or flow run the interval belongs to (warm workers, cloud clocks)."""
    fixed_usd: float = 0.0
    """Dollars billed by the unit, not by the second (a store's requests), on top of the
    interval's."""
    store_ops: dict = field(default_factory=dict)
    """A store row's request counts (`core.store_ops.StoreOps.to_dict`) that `fixed_usd` prices."""
    redone_s: float = 0.0
    """A worker row: the seconds of training this attempt repeated because the one before it
    was preempted (`coordinator.workers.preemptions`; 0 after a clean handover)."""
    capacity: str = ""
    """A worker row: the capacity it ran on (`core.kinds.Capacity`; "": not recorded, on-demand)."""
    list_price_per_s: float = 0.0
    """A worker row: what the same worker costs a second on-demand (0: `unit_price_per_s`), against
    which a spot row's saving is counted (`coordinator.bill.cost.spot_tally`)."""

    @property
    def seconds(self) -> float:
        return max(0.0, self.stop - self.start)

    @property
    def usd(self) -> float:
        return self.seconds * self.unit_price_per_s + self.fixed_usd

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["seconds"] = round(self.seconds, 6)
        d["usd"] = self.usd
        return d
