"""Worker scaling policies: pure functions from the epoch history so far to the next epoch's
worker count and learning rate (applied by the `rescale` step at an epoch boundary).

- `static`: the initial count throughout.
- `adabatch` (Hydrozoa Sec. 5.4, after AdaBatch): double the workers every E epochs up to
  the maximum, multiplying the learning rate by 0.75 per doubling, which stands in for a
  learning-rate decay as the effective batch doubles.
- `reactive` (KubeML Sec. 3.4.2): add a worker while epoch throughput keeps improving; once
  an added worker did not help, go back to the previous count and hold; remove a worker
  when throughput drops by more than a threshold against the previous epoch.
- `deadline`: re-run Cynthia provisioning (`planners.worker_count`) with the time and budget
  that remain, the loss model shifted by the iterations already done.

The minimum and maximum worker bounds are applied to every policy's answer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

from core.errors import PlannerInputError
from planners.worker_count import parse_provision, plan_provision


@dataclass(frozen=True, kw_only=True)
class EpochRecord:
    """What one finished epoch reports (KubeML's per-epoch history)."""

    epoch: int
    workers: int
    seconds: float
    samples_per_s: float
    val_loss: float | None = None
    val_accuracy: float | None = None
    cost_usd: float = 0.0
    iterations: int = 0
    """Iterations in the loss model's unit (BSP steps; under ASP, all workers' steps)."""


@dataclass(frozen=True, kw_only=True)
class ScalingSettings:
    """Policy settings; each policy reads the fields it needs."""

    min_workers: int = 1
    """Lower bound on every decision."""
    max_workers: int = 16
    """Upper bound on every decision (and adabatch's ceiling)."""
    initial_workers: int = 1
    """Workers for the first epoch (and throughout for `static`)."""
    lr: float = 0.1
    """Base learning rate."""
    double_every_epochs: int = 5
    """adabatch: epochs between doublings (E)."""
    lr_factor_per_doubling: float = 0.75
    """adabatch: learning-rate factor per doubling."""
    drop_threshold: float = 0.2
    """reactive: remove a worker when throughput falls by more than this fraction."""
    deadline_s: float | None = None
    """deadline: seconds allowed for the whole run."""
    budget_usd: float | None = None
    """deadline: dollars allowed for the whole run (reported against, see `_deadline`)."""
    provision: dict = field(default_factory=dict)
    """deadline: a `provision` document (PLANNER_SPEC.md) without the deadline; its
    max_workers is replaced by `max_workers`."""

    def __post_init__(self):
        for name in ("min_workers", "max_workers", "initial_workers", "double_every_epochs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlannerInputError(name, f"must be an integer >= 1, got {value!r}")
        if self.min_workers > self.max_workers:
            raise PlannerInputError("min_workers", f"must be <= max_workers ({self.max_workers})")
        for name in ("lr", "lr_factor_per_doubling"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise PlannerInputError(name, f"must be a finite number > 0, got {value!r}")
        if not 0 <= self.drop_threshold < 1:
            raise PlannerInputError("drop_threshold", f"must be in [0, 1), got {self.drop_threshold}")
        for name in ("deadline_s", "budget_usd"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise PlannerInputError(name, f"must be > 0 when given, got {value}")


@dataclass(frozen=True)
class ScalingDecision:
    """The next epoch's worker count and learning rate, and why."""

    workers: int
    lr: float
    reason: str


def _static(history: Sequence[EpochRecord], s: ScalingSettings) -> ScalingDecision:
    return ScalingDecision(s.initial_workers, s.lr, "static: fixed worker count")


def known_in_advance(policy: str, epochs_done: int) -> bool:
    """Whether `policy`'s decision after `epochs_done` epochs depends only on how many ran,
    not on what they measured, so it can be taken before the last of them ends (to pre-start
    the workers it adds): `static` and `adabatch` always, `reactive` after its first epoch."""
    return policy in ("static", "adabatch") or (policy == "reactive" and epochs_done == 1)


def _adabatch(history: Sequence[EpochRecord], s: ScalingSettings) -> ScalingDecision:
    due = len(history) // s.double_every_epochs
    workers, doublings = s.initial_workers, 0
    for _ in range(due):
        nxt = min(s.max_workers, workers * 2)
        if nxt == workers:
            break
        workers, doublings = nxt, doublings + 1
    lr = s.lr * s.lr_factor_per_doubling ** doublings
    return ScalingDecision(workers, lr, f"adabatch: {doublings} doubling(s) after "
                                        f"{len(history)} epoch(s)")


def _reactive(history: Sequence[EpochRecord], s: ScalingSettings) -> ScalingDecision:
    if not history:
        return ScalingDecision(s.initial_workers, s.lr, "reactive: initial worker count")
    last = history[-1]
    if len(history) == 1:
        return ScalingDecision(last.workers + 1, s.lr, "reactive: first epoch, adding a worker")
    prev = history[-2]
    if last.samples_per_s < (1 - s.drop_threshold) * prev.samples_per_s:
        return ScalingDecision(last.workers - 1, s.lr,
                               f"reactive: throughput fell {last.samples_per_s:.4g} < "
                               f"{1 - s.drop_threshold:.2f} x {prev.samples_per_s:.4g}")
    failed = [b for a, b in zip(history, history[1:])
              if b.workers > a.workers and b.samples_per_s <= a.samples_per_s]
    if failed and failed[-1] is last:
        return ScalingDecision(prev.workers, s.lr,
                               "reactive: the added worker did not raise throughput; back")
    if failed:
        return ScalingDecision(last.workers, s.lr, "reactive: throughput stopped improving; hold")
    return ScalingDecision(last.workers + 1, s.lr, "reactive: throughput still improving")


def _deadline(history: Sequence[EpochRecord], s: ScalingSettings) -> ScalingDecision:
    if s.deadline_s is None:
        raise PlannerInputError("deadline_s", "is required by the deadline policy")
    if not isinstance(s.provision, dict) or not s.provision:
        raise PlannerInputError("provision", "is required by the deadline policy")
    elapsed = sum(r.seconds for r in history)
    spent = sum(r.cost_usd for r in history)
    done = sum(r.iterations for r in history)
    remaining = s.deadline_s - elapsed
    if remaining <= 0:
        return ScalingDecision(s.max_workers, s.lr, "deadline: already passed; maximum workers")
    doc = dict(s.provision, deadline_s=remaining, max_workers=s.max_workers)
    loss = doc.get("loss_model")
    if isinstance(loss, dict) and isinstance(loss.get("beta1"), (int, float)):
        # loss = beta0 / (s + beta1) counted from the start; `done` iterations in, the
        # iterations still needed follow the same curve with beta1 + done
        doc["loss_model"] = dict(loss, beta1=loss["beta1"] + done)
    plan = plan_provision(parse_provision(doc))
    if plan is None:
        return ScalingDecision(s.max_workers, s.lr,
                               f"deadline: no plan meets the remaining {remaining:.4g} s; "
                               "maximum workers")
    reason = (f"deadline: cheapest plan for the remaining {remaining:.4g} s uses "
              f"{plan.workers} workers, predicted {plan.time_s:.4g} s and ${plan.cost:.4g}")
    if s.budget_usd is not None and plan.cost > s.budget_usd - spent:
        reason += f" (over the remaining budget ${s.budget_usd - spent:.4g})"
    return ScalingDecision(plan.workers, s.lr, reason)


POLICIES: dict[str, Callable[[Sequence[EpochRecord], ScalingSettings], ScalingDecision]] = {
    "static": _static, "adabatch": _adabatch, "reactive": _reactive, "deadline": _deadline}


def decide(policy_name: str, history: Sequence[EpochRecord],
           settings: ScalingSettings) -> ScalingDecision:
    """The next epoch's workers and learning rate under `policy_name`, within the bounds."""
    if policy_name not in POLICIES:
        raise PlannerInputError("scaling", f"unknown policy {policy_name!r}; valid: "
                                           f"{', '.join(POLICIES)}")
    raw = POLICIES[policy_name](tuple(history), settings)
    workers = min(settings.max_workers, max(settings.min_workers, raw.workers))
    reason = raw.reason if workers == raw.workers else f"{raw.reason} (bounded to {workers})"
    return ScalingDecision(workers, raw.lr, reason)
