"""Calibrate the planner from measured epochs: the profile's terms refitted to what ran.

A profile is taken once, in seconds, before anything trains; an epoch measures the same
job at full length. After each epoch the plan in force is compared with what its workers
reported, term by term:

- compute: the busiest worker's compute seconds per step against the plan's
  `predicted_compute_s`. A Local-SGD replica's steps calibrate the profile's whole-step
  times, a pipeline stage's micro-batches its per-layer times: two measurements of the
  profile that err apart (a micro-batch of a few rows pays per-call costs a step does not);
- communication: the rest of the measured iteration against the rest of the predicted
  one; it is the store collectives' sync (and the sync checkpoint) for Local-SGD, the
  activation transfers for a pipeline, both for a hybrid;
- overhead: the epoch's wall time beyond its steps (dispatch, data, validation, checkpoint).

`Calibration` holds the ratios relative to the raw profile (a later epoch refines the
earlier ratio), and `calibrated` scales a planner's inputs by them, so every plan the
planner compares next (another strategy, another worker count) inherits what was learnt.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace

from core.epoch_summary import EpochSummary
from core.kinds import DATA_PARALLEL_STRATEGIES, PIPELINED_STRATEGIES
from core.plan import Plan
from planners.pipeline_time import TransferCosts
from planners.strategy import local_sgd, predicted, sync_checkpoint_s

RATIO_BOUNDS = (1e-6, 1e6)
"""A ratio outside these is a measurement gone wrong, not a model to follow (a profile can
be wrong by orders of magnitude: a probe of an idle store, a CPU timing of a GPU job)."""


@dataclass(frozen=True, kw_only=True)
class Calibration:
    step_scale: float = 1.0
    """Measured / profiled whole training steps (Local-SGD)."""
    layer_scale: float = 1.0
    """Measured / profiled per-layer forward and backward (pipeline, hybrid)."""
    sync_scale: float = 1.0
    """Measured / profiled store collectives and sync checkpoints (Local-SGD, hybrid)."""
    transfer_scale: float = 1.0
    """Measured / profiled activation transfers (pipeline, hybrid)."""
    overhead_s: float | None = None
    """The last epoch's wall time beyond its steps (None: no epoch measured yet)."""
    epochs: int = 0
    """Epochs the ratios were fitted from."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict | None) -> "Calibration":
        return cls(**d) if d else cls()


def _bounded(ratio: float) -> float:
    low, high = RATIO_BOUNDS
    return min(high, max(low, ratio))


def epoch_overhead(plan: Plan, measured: EpochSummary) -> float:
    """An epoch's wall time beyond its steps and the start-up it exposed: dispatch, data,
    validation, checkpoint, replies."""
    iteration = measured.measured_iteration_s or 0.0
    busy = plan.steps_per_epoch * iteration if iteration > 0 else (measured.critical_busy_s or 0.0)
    return max(0.0, measured.seconds - busy - measured.exposed_startup_s)


def _with_comm(plan: Plan, c: Calibration, base: Calibration, ratio: float) -> Calibration:
    """`c` with the communication that `plan` does scaled by `ratio` over `base`'s."""
    if plan.strategy in DATA_PARALLEL_STRATEGIES:
        c = dataclasses.replace(c, sync_scale=_bounded(base.sync_scale * ratio))
    if plan.strategy in PIPELINED_STRATEGIES:
        c = dataclasses.replace(c, transfer_scale=_bounded(base.transfer_scale * ratio))
    return c


