"""Choosing the plan: the measured profile and the job go to the planners (`planners.strategy`,
which calls `hybrid` with store transport and the store collectives' sync model); the
alternatives they considered, with predicted iteration time, epoch time and cost, travel with
the plan to the report. Where the target offers several worker sizes, the co-optimiser
(`coordinator.plan.co_plan`) chooses the partition, each stage's size and D together;
`plan.co_optimizer` says what it compared, or why it was not needed. After an epoch,
`replan` predicts the plan in force again from the calibrated inputs and switches when
another is clearly better.
"""
from __future__ import annotations

import dataclasses
import os
import time

from coordinator.bill.cost import total_usd
from coordinator.bill.ledger import rows_now
from coordinator.plan.capacity import with_capacity
from coordinator.plan.co_plan import co_optimized, launched_inputs
from coordinator.plan.own_requests import flat, plus, priced, staged_files
from coordinator.plan.run_terms import load_terms
from coordinator.plan.scaling_policy import worker_schedule
from coordinator.run.collective import RING, planned_collectives, uses_ring
from coordinator.run.context import RunContext
from coordinator.run.job_data import is_prepared
from core.epoch_summary import Replan
from core.errors import ZooidValueError
from core.kinds import AUTO, SHARED_HOST_KINDS, Capacity, PipelineSchedule, Strategy
from core.notice import HANDOVER_MARGIN_S
from core.plan import Plan
from core.schedule_costs import ideal_peak_in_flight
from core.schedules import Kind, build_schedule
from core.stage_memory import check_plan_memory, format_bytes, optimizer_copies, stage_memory
from core.store_ops import StoreOps
from core.warm_cadence import REPLY_POLL_S, WarmCadence
from planners.calibration import Calibration, calibrated
from planners.catalog import store_figures
from planners.checkpoint_cadence import sync_checkpoint_interval_s
from planners.pipeline_time import TransferCosts
from planners.run_prediction import RunTerms, predict_run, with_run_prediction
from planners.store_prices import StoreOffer, store_offer
from planners.store_requests import command_wait_ops, epoch_store_ops, warm_channel_ops
from planners.strategy import (
    NO_PLAN_FITS,
    StrategyInputs,
    choose,
    choose_schedule,
    describe,
    local_sgd,
    predicted,
    with_schedule,
    with_sync,
)
from profiling.profiler import ModelProfile
from profiling.timing import cpu_count

LAYER_FIELDS = ("forward_s", "backward_s", "output_bytes", "param_bytes", "forward_fixed_s",
                "backward_fixed_s")


def strategy_inputs(ctx: RunContext, profile: dict, workers: int) -> StrategyInputs:
    """The planner's view of the job, its profile (taken on the target, `tasks.profile`)
    and its target: the store's contract bandwidth and latency, a worker's measured put
    and get costs, the sync checkpoint write and a step right after it. Where the workers
    share this machine, a plan of more worker processes than cores time-shares them."""
    job, target = ctx.job, ctx.resolved.target
    transfer = profile.get("store_transfer")
    return StrategyInputs(
        layers=tuple({k: l[k] for k in LAYER_FIELDS if k in l} for l in profile.get("layers", ())),
        profile_batch=profile.get("microbatch_size") or profile["batch_size"], step_s=profile["step_s"],
        param_bytes=profile["param_bytes"], optimizer_copies=optimizer_copies(job.optimizer),
        n_train=ctx.resolved.n_train, batch_size=job.batch_size, workers=workers,
        stages=job.stages, microbatches=job.microbatches, sync_period=job.sync_period,
        bandwidth=profile["store_bandwidth_bytes_per_s"], latency=profile["store_latency_s"],
        offer=ctx.resolved.offer.name, price_per_worker_s=ctx.price_per_worker_s,
        worker_vcpu=target.worker_vcpu, worker_memory_gb=target.worker_memory_gb,
        worker_gpu=target.worker_gpu, optimizer_step_s=profile.get("optimizer_step_s", 0.0),
        transfer=TransferCosts(**transfer) if transfer else None,
        checkpoint_s=profile.get("checkpoint_s"), synced_step_s=profile.get("synced_step_s"),
        contention=profile.get("contention") or 1.0,
        host_cores=cpu_count() if target.kind in SHARED_HOST_KINDS else None,
        sync_dtype=job.sync_dtype, outer_optimizer=job.outer_optimizer,
        ring=job.collective == RING, collectives=planned_collectives(job, target)[0],
        ring_link=ring_link(ctx), **store_inputs(run_store_offer(ctx)),
        pipeline_store_request_usd=store_inputs(run_store_offer(ctx, durable=True))["store_request_usd"])


