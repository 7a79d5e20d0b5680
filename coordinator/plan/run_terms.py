"""The run's time outside the workers' compute, measured per target and offer and cached.

`planners.run_prediction.RunTerms` needs a worker's start-up, the per-epoch overhead and
the coordinator's provision, gap and teardown seconds, and the run's own store requests
(`coordinator.plan.own_requests`: counts, the next plan prices them). Each run measures them
(`RunClock`) and adds them to `cache/timings/<target key>.json` in the durable store (the
last `KEEP` samples of each); the next run's plan predicts from their medians (start-up: the 90th percentile, since an
epoch waits for the slowest of the workers starting together). A term never
measured on this target and offer is assumed (`ASSUMED`) and the plan says so. Where the
workers share the coordinator's machine, the start-up a first epoch waited for is measured and
cached too (`exposed_s`); a plan made while workers are already launched (a warm run's are:
they start before the profile) predicts from their launch times instead and does not read it.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import numpy as np

from coordinator.bill.cost import spot_tally
from coordinator.bill.ledger import store_ops_now
from coordinator.plan import own_requests
from coordinator.plan.profile_cache import ProfileCache, target_key
from core.epoch_summary import EpochSummary
from core.kinds import SHARED_HOST_KINDS, TargetKind
from planners.run_prediction import RunTerms

KEEP = 20

ASSUMED = {"startup_s": {TargetKind.INLINE: 3.0, TargetKind.PROCESS: 3.0, "cloud": 60.0}, "epoch_overhead_s": 0.5,
           "gap_s": {TargetKind.INLINE: 0.1, TargetKind.PROCESS: 0.1, "cloud": 0.5},
           "provision_s": {TargetKind.INLINE: 0.2, TargetKind.PROCESS: 0.2, "cloud": 1.0},
           "teardown_s": {TargetKind.INLINE: 1.0, TargetKind.PROCESS: 1.0, "cloud": 3.0}, "stop_s": 1.0,
           "warmup_s": {TargetKind.INLINE: 0.1, TargetKind.PROCESS: 0.1, "cloud": 1.0}}
"""What a term is taken to be until this target and offer measured it (seconds). The local
kinds' figures are this machine's, measured at a75e0bf on three runs each of digits_cnn 2x1,
5 epochs, warm (medians): inline gap 0.06, provision 0.06, teardown 0.91, warm-up 0.00; the
stack's process pool (its flow runs forked, `flows.flow_forks`) gap 0.06, provision 0.09,
teardown 0.95, warm-up 0.01, start-up 1.0 (3 s without the fork server). Warm workers start
before the profile, so a first epoch's warm-up is small wherever they are warm."""

TERMS = ("startup_s", "epoch_overhead_s", "gap_s", "provision_s", "teardown_s", "stop_s", "warmup_s")

INTERRUPTIONS_KEY = "interruptions_per_worker_hour"
"""The timings document's samples of spot interruptions per spot worker-hour measured on this
target and offer (one per run that rented spot workers; written with the other terms), which
`coordinator.plan.capacity` prices `capacity=auto` with instead of the catalog's assumed rate."""


def timings_key(ctx) -> str:
    return target_key(ctx, threads=0)


def _assumed(ctx, name: str) -> float:
    value = ASSUMED[name]
    if isinstance(value, dict):
        kind = ctx.resolved.target.kind
        return value.get(kind, value["cloud"])
    return value


def profile_estimates(ctx) -> dict:
    """What a first run on a target knows of its per-epoch overhead before any epoch ran, from
    what its profile measured there (empty where it did not profile on a worker): a command's
    round trip to a ready worker through the store (`RunState.dispatch_samples`), the
    validation pass rank 0 runs (the profile's forward seconds per row x the validation rows)
    and the epoch checkpoint's write (the store probe's). The warm-up is not estimated this
    way: a fresh worker's first epoch also imports the training code and reads its data, which
    the profile's own build of the model (milliseconds) does not show, so it stays assumed."""
    prof, state = ctx.state.profile, ctx.state
    if not prof or not state.dispatch_samples:
        return {}
    rows = prof.get("microbatch_size") or prof["batch_size"]
    return {"epoch_overhead_s": statistics.median(state.dispatch_samples)
            + float(prof.get("forward_s") or 0.0) / rows * ctx.resolved.n_val + float(prof.get("checkpoint_s") or 0.0)}


