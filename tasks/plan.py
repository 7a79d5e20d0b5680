"""The `plan` step: choose the parallelism and predict an epoch's time and cost."""
from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from planners.plan import Plan, plan_local_sgd
from tasks.context import RunContext
from tasks.retry import task_options


def optimizer_copies(optimizer: str) -> int:
    """Copies of the parameters the optimizer state adds to each sync (averaged with them)."""
    return {"sgd": 0, "momentum": 1, "adam": 2}[optimizer]


def local_sgd_plan(ctx: RunContext, profile: dict, workers: int) -> Plan:
    """The Local-SGD plan for `workers` replicas from the measured profile."""
    job, target = ctx.job, ctx.resolved.target
    sync_bytes = profile["param_bytes"] * (1 + optimizer_copies(job.optimizer))
    return plan_local_sgd(
        workers=workers, train_samples=ctx.resolved.n_train, batch_size=job.batch_size,
        sync_period=job.sync_period, step_s=profile["step_s"], sync_bytes=sync_bytes,
        bandwidth=profile["store_bandwidth_bytes_per_s"], latency=profile["store_latency_s"],
        worker_vcpu=target.worker_vcpu, worker_memory_gb=target.worker_memory_gb,
        worker_gpu=target.worker_gpu, offer=ctx.resolved.offer.name,
        price_per_worker_s=ctx.price_per_worker_s)


def make_plan(ctx: RunContext, profile: dict, workers: int) -> Plan:
    """The plan for `workers` replicas with the alternatives the planner considered."""
    chosen = local_sgd_plan(ctx, profile, workers)
    alternatives = []
    for n in sorted({ctx.job.min_workers, max(1, workers // 2), workers, min(ctx.job.max_workers, workers * 2), ctx.job.max_workers}):
        if n * ctx.job.batch_size > ctx.resolved.n_train:
            continue
        alt = local_sgd_plan(ctx, profile, n)
        alternatives.append({"strategy": alt.strategy, "workers": n,
                             "predicted_iteration_s": alt.predicted_iteration_s,
                             "predicted_epoch_s": alt.predicted_epoch_s,
                             "predicted_cost_per_epoch_usd": alt.predicted_cost_per_epoch_usd,
                             "chosen": n == workers})
    return Plan.from_dict({**chosen.to_dict(), "alternatives": alternatives})


@task(name="plan", cache_policy=NO_CACHE, **task_options(retries=1, timeout_s=300))
def plan(ctx: RunContext, profile: dict, workers: int | None = None) -> Plan:
    """Plan the parallelism (Local-SGD with the job's worker count in this version)."""
    return make_plan(ctx, profile, workers or ctx.job.workers)