def ring_link(ctx: RunContext) -> tuple[float, float]:
    """(bandwidth, latency) of one hop of a direct ring between two of the run's workers: the
    catalog's `tcp` row, no faster than the offer's network where the workers do not share
    this machine."""
    shared = ctx.resolved.target.kind in SHARED_HOST_KINDS
    row = store_figures("tcp", 0.0 if shared else getattr(ctx.resolved.offer, "network_bytes_per_s", 0.0) or 0.0)
    return row["bandwidth_bytes_per_s"], row["latency_s"]


def run_store_offer(ctx: RunContext, durable: bool = False) -> StoreOffer:
    """The offer the run's store (`durable`: its durable store, through which a pipeline's stages
    move their tensors, `coordinator.workers.worker_specs`) is billed by
    (`planners.store_prices.store_offer`); a free one for a context that names no store (the
    planner's inputs alone, as its unit tests build them)."""
    seen = store_seen(ctx, durable)
    return store_offer(seen[0] if seen else "", ctx.resolved.offer.provider if seen else None)


def store_seen(ctx: RunContext, durable: bool = False) -> tuple[str, float] | None:
    """The run's store (`durable`: its durable store) as the plan prices it: where it is
    (`Store.where`) and how fast a waiting read polls it (`Store.poll_max_s`); None for a
    context that names no store."""
    opener = getattr(ctx, "open_durable" if durable else "open_store", None)
    if opener is None:
        return None
    store = opener()
    try:
        return store.where, store.poll_max_s
    finally:
        store.close()


IGNORE_REQUESTS_ENV = "ZOOID_PLAN_IGNORING_REQUESTS"
"""Set to 1, the planner chooses as if the store's requests were free (the run's predicted bill
and its ledger still price them): a seam for `benchmarks/bench_bill.py`, which runs the plan a
job gets without request prices beside the one it gets with them. Never set by a run."""


def store_inputs(offer: StoreOffer) -> dict:
    """The store's prices as `StrategyInputs` fields: what the planner weighs for each plan (its
    requests weighed as free under `IGNORE_REQUESTS_ENV`)."""
    ignored = os.environ.get(IGNORE_REQUESTS_ENV) == "1"
    return {"store_request_usd": {} if ignored else offer.prices(), "store_usd_per_s": offer.node_per_hour / 3600.0}


def make_plan(ctx: RunContext, profile: dict, workers: int, calibration: Calibration | None = None,
              epochs_left: int | None = None) -> Plan:
    """The plan for the job's strategy with `workers` replicas, its inputs calibrated by
    the epochs measured so far, with its epoch and run predicted start-up aware
    (`with_run`); refused (ZooidValueError naming `memory`, with the numbers per stage)
    when a stage does not fit its worker."""
    x = calibrated(strategy_inputs(ctx, profile, workers), calibration or Calibration())
    several = len(ctx.resolved.target.memory_options()) > 1
    uniform, why = None, ""
    try:
        uniform = uniform_plan(ctx, profile, x)
    except ZooidValueError as exc:
        if not several or exc.field != "memory":
            raise
        why = str(exc)  # at the target's size it does not fit: a larger size for some stage may
    chosen = co_optimized(ctx, profile, x, uniform, workers, why_uniform=why,
                          check_memory=lambda p: check_memory(ctx, profile, p))
    chosen = with_sync(x, chosen)
    note = planned_collectives(ctx.job, ctx.resolved.target)[1]
    if note:
        chosen = dataclasses.replace(chosen, collective_note=note)
    return with_capacity(ctx, with_run(ctx, chosen, calibration, epochs_left,
                                       per_epoch=scaled_plans(ctx, profile, chosen, workers, calibration, epochs_left)))


