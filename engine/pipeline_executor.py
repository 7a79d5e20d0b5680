"""One stage worker of a D x M pipeline for one epoch: an interpreter over its action list.

`run_pipeline_worker(spec, store)` runs stage worker `spec.stage.index` of replica
`spec.stage.replica`. With `spec.stage.chunks` = v (1 unless the schedule is `interleaved`)
the model is cut into p * v model stages (`len(cuts) + 1`) for p stage workers, and worker
w holds the v non-adjacent model stages w, w + p, ..., w + (v - 1) p
(`core.schedules.worker_of`); with v = 1 worker and model stage coincide.
Each iteration it runs its row of the lowered schedule (`core.schedules`:
GPipe, 1F1B or interleaved 1F1B with `spec.stage.schedule`) on three threads, as
FuncPipe's task executor (Sec. 4) and Hydrozoa's prefetching workers (Sec. 3.2) do:

- compute (the calling thread): F and B in schedule order, each dispatched to the model
  stage the action names, then SYNC and the optimizer step;
- download: every RECV of the iteration is queued at its start and fetched in order, so an
  activation or gradient arrives while earlier micro-batches are still computing;
- upload: a SEND queues the tensor and returns at once; the thread encodes and puts it.

Activations stay in memory from a micro-batch's forward to its backward, keyed by (model
stage, micro-batch); a tensor between two model stages on one worker (only when p = 1)
is handed over in memory, not through the store. Micro-batch m of
an iteration's batch of N rows has n_m rows and its mean loss is scaled by n_m / N, so the
gradients accumulated over the micro-batches are the full batch's mean-loss gradient. SYNC
averages one model stage's gradients over the D replicas of that stage (pipelined
scatter-reduce by default), while earlier stages may still be computing; an interleaved
worker syncs each of its chunks in its own group. With float32 syncs the gradients travel
in buckets (`engine.gradient_buckets`, `sync.bucket_mb`) that start during the stage's last
micro-batch's backward, each as soon as its gradients are complete (the ring's asynchronous
work, or a store call per bucket on a background thread); SYNC waits for them and writes
the means into `.grad`. A compressed sync (`sync.sync_dtype`) is one call after that backward. The
data order is Local-SGD's: replica r of D takes rank r of D's batches of the epoch's order
(`engine.replica_data`), read through `engine.shard_stream.ShardStream` by the worker of model
stage 0 (inputs) and the worker of the last model stage (labels), so hybrid D x M with plain
SGD equals Local-SGD with D replicas averaging every step, whatever the schedule; `spec.steps`
must be a fresh epoch's count for D replicas (`engine.epoch_order.epoch_steps`). A worker has one optimizer over all its chunks'
parameters: SGD, momentum and Adam update each parameter from its own gradient and state,
so the weights do not depend on how the model stages are placed.

After the last iteration replica 0 validates through the pipeline (forward only) and its
workers send their weights and optimizer state to the worker of the last model stage, which
writes one canonical full-model checkpoint (`engine.checkpoint` format, unsplit model's
keys) at `spec.out_key`, whatever the schedule and placement that trained it.

Store keys (all scratch, each deleted by its one reader):
`runs/<run>/act/e<epoch>/r<replica>/it<step>/{f,b}<from model stage>m<micro-batch>`
(activations, gradients), `.../val/f<model stage>m<chunk>`, `.../loss/s<worker>`,
`.../ckpt/s<model stage>`; gradient syncs use `runs/<run>/sync/e<epoch>/s<model stage>/r<step>`,
one call per bucket below it (`.../b<bucket>`).

The spec's `stage` (`core.specs.StageSpec`) says which worker this is and the pipeline's
shape (cuts, micro-batches, replicas, chunks, schedule or explicit action lines);
`sync.collective` is the stage's gradient sync (`pipelined` by default, `plain`, `ring` on
`sync.ring_host`), `compute` its device, dtype and model arguments. `spec.rank` and
`spec.world` are not used: `pipeline_worker_specs` fills them as replica * p + worker, D * p.
The worker itself is `engine.pipeline_stage_worker.StageWorker`.

Reporting: every worker reports its replica's mean training loss (the last model stage's
worker sends it to the others) and `samples` = rows its replica trained on, so throughput
sums worker-0 results only. `compute_s` is time in F and B only (so 1 - compute_s /
training time is the worker's measured bubble), `sync_s` time the compute thread is held by
the gradient sync (launching buckets during the last backward, then SYNC), `upload_s` /
`download_s` the transfer threads' busy time (a download's includes waiting for the
neighbour to post). Replica 0's worker of the last model stage reports validation and
`checkpoint_key`.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

import torch

from comm.scatter_reduce import COLLECTIVES
from comm.store import Store, open_store
from core.errors import OutOfMemory, ZooidValueError
from core.kinds import PipelineSchedule
from core.schedule_validation import validate
from core.schedules import SCHEDULES, TRANSFER, Action, Kind, Layout, ScheduleError, build_schedule, layout, \
    lower, parse_schedule
from core.specs import StageSpec, WorkerResult, WorkerSpec
from engine.datasets import worker_shards
from engine.devices import torch_dtype
from engine.pipeline_stage_worker import DEFAULT_COLLECTIVE, StageWorker


def iteration_schedule(stage: StageSpec) -> list[Action]:
    """Stage worker `stage.index`'s validated action list for one training iteration."""
    if stage.schedule not in SCHEDULES:
        raise ZooidValueError("stage.schedule", f"must be one of {', '.join(SCHEDULES)}, got {stage.schedule!r}")
    rows = (parse_schedule(stage.actions) if stage.actions
            else build_schedule(stage.schedule, stage.workers, stage.microbatches, stage.chunks))
    if len(rows) != stage.workers:
        raise ScheduleError(f"has {len(rows)} rows for {stage.workers} stage workers")
    if layout(rows).stages != stage.stages:
        raise ScheduleError(f"names model stages 0..{layout(rows).stages - 1} for a model cut into "
                            f"{stage.stages} stages on {stage.workers} workers")
    if not any(a.kind in TRANSFER or a.kind is Kind.SYNC for row in rows for a in row):
        rows = lower(rows, sync=True)  # a compute-only schedule: add what it implies
    validate(rows)
    synced = {a.stage for a in rows[stage.index] if a.kind is Kind.SYNC}
    own = Layout(stage.workers, stage.stages).stages_of(stage.index)
    if stage.replicas > 1 and synced != set(own):
        raise ScheduleError(f"worker {stage.index} has {stage.replicas} replicas but model stages "
                            f"{sorted(set(own) - synced)} never SYNC")
    return rows[stage.index]


