"""The `rescale` step: the scaling policy picks the next epoch's worker count and learning rate."""
from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.context import RunContext
from tasks.retry import task_options


@task(name="rescale", cache_policy=NO_CACHE, **task_options(retries=1, timeout_s=120))
def rescale(ctx: RunContext, history: list[dict], workers: int, lr: float) -> dict:
    """`{"workers", "lr", "reason"}` for the next epoch, within min_workers..max_workers."""
    job = ctx.job
    if job.scaling == "static":
        decision = {"workers": workers, "lr": lr, "reason": "static"}
    else:
        from planners.scaling import decide_from_history

        decision = decide_from_history(job.scaling, history, workers=workers, lr=lr,
                                       min_workers=job.min_workers, max_workers=job.max_workers,
                                       deadline_s=job.deadline_s, budget_usd=job.budget_usd)
    # no replica may be left without data
    max_by_data = max(1, ctx.dataset.get("n_subsets", workers))
    decision["workers"] = max(job.min_workers, min(job.max_workers, max_by_data, decision["workers"]))
    return decision