def scaled_plans(ctx: RunContext, profile: dict, chosen: Plan, workers: int, calibration: Calibration | None,
                 epochs_left: int | None) -> list[Plan] | None:
    """The plan of each epoch to come where the job's scaling policy changes the worker budget
    in advance (`coordinator.plan.scaling_policy.worker_schedule`: adabatch), each budget planned as the flow will
    plan it when it gets there; None where every epoch runs `chosen`."""
    left = ctx.job.epochs if epochs_left is None else epochs_left
    counts = worker_schedule(ctx, workers, left)
    if not counts or set(counts) == {workers}:
        return None
    plans = {workers: chosen}
    for count in counts:
        if count not in plans:
            try:
                plans[count] = make_plan(ctx, profile, count, calibration, epochs_left=0)
            except ZooidValueError:  # a budget the planner cannot use: the flow keeps the plan it has
                smaller = [c for c in plans if c <= count]
                plans[count] = plans[max(smaller)] if smaller else chosen
    return [plans[c] for c in counts]


def no_plan_fits(misfits: list[tuple[str, str]]) -> str:
    """One line for a job no candidate plan fits: the first candidate's numbers in full, the
    others named (the dry run lists each)."""
    (label, detail), others = misfits[0], [label for label, _ in misfits[1:]]
    also = f"; nor do {', '.join(others)} (the dry run lists each)" if others else ""
    return f"no plan fits the workers: {label}: {detail}{also}"


def uniform_plan(ctx: RunContext, profile: dict, x) -> Plan:
    """The job strategy's plan with every worker at the target's size, chosen among the
    candidates whose workers fit their memory (a model too large for one worker, a language
    model's embedding, head and logits say, is pipelined); ZooidValueError naming `memory`,
    with each candidate's numbers, when none fits."""
    misfits = []

    def fits(plan: Plan) -> bool:
        try:
            if plan.stages > 1:
                pick_schedule(ctx, profile, x, plan)
            else:
                check_memory(ctx, profile, plan)
            return True
        except ZooidValueError as exc:
            if exc.field != "memory":
                raise
            misfits.append((f"{plan.strategy} D={plan.data_parallel} M={plan.stages}",
                            str(exc).removeprefix("memory: ")))
            return False

    try:
        # DiLoCo's outer step runs over Local-SGD rounds, and no pipeline splits a parameter that two
        # children share (tied weights, `ResolvedJob.shared_parameters`): `auto` then plans Local-SGD only
        local_only = ctx.job.strategy == AUTO and (ctx.job.outer_optimizer == "nesterov"
                                                   or bool(ctx.resolved.shared_parameters))
        strategy = Strategy.LOCAL_SGD if local_only else ctx.job.strategy
        chosen = choose(x, strategy, fits=fits)
    except ValueError as exc:
        if str(exc) == NO_PLAN_FITS:
            raise ZooidValueError("memory", no_plan_fits(misfits)) from None
        raise ZooidValueError("strategy", str(exc).removeprefix("strategy: ")) from None
    if chosen.stages > 1:
        return with_sync(x, pick_schedule(ctx, profile, x, chosen))
    return with_sync(x, chosen)


@dataclasses.dataclass(frozen=True)
class RunStores:
    """The run's stores as its plan prices them: `roles` (`{Store.where: role}`: `store`, and
    `durable` where the durable store is another), the offers by role, the role of the store
    that carries the warm channel (`RunContext.channel_ref`) and how fast a waiting read polls it."""

    roles: dict
    offers: dict
    channel_poll_s: float
    channel_role: str = "store"

    @property
    def durable_role(self) -> str:
        return "durable" if "durable" in self.roles.values() else "store"

    @property
    def durable_where(self) -> str:
        return next((where for where, role in self.roles.items() if role == self.durable_role), "")

    def staged(self, ctx: RunContext) -> dict[str, StoreOps]:
        """The requests of staging the run's dataset on the durable store (none for a prepared
        dataset, read where it is): a subset file for every `subset_size` rows of each split."""
        r = ctx.resolved
        files = 0 if is_prepared(ctx.job.dataset) else r.n_subsets + r.n_val_subsets
        return staged_files(files, self.durable_role)

    def protocol_role(self, plan: Plan) -> str:
        """The role of the store `plan`'s epochs move their tensors through (a pipeline's stages:
        the durable store, `coordinator.workers.worker_specs`)."""
        return self.durable_role if plan.stages > 1 else "store"