def _check_worker(spec: WorkerSpec) -> None:
    """What a stage worker needs beyond its `StageSpec`'s own checks."""
    if spec.stage is None:
        raise ZooidValueError("stage", "is required for a pipeline worker")
    collective = spec.sync.collective or DEFAULT_COLLECTIVE
    if collective not in COLLECTIVES:
        raise ZooidValueError("sync.collective", f"must be one of {', '.join(COLLECTIVES)}, got {collective!r}")
    torch_dtype(spec.compute)


def pipeline_worker_specs(base: WorkerSpec, *, cuts, microbatches: int, replicas: int = 1,
                          schedule: str = PipelineSchedule.GPIPE, chunks: int = 1, actions: tuple[str, ...] = (),
                          val_chunk: int = 256) -> list[WorkerSpec]:
    """The D x p worker specs of one epoch, D = `replicas`, p = (len(cuts) + 1) / chunks.
    `base` gives everything else, its `sync.collective` included (None: `pipelined`, written
    into the specs)."""
    shape = StageSpec(index=0, cuts=tuple(cuts), microbatches=microbatches, replicas=replicas, chunks=chunks,
                      schedule=schedule, actions=tuple(actions), val_chunk=val_chunk)
    base = dataclasses.replace(base, sync=dataclasses.replace(
        base.sync, collective=base.sync.collective or DEFAULT_COLLECTIVE), stage=shape)
    _check_worker(base)  # fail here, not in a worker
    iteration_schedule(shape)  # the schedule is the same for every worker
    p = shape.workers
    return [dataclasses.replace(base, rank=r * p + w, world=replicas * p,
                                stage=dataclasses.replace(shape, index=w, replica=r))
            for r in range(replicas) for w in range(p)]


def run_pipeline_worker(spec: WorkerSpec, store: Store, open_ref: Callable[[str], Store] = open_store) -> WorkerResult:
    """Run one stage worker of one replica for one epoch (see the module docstring); `open_ref`
    opens a prepared dataset's store (`spec.data`)."""
    started = time.time()
    _check_worker(spec)
    if not spec.init_key or not spec.out_key:
        raise ZooidValueError("init_key", "a pipeline worker needs init_key and out_key")
    with worker_shards(spec, store, open_ref) as shards:
        worker = StageWorker(spec, store, iteration_schedule(spec.stage), shards)
        try:
            return worker.run(started)
        except torch.OutOfMemoryError as exc:
            raise OutOfMemory(f"stage {spec.stage.index} of {spec.model}, batch {spec.batch_size}: {exc}") from None
        finally:
            worker.close()
