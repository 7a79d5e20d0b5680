"""The job's scaling policy applied to the run: the next epoch's worker count and learning rate
(`planners.scaling` decides from the history; Cynthia's provisioning problem for `deadline`),
and the counts a policy that decides in advance will choose (for the plan's run prediction and
the pre-start of the next epoch's workers).


The policies are pure (`planners.scaling`); this module turns the run's history into their
inputs. For the `deadline` policy it also builds Cynthia's provisioning problem from what
Zooid measured, with this mapping (Zooid has no parameter-server process):

- one "iteration" is one batch of `batch_size` samples; with n replicas, n of them run at
  once, so BSP's t_comp = w_iter / (n c_wk) holds with w_iter = the profiled step seconds on
  one vCPU (c_base = 1 vCPU) and c_wk = the offer's vCPU;
- the store plays the parameter server: b_ps = its measured bandwidth; its CPU is not the
  bottleneck (c_prof tiny), and g = the synchronised bytes divided by the Local-SGD period
  k (averaging every k steps moves 1/k of the bytes per step);
- the loss model (Cynthia Eq. 1) is fitted to this run's (iterations, validation loss)
  history, so the policy needs two epochs before it can act;
- the target loss is the job's `target_loss`, or half the first epoch's validation loss.
"""
from __future__ import annotations

import dataclasses

from coordinator.run.context import RunContext
from core.epoch_summary import EpochSummary, Rescale
from core.outer_sync import averages_gradients
from core.stage_memory import optimizer_copies
from planners.scaling import EpochRecord, ScalingSettings, decide, known_in_advance
from planners.worker_count import fit_loss_curve


def epoch_records(history: list[EpochSummary], batch_size: int) -> list[EpochRecord]:
    """The policies' view of the history."""
    return [EpochRecord(epoch=e.epoch, workers=e.workers // max(1, e.stages), seconds=e.seconds,
                        samples_per_s=e.samples_per_s, val_loss=e.val_loss, val_accuracy=e.val_accuracy,
                        cost_usd=e.cost_usd, iterations=e.samples // batch_size)
            for e in history]


def provision_document(ctx: RunContext, profile: dict, history: list[EpochSummary]) -> dict | None:
    """Cynthia's provisioning problem for the rest of this run (None until a loss model fits)."""
    job, offer, target = ctx.job, ctx.resolved.offer, ctx.resolved.target
    done, points = 0, []
    for e in history:
        done += e.samples // job.batch_size
        if e.val_loss:
            points.append((done, e.val_loss))
    if len(points) < 2:
        return None
    loss = fit_loss_curve(points)
    steps = max(1, history[-1].samples // (job.batch_size * max(1, history[-1].workers)))
    k = job.sync_period or steps
    copies = 0 if averages_gradients(job.sync_period, job.outer_optimizer, job.sync_dtype) else optimizer_copies(job.optimizer)
    sync_bytes = profile["param_bytes"] * (1 + copies) / k
    target_loss = job.target_loss or 0.5 * points[0][1]
    return {"mode": "BSP", "w_iter_flops": profile["step_s"], "g_param_bytes": sync_bytes,
            "c_prof_flops": 1e-9, "b_prof_bytes_per_s": sync_bytes / profile["step_s"],
            "c_base_flops": 1.0, "loss_model": {"beta0": loss.beta0, "beta1": loss.beta1},
            "target_loss": target_loss, "max_workers": job.max_workers,
            "instance_types": [{"name": offer.name, "cpu_flops": target.worker_vcpu,
                                "bandwidth_bytes_per_s": profile["store_bandwidth_bytes_per_s"],
                                "price_per_hour": ctx.price_per_worker_s * 3600}]}


def unmeasured_epoch(epoch: int, workers: int) -> EpochSummary:
    """A placeholder for an epoch not yet run, where a policy that decides in advance reads
    none of its measured figures."""
    return EpochSummary(epoch=epoch, workers=workers, train_loss=0.0, seconds=1.0, samples_per_s=1.0)


def n_subsets(ctx: RunContext) -> int:
    """The training data's subsets: the provisioned manifest's, or before provisioning what it
    will publish (`ResolvedJob.n_subsets`)."""
    return ctx.state.dataset.get("n_subsets", ctx.resolved.n_subsets)


def decide_next(ctx: RunContext, profile: dict, history: list[EpochSummary], workers: int, lr: float) -> Rescale:
    """The next epoch's worker count and learning rate, within min_workers..max_workers."""
    job = ctx.job
    provision = provision_document(ctx, profile, history) if job.scaling == "deadline" else None
    if job.scaling == "deadline" and provision is None:
        return Rescale(workers=workers, lr=lr, reason="deadline: waiting for two epochs to fit the loss curve")
    settings = ScalingSettings(min_workers=job.min_workers, max_workers=job.max_workers,
                               initial_workers=job.workers, lr=job.lr,
                               double_every_epochs=job.scale_every_epochs,
                               deadline_s=job.deadline_s, budget_usd=job.budget_usd,
                               provision=provision or {})
    decision = decide(job.scaling, epoch_records(history, job.batch_size), settings)
    # every replica needs at least one data subset
    most = max(1, min(job.max_workers, n_subsets(ctx)))
    return Rescale(workers=max(job.min_workers, min(most, decision.workers)), lr=decision.lr, reason=decision.reason)


def forecast_workers(ctx: RunContext, profile: dict, history: list[EpochSummary], workers: int,
                     lr: float) -> int | None:
    """The worker count the policy will choose after the epoch now starting, when that does not
    depend on what the epoch measures (`planners.scaling.known_in_advance`); else None."""
    if not known_in_advance(ctx.job.scaling, len(history) + 1):
        return None
    placeholder = (dataclasses.replace(history[-1], epoch=len(history), workers=workers, stages=1, val_loss=None,
                                       val_accuracy=None) if history else unmeasured_epoch(0, workers))
    return decide_next(ctx, profile, history + [placeholder], workers, lr).workers


def worker_schedule(ctx: RunContext, workers: int, epochs_left: int) -> list[int] | None:
    """The worker budget of each of the next `epochs_left` epochs (the first at `workers`) where
    the job's scaling policy decides them in advance (`static`, `adabatch`: they depend on how
    many epochs ran, not on what they measured); None for a policy that reacts to measurements."""
    job = ctx.job
    if job.scaling == "static":
        return [workers] * epochs_left
    if job.scaling != "adabatch" or epochs_left <= 0:
        return None
    done = max(0, job.epochs - epochs_left)
    counts = [workers]
    for k in range(1, epochs_left):
        history = [unmeasured_epoch(e, counts[-1]) for e in range(done + k)]
        counts.append(decide_next(ctx, {}, history, counts[-1], job.lr).workers)
    return counts