def run_stores(ctx: RunContext) -> RunStores:
    """`RunStores` of `ctx` (each store opened once; none for a context that names no store)."""
    store, durable = store_seen(ctx), store_seen(ctx, durable=True)
    roles = {durable[0]: "durable"} if durable else {}
    if store:
        roles[store[0]] = "store"  # one store for both: the run's store
    provider = ctx.resolved.offer.provider if roles else None
    on_store = store is not None and getattr(ctx, "channel_ref", None) == getattr(ctx, "store_ref", "")
    channel = store if on_store else durable
    durable_role = "durable" if "durable" in roles.values() else "store"
    return RunStores(roles=roles, offers={role: store_offer(where, provider) for where, role in roles.items()},
                     channel_poll_s=max(REPLY_POLL_S, channel[1]) if channel else REPLY_POLL_S,
                     channel_role="store" if on_store else durable_role)


def expected_epoch_ops(ctx: RunContext, plan: Plan, epoch_s: float, stores: RunStores,
                       wait_s: float = 0.0, protocol: StoreOps | None = None) -> dict[str, dict[str, StoreOps]]:
    """One epoch's requests as `planners.store_requests` derives them, by the party whose misses
    they are and the store role (`own_requests.Parties`, roles for stores): the protocol's (the
    workers') on the store its tensors move through; the warm channel's for an epoch of `epoch_s`
    seconds (commands, replies, status, lease: the coordinator's reads of the
    replies are its misses) and the workers' reads while they waited `wait_s` for the epoch's
    command (`command_waits`), both on the store that carries the channel. `protocol`: the
    plan's `protocol_ops`, where the caller has them."""
    protocol = protocol_ops(ctx, plan, stores) if protocol is None else protocol
    workers = plus({stores.protocol_role(plan): protocol}, command_waits(ctx, plan, stores, wait_s))
    coordinator = {}
    if getattr(ctx.job, "warm", False):
        poll = stores.channel_poll_s
        coordinator[stores.channel_role] = warm_channel_ops(plan.workers, epoch_s, _cadence(ctx), poll_first_s=poll,
                                                            poll_max_s=poll)
    return {"coordinator": coordinator, "workers": workers}


def profiled(ctx: RunContext) -> dict:
    """The run's measured profile (empty before the profile, or for a context without state)."""
    return getattr(getattr(ctx, "state", None), "profile", None) or {}


def checkpoint_bytes(ctx: RunContext) -> float:
    """A checkpoint's size: the profiled parameters and the optimizer's state, float32."""
    return float(profiled(ctx).get("param_bytes") or 0.0) * (1 + optimizer_copies(ctx.job.optimizer))


def with_checkpoint_interval(ctx: RunContext, plan: Plan, stores: RunStores) -> Plan:
    """`plan` with the seconds between its sync checkpoints (`Plan.sync_checkpoint_s`): for a
    Local-SGD sync over the store (a compressed one's ranks keep to the rounds it holds at the
    plan's pace, `planners.checkpoint_cadence.rounds_between_checkpoints`), the job's
    `sync_checkpoint_s` where it names one, else Young's interval from the profiled stall of
    a checkpoint's write, its requests on the durable store at the plan's worker price, the assumed
    crash rate and, where the job may run on spot and the notice leaves no time to hand over, the
    spot offer's interruptions (`planners.checkpoint_cadence`); 0 (every round) otherwise."""
    if plan.strategy != Strategy.LOCAL_SGD or plan.stages > 1 or plan.data_parallel <= 1 or uses_ring(ctx.job, plan):
        return dataclasses.replace(plan, sync_checkpoint_s=0.0)
    asked = getattr(ctx.job, "sync_checkpoint_s", None)
    if asked is not None:
        return dataclasses.replace(plan, sync_checkpoint_s=float(asked))
    offer = stores.offers.get(stores.durable_role)
    writes = 1 + (plan.data_parallel if plan.sync_dtype != "float32" else 0)  # and each rank's residual
    put_usd = offer.request_usd(StoreOps(put=writes * offer.object_requests(checkpoint_bytes(ctx))[0])) if offer else 0.0
    spot = getattr(ctx.resolved, "spot", None)
    on_spot = spot is not None and getattr(ctx.job, "capacity", Capacity.ON_DEMAND) != Capacity.ON_DEMAND
    interval = sync_checkpoint_interval_s(
        workers=plan.data_parallel, checkpoint_s=profiled(ctx).get("checkpoint_s"), put_usd=put_usd,
        price_per_worker_s=plan.price_per_worker_s or getattr(ctx, "price_per_worker_s", 0.0),
        spot_rate_per_worker_hour=spot.interruptions_per_worker_hour if on_spot else 0.0,
        handover=not on_spot or spot.notice_s >= HANDOVER_MARGIN_S)
    return dataclasses.replace(plan, sync_checkpoint_s=interval)