def load_terms(ctx, overhead_s: float | None = None) -> RunTerms:
    """The run terms for `ctx`'s target and offer: medians of the cached samples, this run's
    own start-up samples first; `overhead_s` (an epoch of this run measured it) replaces the
    cached per-epoch overhead. A per-epoch overhead this target has not measured yet comes from
    this run's profile where it took one (`profile_estimates`, marked `"profile"`), else is
    assumed, as are the other terms until measured."""
    cached = ProfileCache(ctx.open_durable).get("timings", timings_key(ctx)) or {}
    estimates = profile_estimates(ctx)
    values, measured = {}, {}
    exposed = list(cached.get("exposed_s") or ())
    values["exposed_s"] = statistics.median(exposed) if exposed and ctx.job.warm else None
    measured["exposed_s"] = values["exposed_s"] is not None
    for name in TERMS:
        samples = list(cached.get(name) or ())
        if name == "startup_s" and ctx.state.startup_samples:
            samples = list(ctx.state.startup_samples)
        if name == "epoch_overhead_s" and overhead_s is not None:
            samples = [overhead_s]
        if name == "startup_s" and samples:  # an epoch waits for the slowest of the workers starting together
            values[name] = float(np.quantile(samples, 0.9, method="higher"))
        elif not samples and name in estimates:
            values[name] = estimates[name]
        else:
            values[name] = statistics.median(samples) if samples else _assumed(ctx, name)
        measured[name] = bool(samples) or ("profile" if name in estimates else False)
        if name == "startup_s" and samples:
            values["startup_one_s"], measured["startup_one_s"] = statistics.median(samples), True
    own = {part: own_requests.median(list(cached.get(f"own_{part}_ops") or ())) for part in own_requests.PARTS}
    values["own_store_ops"] = {part: counts for part, counts in own.items() if counts}
    measured["own_store_ops"] = bool(values["own_store_ops"])
    return RunTerms(**values, measured=measured)


@dataclass
class RunClock:
    """The coordinator's marks of one run, turned into term samples at its end."""

    planned_at: float | None = None
    epochs: list = field(default_factory=list)
    """(sent, done) of each epoch the coordinator ran."""
    teardown_at: float | None = None
    first_epoch_fresh: bool = True
    """The run's first epoch was its workers' first (not a resumed run's)."""
    profiled: bool = False
    """A worker was started before the plan to take the profile (its start-up was hidden)."""
    store_roles: dict = field(default_factory=dict)
    """`{Store.where: role}` of the run's stores (`coordinator.plan.planning.RunStores.roles`)."""
    ops_at_plan: dict | None = None
    """The run's store requests by party and store at the plan (`coordinator.bill.ledger.store_ops_now`)."""
    epoch_ops: list = field(default_factory=list)
    """(requests at the epoch's send, its predicted requests by role, its protocol's role) of each epoch."""
    ops_at_end: dict | None = None
    """The run's requests at its end, the final ledger's and the summary's writes included."""
    idle_since: float | None = None
    """When the warm workers began waiting for their first command (their profile's reply)."""
    staged: dict = field(default_factory=dict)
    """The requests of staging the run's dataset by role (`own_requests.staged_files`)."""

    def plan_made(self, ctx, stores, idle_s: float, resumed: bool) -> None:
        """Mark the plan: the run's own requests on `stores` (`coordinator.plan.planning.RunStores`)
        are measured from here, the warm workers have waited `idle_s` for their first command, and
        a run not resumed stages its dataset (a resumed run's data may be there)."""
        self.store_roles, self.ops_at_plan = stores.roles, store_ops_now(ctx)
        self.idle_since = time.time() - idle_s
        self.staged = {} if resumed else stores.staged(ctx)

    def epoch(self, sent: float, done: float) -> None:
        self.epochs.append((sent, done))

    def samples(self, ctx, history: list[EpochSummary], ended_at: float) -> dict:
        out = {"startup_s": list(ctx.state.startup_samples)}
        if self.planned_at is not None and self.epochs:
            out["provision_s"] = [max(0.0, self.epochs[0][0] - self.planned_at)]
        out["gap_s"] = [max(0.0, b[0] - a[1]) for a, b in zip(self.epochs, self.epochs[1:])]
        if self.teardown_at is not None:
            out["teardown_s"] = [max(0.0, ended_at - self.teardown_at)]
        overheads = [e.overhead_s for e in history if e.overhead_s is not None]
        if ctx.job.warm and len(overheads) >= 2:  # a cold epoch's overhead holds a worker's first epoch
            steady = statistics.median(overheads[1:])
            out["epoch_overhead_s"] = overheads[1:]
            if self.first_epoch_fresh:
                out["warmup_s"] = [max(0.0, overheads[0] - steady)]
        if (ctx.job.warm and self.first_epoch_fresh and not self.profiled and history
                and ctx.resolved.target.kind in SHARED_HOST_KINDS):
            # the start-up the first epoch waited for (read only by a plan made before any worker launched)
            out["exposed_s"] = [float(history[0].startup.get("exposed_s") or 0.0)]
        rate = spot_tally([r.to_dict() for r in ctx.state.ledger])[INTERRUPTIONS_KEY]
        if rate is not None:  # this run rented spot workers: its measured interruption rate
            out[INTERRUPTIONS_KEY] = [rate]
        own = own_requests.samples(self.store_roles, self.ops_at_plan, self.epoch_ops, self.ops_at_end, self.staged)
        out.update({f"own_{part}_ops": values for part, values in own.items()})
        return out


def record_terms(ctx, clock: RunClock, history: list[EpochSummary]) -> None:
    """Add this run's measured terms to the target's cached samples (best effort: a cache
    that cannot be written costs a later run its accuracy, not this run its result)."""
    try:
        cache = ProfileCache(ctx.open_durable)
        key = timings_key(ctx)
        doc = cache.get("timings", key) or {}
        for name, values in clock.samples(ctx, history, time.time()).items():
            doc[name] = (list(doc.get(name) or []) + [v if isinstance(v, dict) else float(v) for v in values])[-KEEP:]
        cache.put("timings", key, doc)
    except Exception as exc:
        print(f"zooid: could not cache this run's timings: {type(exc).__name__}: {exc}")
