"""Pre-start (Hydrozoa Sec. 4.3): launch the next epoch's workers while this one still runs,
so their start-up hides behind training instead of adding to the next epoch.

The decision is `planners.prestart.decide_prestart`, fed with what this run measured: the
workers' start-up latencies (launch to the moment the worker process began its work) and
the last epoch's length. Pre-started Local-SGD workers wait, idle but billed, for the
checkpoint the current epoch writes at its end, then train. Only when the next epoch's shape
is already known: a static worker count and learning rate, and after one measured epoch.
"""
from __future__ import annotations

import dataclasses
import time

from coordinator.run.context import RunContext
from coordinator.workers.epoch_keys import clear_epoch_keys
from coordinator.workers.launchers import make_launcher
from coordinator.workers.worker_specs import next_attempt, worker_specs
from core.keys import checkpoint_key
from core.kinds import Strategy
from core.plan import Plan
from planners.prestart import decide_prestart, startup_split


def should_prestart(ctx: RunContext, plan: Plan, epoch: int) -> bool:
    """Whether epoch `epoch + 1` can be launched during `epoch`."""
    job = ctx.job
    return (job.prestart and job.scaling == "static" and plan.strategy == Strategy.LOCAL_SGD
            and epoch + 1 < job.epochs and bool(ctx.state.startup_samples) and ctx.state.last_epoch_s > 0)


class PrestartWatch:
    """Called on every poll of the current epoch; launches the next epoch once it is time."""

    def __init__(self, ctx: RunContext, plan: Plan, epoch: int, lr: float, epoch_start: float):
        self.ctx, self.plan, self.epoch, self.lr, self.epoch_start = ctx, plan, epoch, lr, epoch_start
        self.launched = False

    def tick(self) -> None:
        if self.launched:
            return
        decision = decide_prestart(elapsed_s=time.time() - self.epoch_start,
                                   predicted_epoch_s=self.ctx.state.last_epoch_s,
                                   startup_samples=self.ctx.state.startup_samples,
                                   prior_startup_s=self.ctx.resolved.target.startup_s)
        if decision.launch_in_s <= 0:
            self.launch_next()

    def launch_next(self) -> None:
        nxt = self.epoch + 1
        clear_epoch_keys(self.ctx, nxt, self.plan)  # now, not at its send: these workers may be syncing by then
        launcher = make_launcher(self.ctx, self.plan)
        for spec in worker_specs(self.ctx, self.plan, nxt, checkpoint_key(self.ctx.run_id, self.epoch), self.lr, 0):
            launcher.launch(dataclasses.replace(spec, attempt=next_attempt(self.ctx, nxt, spec.rank)))
        self.ctx.state.launchers.append(launcher)
        self.ctx.state.prestarted[nxt] = launcher
        self.launched = True


class WarmPrestart:
    """Called on every poll of a warm epoch: starts the workers the next epoch is known to add
    (`coordinator.plan.scaling_policy.forecast_workers`) once their start-up would end by the epoch's end."""

    def __init__(self, ctx: RunContext, plan: Plan, epoch: int, next_workers: int):
        self.ctx, self.plan, self.epoch, self.next_workers = ctx, plan, epoch, next_workers
        self.epoch_start = time.time()
        self.launched = next_workers <= plan.workers or plan.strategy != Strategy.LOCAL_SGD

    def tick(self) -> None:
        if self.launched:
            return
        decision = decide_prestart(elapsed_s=time.time() - self.epoch_start,
                                   predicted_epoch_s=self.ctx.state.last_epoch_s or self.plan.predicted_epoch_s,
                                   startup_samples=self.ctx.state.startup_samples,
                                   prior_startup_s=self.ctx.resolved.target.startup_s)
        if decision.launch_in_s <= 0:
            self.ctx.state.warm.prestart(self.next_workers, self.plan, self.epoch + 1)
            self.launched = True


def startup_report(outcomes, previous_end: float | None) -> dict:
    """Start-up hidden behind the previous epoch vs exposed, over the epoch's workers."""
    pairs = [(o.started_at, max(o.started_at, o.result.started_at)) for o in outcomes if o.result]
    return startup_split(pairs, previous_end).to_dict() if pairs else {}