def protocol_ops(ctx: RunContext, plan: Plan, stores: RunStores) -> StoreOps:
    """One epoch's protocol requests (`planners.store_requests.epoch_store_ops`), its checkpoints'
    as many as their size takes on the durable store (parameters and optimizer state, float32),
    as many sync checkpoints as the plan's interval gives its epoch."""
    offer = stores.offers.get(stores.durable_role)
    return epoch_store_ops(plan, ring=uses_ring(ctx.job, plan),
                           checkpoint_requests=offer.object_requests(checkpoint_bytes(ctx)) if offer is not None else (1, 1))


def command_waits(ctx: RunContext, plan: Plan, stores: RunStores, wait_s: float) -> dict[str, StoreOps]:
    """The reads of `plan`'s warm workers waiting `wait_s` seconds for a command, on the
    channel's store (`planners.store_requests.command_wait_ops`; none for cold workers)."""
    if not getattr(ctx.job, "warm", False):
        return {}
    return {stores.channel_role: command_wait_ops(plan.workers, wait_s, _cadence(ctx), stores.channel_poll_s)}


def idle_s(ctx: RunContext) -> float:
    """How long the pool's idle warm workers have waited for a command (since the reply of the
    longest idle, their profile's before the first epoch); 0 without one."""
    pool = ctx.state.warm
    idle = [w.billed_to for w in (pool.workers.values() if pool is not None else ())
            if w.command is None and w.billed_to]
    return max(0.0, time.time() - min(idle)) if idle else 0.0


def _cadence(ctx: RunContext) -> WarmCadence:
    return WarmCadence(ctx.job.worker_lease_s, ctx.job.worker_timeout_s)


def store_terms(ctx: RunContext, plan: Plan, terms: RunTerms, stores: RunStores) -> tuple[StoreOps, dict, float]:
    """One epoch's protocol requests for `plan` (`planners.store_requests`), `predict_run`'s store
    keywords and the dollars an epoch adds beyond its protocol. Priced by the run's stores'
    offers (`planners.store_prices`): each epoch's protocol and warm channel plus the run's own
    requests an epoch adds (`coordinator.plan.own_requests`, measured by earlier runs on this
    target: `terms.own_store_ops`); before the first epoch, the staging those runs measured and
    this run's dataset's subsets (none once provisioned: it is billed by then); after the last,
    their teardown. The planner weighed the protocol's dollars when it chose
    (`planners.strategy.store_usd_per_epoch`)."""
    protocol = protocol_ops(ctx, plan, stores)
    expected = flat(expected_epoch_ops(ctx, plan, plan.predicted_epoch_s, stores, wait_s=terms.gap_s, protocol=protocol))
    own = terms.own_store_ops or {}
    per_epoch = priced(own.get("epoch") or {}, expected, stores.offers)
    # staging: the dataset's subsets, and the idle workers' wait for the first command beyond a gap's
    # (through the plan and the provisioning: their reads are reported with the epoch's reply)
    waits = command_waits(ctx, plan, stores, max(0.0, idle_s(ctx) + terms.provision_s - terms.gap_s))
    staging = 0.0 if ctx.state.provisioned else priced(own.get("staging") or {}, plus(stores.staged(ctx), waits),
                                                       stores.offers)
    prices = {"store_usd_per_epoch": per_epoch, "store_usd_before": staging,
              "store_usd_after": priced(own.get("teardown") or {}, {}, stores.offers),
              "store_usd_per_s": sum(o.node_per_hour for o in stores.offers.values()) / 3600.0}
    return protocol, prices, per_epoch - priced({}, expected, stores.offers)