def _solve_comm(plan: Plan, inputs, c: Calibration, iteration: float, rounds: int = 60) -> Calibration:
    """`c` with the communication scale at which the planner, fed the raw `inputs` so
    calibrated, predicts `plan`'s measured `iteration`: a bisection on its logarithm (the
    predicted iteration grows with it; a pipeline's waits and bubbles are no ratio of its
    transfers, so a ratio of the two sides would not land on the measurement)."""
    import math

    def iteration_at(scale: float) -> float:
        x = calibrated(inputs, _with_comm(plan, c, Calibration(), scale))
        again = local_sgd(x, plan.data_parallel) if plan.stages == 1 else predicted(x, plan)
        return again.predicted_iteration_s

    low, high = (math.log(b) for b in RATIO_BOUNDS)
    if iteration_at(math.exp(low)) >= iteration:
        return _with_comm(plan, c, Calibration(), math.exp(low))
    if iteration_at(math.exp(high)) <= iteration:
        return _with_comm(plan, c, Calibration(), math.exp(high))
    for _ in range(rounds):
        mid = (low + high) / 2
        low, high = (mid, high) if iteration_at(math.exp(mid)) < iteration else (low, mid)
    return _with_comm(plan, c, Calibration(), math.exp((low + high) / 2))


def fit(plan: Plan, measured: EpochSummary, previous: Calibration = Calibration(), *, first: bool = False,
        inputs=None) -> Calibration:
    """The calibration after an epoch of `plan` (made with `previous`) that measured
    `measured` (the epoch's summary: `seconds`, `measured_iteration_s`, `compute_s`, the
    busiest worker's compute seconds, and `critical_busy_s`). The `first` epoch a worker
    set ran also built its model and read its data: its overhead is not a steady one.

    With `inputs` (the raw `StrategyInputs` the plan was made from), the communication
    scale is solved so that the planner predicts the measured iteration exactly; without,
    it is the ratio of the measured to the predicted communication."""
    steps = max(1, plan.steps_per_epoch)
    iteration = measured.measured_iteration_s or 0.0
    compute = (measured.compute_s or 0.0) / steps
    out = dataclasses.replace(previous, epochs=previous.epochs + 1)
    if iteration > 0 and compute > 0 and plan.predicted_compute_s > 0:
        compute = min(compute, iteration)
        ratio = compute / plan.predicted_compute_s
        if plan.stages == 1:
            out = dataclasses.replace(out, step_scale=_bounded(previous.step_scale * ratio))
        else:
            out = dataclasses.replace(out, layer_scale=_bounded(previous.layer_scale * ratio))
        if inputs is not None:
            out = _solve_comm(plan, inputs, out, iteration)
        else:
            predicted_comm = plan.predicted_iteration_s - plan.predicted_compute_s
            measured_comm = iteration - compute
            if predicted_comm > 1e-9 and measured_comm > 0:
                out = _with_comm(plan, out, previous, measured_comm / predicted_comm)
    return out if first else dataclasses.replace(out, overhead_s=epoch_overhead(plan, measured))


def calibrated(x, c: Calibration):
    """Planner inputs (`planners.strategy.StrategyInputs`) scaled by `c`: whole-step times
    by `step_scale`, per-layer times by `layer_scale`, the store collectives and sync
    checkpoint by `sync_scale`, the activation transfers by `transfer_scale`."""
    k, s, t = c.layer_scale, c.sync_scale, c.transfer_scale
    w = c.step_scale
    if k == s == t == w == 1.0:
        return x
    times = ("forward_s", "backward_s", "forward_fixed_s", "backward_fixed_s")
    layers = tuple({key: (v * k if key in times else v) for key, v in layer.items()} for layer in x.layers)
    tc = x.transfer_costs
    transfer = TransferCosts(put_latency_s=tc.put_latency_s * t, put_bandwidth=tc.put_bandwidth / t,
                             get_latency_s=tc.get_latency_s * t, get_bandwidth=tc.get_bandwidth / t,
                             handoff_s=tc.handoff_s * t)
    sync_bandwidth, sync_latency = x.sync_link
    return replace(x, layers=layers, step_s=x.step_s * w, optimizer_step_s=x.optimizer_step_s * k,
                   synced_step_s=None if x.synced_step_s is None else x.synced_step_s * w,
                   transfer=transfer, bandwidth=x.bandwidth / t, latency=x.latency * t,
                   sync_bandwidth=sync_bandwidth / s, sync_latency=sync_latency * s,
                   checkpoint_s=sync_checkpoint_s(x) * s)
