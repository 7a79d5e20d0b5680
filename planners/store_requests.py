"""The store requests a plan's epoch makes (issue #45), derived from the protocols, for the run
prediction's store bill (`planners.store_prices` prices them).

Counted, all workers together:

- a store allreduce (`comm.collectives`, `comm.scatter_reduce`; none over the ring), per rank
  of W: W puts, 2 (W - 1) gets, W - 1 deletes and, in a group that is not replayed, the
  previous call's reduced slice; the group's release: W done keys, W - 1 reads by rank 0, two
  listings and two prefix deletes of W keys each (`delete_requests`, the store's own);
- over the ring (`comm.ring_allreduce`), a Local-SGD epoch's rendezvous and release alone: rank 0
  publishes its address, the W - 1 others read it, and the group is released as over the store,
  its calls' leftovers the address key alone (`ring_ops`);
- Local-SGD's rounds: one per `sync_period` steps (the last one shorter), one per epoch
  without a period, one per step (one bucket) when every step averages; with sync
  checkpoints every `checkpoint_every` rounds (the last always) or one per whole
  `Plan.sync_checkpoint_s` of the predicted epoch, rank 0's checkpoint put and
  a listing and delete of each round it no longer keeps; a compressed sync (bfloat16, int8)
  checkpoints every `rounds_between_checkpoints` rounds (the last always), each rank putting
  its error-feedback residual beside rank 0's checkpoint;
- a pipeline's hand-offs per replica and step: each of its p x v - 1 model-stage boundaries
  moves M activations forward and M gradients back (a put, a get and a delete each); after
  the epoch the last stage sends the loss to the others (p - 1), and replica 0's workers send
  their model stages' state to the last one; a stage's replicas average its gradients once a
  step (one bucket) over D;
- every worker reads the initial checkpoint; the epoch checkpoint is written once; a
  Local-SGD replica writes its history record.

Not counted: data reads (the shards' layout), validation's activations, the warm workers'
commands and status, a waiting get's misses (timing), the coordinator's own requests; over the
ring, the sync checkpoints rank 0 writes by the clock (at most one a second) before the last
round's, and a pipeline's stage rings' rendezvous (not yet derived from a measured epoch); a
large sync slice's or hand-off's multipart requests (a checkpoint's are, `checkpoint_requests`).
"""
from __future__ import annotations

import math
from typing import Callable

from core.kinds import Strategy
from planners.checkpoint_cadence import checkpoints_per_epoch, rounds_between_checkpoints
from core.plan import Plan
from core.polling import control_reads
from core.store_ops import StoreOps
from core.warm_cadence import REPLY_POLL_CAP_S, WarmCadence


def per_key(keys: int) -> int:
    """Delete requests of a store that deletes one key per request (a directory, Redis)."""
    return keys


def allreduce_ops(world: int, calls: int, previous_deleted: bool = True) -> StoreOps:
    """One rank's requests for `calls` calls of a store allreduce over `world` ranks."""
    if world <= 1 or calls <= 0:
        return StoreOps()
    return StoreOps(put=world * calls, get=2 * (world - 1) * calls,
                    delete=(world - 1) * calls + ((calls - 1) if previous_deleted else 0))


def release_ops(world: int, delete_requests: Callable[[int], int] = per_key) -> StoreOps:
    """Every rank's requests to release a group of calls (`comm.collectives.release_group`)."""
    if world <= 1:
        return StoreOps()
    return StoreOps(put=world, get=world - 1, list=2, delete=2 * delete_requests(world))


def ring_ops(world: int, delete_requests: Callable[[int], int] = per_key) -> StoreOps:
    """Every rank's requests of a Local-SGD epoch over the ring: the rendezvous (rank 0's address
    put, read by the W - 1 others) and the release (`release_ops`), whose first prefix delete
    finds the address key alone."""
    if world <= 1:
        return StoreOps()
    release = release_ops(world, delete_requests)
    return release + StoreOps(put=1, get=world - 1,
                              delete=delete_requests(1) + delete_requests(world) - release.delete)


def sync_rounds(plan: Plan) -> int:
    """Local-SGD rounds in one epoch of `plan`."""
    steps = max(1, plan.steps_per_epoch)
    if plan.sync_period is None:
        return 1
    return math.ceil(steps / max(1, plan.sync_period))