def with_run(ctx: RunContext, chosen: Plan, calibration: Calibration | None, epochs_left: int | None,
             per_epoch: list[Plan] | None = None) -> Plan:
    """`chosen`, with its sync checkpoints' interval (`with_checkpoint_interval`), and its
    alternatives with each epoch's overhead and the run's time and bill
    (`planners.run_prediction`), from the target's measured terms (`coordinator.plan.run_terms`)."""
    stores = run_stores(ctx)
    chosen = with_checkpoint_interval(ctx, chosen, stores)
    terms = load_terms(ctx, calibration.overhead_s if calibration else None)
    launched = [w.launched_at for w in ctx.state.warm.workers.values()] if ctx.state.warm is not None else []
    since = None  # no worker yet: all start at the plan, and wait as long as earlier such runs did
    if launched:  # some started before the plan (to profile, or while it ran): the youngest decides
        since = time.time() - max(launched) if len(launched) >= chosen.workers else 0.0
        terms = dataclasses.replace(terms, exposed_s=None)
    shared = ctx.resolved.target.kind in SHARED_HOST_KINDS  # added workers start on the coordinator's cores
    billed = [] if ctx.dry_run else rows_now(ctx)  # the profile's requests among them
    kwargs = dict(epochs=ctx.job.epochs if epochs_left is None else epochs_left, warm=ctx.job.warm,
                  workers_launched_s=since, host_cores=cpu_count() if shared else None,
                  billed_usd=total_usd(billed), coordinator_price_per_s=ctx.price_per_coordinator_s)
    store_ops, store_prices, own_usd = store_terms(ctx, chosen, terms, stores)
    alternatives = []
    for a in chosen.alternatives:
        compute = a.get("predicted_compute_epoch_s", a["predicted_epoch_s"])
        alt = Plan(strategy=a["strategy"], data_parallel=a["data_parallel"], stages=a["stages"],
                   price_per_worker_s=a.get("price_per_worker_s", chosen.price_per_worker_s),
                   predicted_compute_epoch_s=compute)
        p = predict_run(alt, terms, **kwargs, **{**store_prices, "store_usd_per_epoch": own_usd + (
            a.get("predicted_store_usd_per_epoch") or 0.0)})
        alternatives.append({**a, "predicted_compute_epoch_s": compute, "predicted_epoch_s": p.epoch_s,
                             "predicted_cost_per_epoch_usd": p.epoch_s * alt.workers * alt.price_per_worker_s,
                             "predicted_run_s": p.run_s, "predicted_run_cost_usd": p.cost_usd})
    out = with_run_prediction(dataclasses.replace(chosen, alternatives=tuple(alternatives)), terms, **kwargs,
                              per_epoch=per_epoch, store_ops=store_ops.to_dict(), **store_prices,
                              store_billed_usd=total_usd(r for r in billed if r.kind == "store"))
    if per_epoch is None:
        return out
    # the chosen plan's row carries its run as the scaling policy will run it
    run = {"predicted_run_s": out.predicted_run_s, "predicted_run_cost_usd": out.predicted_run_cost_usd}
    return dataclasses.replace(out, predicted_workers_by_epoch=tuple(p.workers for p in per_epoch),
                               alternatives=tuple({**a, **run} if a.get("chosen") else a for a in out.alternatives))


def shape(plan: Plan) -> tuple:
    """What the workers run: two plans of one shape need no change of workers."""
    return (plan.strategy, plan.data_parallel, plan.stages, tuple(plan.cuts), plan.microbatches,
            plan.pipeline_schedule, plan.chunks, tuple(plan.stage_memory_gb))


