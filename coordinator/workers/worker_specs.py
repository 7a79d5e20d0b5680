"""The workers of one epoch: one `WorkerSpec` per replica (or per stage of each replica), the
attempt numbers that tell their tries apart, and where a direct ring allreduce listens.

`tasks.run_epoch` launches these specs and `coordinator.workers.warm_prestart` launches the next epoch's early;
both import them from here, so neither depends on the other for them.
"""
from __future__ import annotations

import math

from clouds.registry import is_cloud
from coordinator.run.collective import uses_ring
from coordinator.run.context import RunContext
from coordinator.run.job_data import is_prepared
from coordinator.run.outer_step import job_outer_settings
from core.keys import checkpoint_key
from core.kinds import PIPELINED_STRATEGIES
from core.outer_defaults import round_steps
from core.plan import Plan
from core.specs import ComputeSpec, DataSpec, SyncSpec, WorkerSpec
from engine.epoch_order import epoch_steps
from engine.pipeline_executor import pipeline_worker_specs
from planners.checkpoint_cadence import rounds_between_checkpoints


def ring_host(ctx: RunContext) -> str:
    """Where rank 0 of a direct ring listens: workers on other hosts publish their resolved
    address; local ones stay on 127.0.0.1."""
    return "auto" if is_cloud(ctx.resolved.target) else "127.0.0.1"


def next_attempt(ctx: RunContext, epoch: int, rank: int) -> int:
    """A fresh attempt number for (epoch, rank), unique across relaunches and task retries."""
    key = (epoch, rank)
    ctx.state.attempts[key] = ctx.state.attempts.get(key, -1) + 1
    return ctx.state.attempts[key]


def worker_specs(ctx: RunContext, plan: Plan, epoch: int, init: str, lr: float, attempt: int) -> list[WorkerSpec]:
    """One spec per replica (or per stage of each): its step count and the keys to read and
    write. Each replica's samples follow from the epoch's order (`engine.replica_data`); its
    steps are a fresh epoch's for the plan's replicas and batch (`epoch_steps`, which a worker
    checks). Each runs on the plan's capacity (`Plan.capacity`; a replacement may set its own)."""
    job = ctx.job
    steps = epoch_steps(ctx.state.dataset["n_train"], plan.data_parallel, plan.batch_size)
    # survivors wait at a sync long enough for a failed peer to be detected and relaunched
    timeout = job.worker_timeout_s + (300.0 if ctx.resolved.target.remote else 120.0)
    compute = ComputeSpec(model_kwargs=dict(ctx.resolved.model_kwargs))  # the dataset's vocabulary, mask token
    data = DataSpec(store=job.dataset if is_prepared(job.dataset) else "", cache_mb=job.data_cache_mb)
    if plan.strategy in PIPELINED_STRATEGIES:
        # a stage reads data and checkpoints from its one store: the durable one
        base = WorkerSpec(run_id=ctx.run_id, epoch=epoch, rank=0, world=plan.workers,
                          store_url=ctx.durable_ref, model=job.model, dataset=job.dataset,
                          steps=steps, batch_size=plan.batch_size, lr=lr,
                          optimizer=job.optimizer, seed=job.seed, init_key=init,
                          out_key=checkpoint_key(ctx.run_id, epoch), sync_timeout_s=timeout, attempt=attempt,
                          loss=job.loss or "", compute=compute, data=data, capacity=plan.capacity,
                          sync=SyncSpec(collective="ring", ring_host=ring_host(ctx)) if uses_ring(job, plan)
                          else SyncSpec(collective="pipelined", sync_dtype=job.sync_dtype))
        # a planner cut i splits after layer i; the executor's cut is where a stage begins
        return pipeline_worker_specs(base, cuts=[c + 1 for c in plan.cuts], microbatches=plan.microbatches,
                                     replicas=plan.data_parallel, schedule=plan.pipeline_schedule, chunks=plan.chunks)
    settings = job_outer_settings(job, steps)  # null fields follow the sync period
    outer = {"outer_optimizer": job.outer_optimizer, "outer_lr": settings.lr,
             "outer_momentum": settings.momentum, "sync_dtype": job.sync_dtype}
    if uses_ring(job, plan):
        sync = SyncSpec(collective="ring", ring_host=ring_host(ctx), ring_timeout_s=120.0, **outer)
    elif job.sync_dtype != "float32":  # every rank writes its residual at a checkpoint: rounds all ranks count alike
        rounds = math.ceil(steps / round_steps(job.sync_period, steps))
        sync = SyncSpec(**outer, checkpoint_every=rounds_between_checkpoints(
            plan.sync_checkpoint_s, plan.predicted_epoch_s, rounds))
    else:
        sync = SyncSpec(**outer, checkpoint_interval_s=plan.sync_checkpoint_s)
    return [WorkerSpec(run_id=ctx.run_id, epoch=epoch, rank=rank, world=plan.data_parallel,
                       store_url=ctx.store_ref, model=job.model, dataset=job.dataset,
                       steps=steps,
                       batch_size=plan.batch_size, lr=lr, optimizer=job.optimizer,
                       sync_period=job.sync_period, seed=job.seed, init_key=init,
                       out_key=checkpoint_key(ctx.run_id, epoch), sync_timeout_s=timeout, evaluate=True,
                       attempt=attempt, checkpoint_store=ctx.durable_ref, sync=sync, loss=job.loss or "",
                       compute=compute, data=data, capacity=plan.capacity)
            for rank in range(plan.data_parallel)]