def epoch_store_ops(plan: Plan, *, ring: bool = False, checkpoint_every: int = 1,
                    delete_requests: Callable[[int], int] = per_key,
                    checkpoint_requests: tuple[int, int] = (1, 1)) -> StoreOps:
    """The requests one epoch of `plan` makes on the run's store (see the module docstring);
    `ring`: the replicas average over the ring, not the store; `checkpoint_requests`: the (put,
    get) requests of one checkpoint (several for a large one on a cloud store: its multipart
    upload, `core.object_requests`)."""
    d, p, steps = max(1, plan.data_parallel), max(1, plan.stages), max(1, plan.steps_per_epoch)
    put_ckpt, get_ckpt = checkpoint_requests
    ops = StoreOps(get=d * p * get_ckpt, put=put_ckpt)  # the initial checkpoint, read by every worker; the epoch's
    if plan.strategy == Strategy.LOCAL_SGD and p == 1:
        ops = ops + StoreOps(put=d)  # each replica's history record
        if d == 1:
            return ops
        if ring:  # and rank 0's sync checkpoint of the last round (those it writes by the clock: not counted)
            return ops + ring_ops(d, delete_requests) + StoreOps(put=put_ckpt if checkpoint_every > 0 else 0)
        rounds = sync_rounds(plan)
        replayed = checkpoint_every > 0
        ops = ops + StoreOps(**{k: v * d for k, v in allreduce_ops(d, rounds, not replayed).to_dict().items()})
        ops = ops + release_ops(d, delete_requests)
        if replayed:  # rank 0's sync checkpoints, each dropping the rounds before it
            writes = put_ckpt
            if plan.sync_dtype != "float32":  # by rounds, with each rank's residual
                every = rounds_between_checkpoints(plan.sync_checkpoint_s, plan.predicted_epoch_s, rounds)
                checkpoints, writes = math.ceil(rounds / every), put_ckpt * (1 + d)
            elif plan.sync_checkpoint_s:
                checkpoints = checkpoints_per_epoch(rounds, plan.predicted_epoch_s, plan.sync_checkpoint_s)
            else:
                checkpoints = math.ceil(rounds / checkpoint_every)
            ops = ops + StoreOps(put=checkpoints * writes, list=rounds - 1, delete=(rounds - 1) * delete_requests(d))
        return ops
    boundaries = p * max(1, plan.chunks) - 1 if p > 1 else 0
    moves = d * steps * boundaries * max(1, plan.microbatches) * 2  # activations forward, gradients back
    ops = ops + StoreOps(put=moves, get=moves, delete=moves)
    handoffs = d * (p - 1) + (p - 1) * max(1, plan.chunks)  # the loss, replica 0's model stages' state
    ops = ops + StoreOps(put=handoffs, get=handoffs, delete=handoffs)
    if d > 1 and not ring:  # each stage worker's gradients, averaged over the D replicas every step
        per_rank = allreduce_ops(d, steps)
        ops = ops + StoreOps(**{k: v * d * p for k, v in per_rank.to_dict().items()})
        ops = ops + StoreOps(**{k: v * p for k, v in release_ops(d, delete_requests).to_dict().items()})
    return ops


def command_wait_ops(workers: int, wait_s: float, cadence: WarmCadence, poll_s: float) -> StoreOps:
    """The reads of `workers` idle warm workers waiting `wait_s` seconds for their next command
    (`runtime.warm`: the control schedule from the store's poll, at most `check_s` apart), each a
    miss: the coordinator's time between their reply and the next epoch's send."""
    if workers <= 0 or wait_s <= 0:
        return StoreOps()
    return StoreOps(miss=workers * control_reads(wait_s, poll_s, poll_s, cadence.check_s))


def warm_channel_ops(workers: int, epoch_s: float, cadence: WarmCadence, *, poll_first_s: float,
                     poll_max_s: float) -> StoreOps:
    """The requests of one warm epoch of `epoch_s` seconds on the durable store that carries the
    warm channel (`runtime.warm`, `coordinator.workers.warm_pool`), all `workers` together: each
    worker's command (a put) and reply (a put, read once found); the coordinator's reads of the
    replies while it waits, one worker's a tick on `control_pause`'s schedule (misses); a busy
    worker's progress, written every `progress_s` and read twice as often; each worker's lease
    reads every `check_s`, and the coordinator's renewals every `renew_s`. A worker's wait for its
    next command (the coordinator's gap between epochs) is `command_wait_ops`."""
    if workers <= 0 or epoch_s < 0:
        return StoreOps()
    ticks = control_reads(epoch_s, max(poll_first_s, poll_max_s), poll_max_s, REPLY_POLL_CAP_S)
    progress = math.floor(epoch_s / cadence.progress_s)
    return StoreOps(put=2 * workers + workers * progress + math.floor(epoch_s / cadence.renew_s),
                    get=workers + workers * math.floor(epoch_s / cadence.status_every_s)
                    + workers * math.floor(epoch_s / cadence.check_s),
                    miss=ticks)