def replan(ctx: RunContext, profile: dict, current: Plan, calibration: Calibration,
           epochs_left: int, budget: int, gain: float = 0.10) -> tuple[Plan, Replan]:
    """After an epoch: the plan in force predicted again from the calibrated inputs, and the
    planner's choice for the same worker budget (`budget`, what the plan in force was
    planned for); the choice replaces it when it is at least `gain` faster, or `gain`
    cheaper while no more than 5 % slower. Returns the plan for the next epoch and the
    decision (for the epoch history)."""
    same = make_same(ctx, profile, current, calibration, epochs_left)
    try:
        best = make_plan(ctx, profile, budget, calibration, epochs_left)
    except ZooidValueError as exc:
        best, why = None, str(exc)
    decision = Replan(calibration=calibration.to_dict(), predicted_epoch_s=same.predicted_epoch_s)
    if best is None or shape(best) == shape(same):
        decision.reason = (f"the plan in force is still the best for {current.workers} worker(s)"
                           if best is not None else f"no other plan: {why}")
        return same, decision
    faster = best.predicted_epoch_s <= (1 - gain) * same.predicted_epoch_s
    def name(p: Plan) -> str:
        return (f"{p.strategy} D={p.data_parallel} M={p.stages}" + (f" cuts={list(p.cuts)} micro-batches="
                f"{p.microbatches} {p.pipeline_schedule}" if p.stages > 1 else ""))

    cheaper = (best.predicted_cost_per_epoch_usd <= (1 - gain) * same.predicted_cost_per_epoch_usd
               and best.predicted_epoch_s <= 1.05 * same.predicted_epoch_s)
    summary = (f"{name(best)}: {best.predicted_epoch_s:.3g} s, ${best.predicted_cost_per_epoch_usd:.3g} per epoch "
               f"vs {name(same)}: {same.predicted_epoch_s:.3g} s, ${same.predicted_cost_per_epoch_usd:.3g}")
    if faster or cheaper:
        decision.switched, decision.reason = True, f"{'faster' if faster else 'cheaper'}: {summary}"
        decision.to = {"strategy": best.strategy, "data_parallel": best.data_parallel, "stages": best.stages}
        return best, decision
    decision.reason = f"kept: the best other plan gains less than {gain:.0%} ({summary})"
    return same, decision


def make_same(ctx: RunContext, profile: dict, current: Plan, calibration: Calibration, epochs_left: int) -> Plan:
    """The plan in force (its shape unchanged) predicted again from calibrated inputs."""
    x = calibrated(strategy_inputs(ctx, profile, current.data_parallel), calibration)
    x = launched_inputs(ctx, x, current, profile)  # a co-optimised plan's stages run at their sizes
    collective = RING if uses_ring(ctx.job, current) else "store"
    again = (local_sgd(x, current.data_parallel, collective) if current.stages == 1
             else predicted(x, dataclasses.replace(current, collective=collective)))
    again = dataclasses.replace(again, alternatives=current.alternatives, co_optimizer=current.co_optimizer)
    return with_capacity(ctx, with_run(ctx, again, calibration, epochs_left), keep=current.capacity)


def pick_schedule(ctx: RunContext, profile: dict, x, plan: Plan) -> Plan:
    """The pipeline `plan` under the job's schedule, or for `auto` the fastest predicted of
    1F1B, GPipe and interleaved 1F1B (v = 2; considered when M is a multiple of the p
    workers and the profile has p x 2 layers with parameters, and dropped when the planner
    cannot predict it) whose workers fit their memory (1F1B holds min(k - s, M)
    micro-batches of activations on stage s, GPipe all M, interleaved min(W_w + 1, 2M)
    half-stage sets on worker w); within 1 % of the fastest, the one holding fewer
    stage-sized sets on worker 0. The schedules compared join the plan's alternatives."""
    chunks = 2
    names = ([PipelineSchedule.ONE_F_ONE_B, PipelineSchedule.GPIPE] if ctx.job.pipeline_schedule == AUTO
             else [ctx.job.pipeline_schedule])
    with_params = sum(1 for l in profile.get("layers", ()) if l.get("param_bytes", 0) > 0)
    if ctx.job.pipeline_schedule == AUTO and plan.microbatches % plan.stages == 0 \
            and with_params >= plan.stages * chunks:
        names.append(PipelineSchedule.INTERLEAVED)

    def held(name: str) -> float:  # stage-sized activation sets worker 0 holds at its peak
        v = chunks if name == PipelineSchedule.INTERLEAVED else 1
        return ideal_peak_in_flight(name, plan.stages, plan.microbatches, 0, v) / v

    options, errors = [], []
    for name in sorted(names, key=held):
        try:
            options.append(with_schedule(x, plan, name) if name != PipelineSchedule.INTERLEAVED
                           else with_schedule(x, plan, name, chunks=chunks))
        except ValueError as exc:
            if ctx.job.pipeline_schedule != AUTO:
                raise
            errors.append(f"{name}: not predicted ({exc})")
    def check_workers(option: Plan) -> None:
        """`check_memory` for several model stages per worker: the worker's peak of the
        activations its row holds at once (walking the schedule, each model stage's own
        bytes per micro-batch), its stages' parameters with gradients, sync buffers and
        optimizer state, its base memory once."""
        prof = ModelProfile.from_dict(profile)
        if not prof.layers:
            return
        p, m = option.stages, option.microbatches
        available = ctx.resolved.target.worker_memory_gb * 2**30
        one_set = stage_memory(  # per model stage: one micro-batch's activations, the parameters
            activation_bytes=prof.layer_activation_bytes(max(1, option.batch_size // m)),
            param_bytes=[l.param_bytes for l in prof.layers], cuts=[c + 1 for c in option.cuts], microbatches=m,
            available_bytes=available, optimizer_state_factor=optimizer_copies(ctx.job.optimizer),
            data_parallel=option.data_parallel, in_flight=[1] * (len(option.cuts) + 1))
        over = []
        for w, row in enumerate(build_schedule(PipelineSchedule.INTERLEAVED, p, m, option.chunks)):
            held = peak = 0.0
            for a in row:
                held += one_set[a.stage].activation_bytes * ((a.kind is Kind.F) - (a.kind is Kind.B))
                peak = max(peak, held)
            own = one_set[w::p]
            need = peak + sum(s.parameter_bytes for s in own) + (prof.base_memory_bytes or 0.0)
            if need > available:
                over.append(f"worker {w} (model stages {', '.join(str(s.stage) for s in own)}) needs "
                            f"{format_bytes(need)} (activations {format_bytes(peak)}), worker has "
                            f"{format_bytes(available)}")
        if over:
            raise ZooidValueError("memory", "; ".join(over))

    fitting = []
    for option in options:
        try:
            if option.chunks == 1:
                check_memory(ctx, profile, option)
            else:
                check_workers(option)
            fitting.append(option)
        except ZooidValueError as exc:
            errors.append(f"{option.pipeline_schedule}: {str(exc).removeprefix('memory: ')}")
    if not fitting:
        raise ZooidValueError("memory", "; ".join(errors))
    best = choose_schedule(fitting)
    compared = tuple({**describe(o, o is best), "compared": "schedule", "fits": o in fitting} for o in options)
    return dataclasses.replace(best, alternatives=plan.alternatives + compared)


def check_memory(ctx: RunContext, profile: dict, plan: Plan) -> None:
    """Every stage's activations, parameters, gradients, optimizer state and the worker
    process's base memory must fit the worker's memory (each stage's own size where the
    co-optimiser chose them, `plan.stage_memory_gb`)."""
    prof = ModelProfile.from_dict(profile)
    if not prof.layers:
        return

    micro = max(1, plan.batch_size // max(1, plan.microbatches))
    in_flight = [ideal_peak_in_flight(plan.pipeline_schedule, plan.stages, plan.microbatches, worker=s)
                 for s in range(plan.stages)]
    check_plan_memory(activation_bytes=prof.layer_activation_bytes(micro), in_flight=in_flight,
                      param_bytes=[l.param_bytes for l in prof.layers],
                      cuts=[c + 1 for c in plan.cuts], microbatches=plan.microbatches,
                      available_bytes=([g * 2**30 for g in plan.stage_memory_gb] if plan.stage_memory_gb
                                       else ctx.resolved.target.worker_memory_gb * 2**30),
                      base_memory_bytes=prof.base_memory_bytes or 0.0,
                      optimizer_state_factor=optimizer_copies(ctx.job.optimizer),
                      data_parallel=plan.data_parallel)
