"""One Local-SGD replica's epoch as a worker runs it (`engine.local_sgd` is the algorithm).

The replica trains its batches with `LocalSGD` and rank 0 writes the averaged reference
checkpoint for the next epoch at `spec.out_key`. Its batches are global sample ids
(`engine.replica_data`): the epoch's order, a function of the seed, the epoch and the dataset's
shards alone, cut for `spec.world` replicas, so every sample is trained exactly once per epoch
whatever the world; `spec.steps` must be a fresh epoch's count for that world
(`engine.epoch_order.epoch_steps`), and the rows come shard by shard through
`engine.shard_stream.ShardStream`.

Resuming inside an epoch (the relaunch protocol)
------------------------------------------------
Sync round r of epoch e uses scratch keys under `runs/<id>/sync/e<e>/r<r>/`.

1. After round r, rank 0 writes the averaged state (weights, optimizer state) and the data
   position (epoch, step, round) in one atomic put to the durable sync checkpoint
   `runs/<id>/ckpt/sync-e<e>.safetensors`; once it is in the store, rank 0 deletes the keys
   of the rounds up to the previous checkpoint's (every round: round r - 1's). The put runs
   behind the training thread (`engine.checkpoint.CheckpointWriter`: the state is copied at once, and the store's round trip, a file's fsync or a request,
   overlaps step r + 1 and its sync): rank 0 may post round r + 1 while checkpoint r is in
   flight, but it starts checkpoint r + 1 only once checkpoint r is stored, so it posts
   nothing for round r + 2 before then. A rank 0 killed with a put in flight is one killed
   just before that put. (Every rank has finished round r - 1 by then: each posted its
   round-r pieces, which it does only after reading all of round r - 1.)
2. A relaunched replica (`attempt > 0`, or `spec.resume`)
   loads the sync checkpoint when it belongs to this run, epoch, world, period, step
   count, batch size, seed and init key; otherwise it starts from `init_key`. From step s
   of round c it skips its first s batches (their shards are not read), trains steps s..,
   and joins round c + 1 with the same state and data as its dead predecessor, so its
   contributions are the same numbers (bit-identical when both run with the same threads
   and kernels).
3. The replica rejoins without deadlock: its peers wait in round c + 3 at most (they need
   its contributions to get further, and its predecessor posted nothing for round c + 3,
   which needs checkpoint c + 1 stored, and the relaunch would have found that). Rounds
   >= c + 1 are still in the store: rank 0 deletes round r - 1 only after checkpoint r is
   stored. Within a round the collective is idempotent (`comm.collectives`): a reduced
   slice already posted is adopted, pieces stay until their reader posted its result,
   and pieces nobody needs are not sent again; so the relaunch replays rounds c + 1 and
   c + 2 from what its predecessor posted, as a checkpoint every two rounds would. With a
   cadence in seconds the same holds checkpoint by checkpoint: a relaunch that read
   checkpoint k (or none: the epoch's start) while k + 1 was in flight finds every round
   after k, which go only once k + 2 is stored; k + 2 starts only once k + 1 is stored, so
   only a write that outlasts a whole interval while the predecessor is ahead of rank 0 could
   drop a round the relaunch needs, and then its wait times out and the coordinator reruns
   the attempt from the sync checkpoint (step 2 for every rank).
4. The release at the end is idempotent too (`release_group(resumed=True)`), and rank 0
   rewrites the epoch checkpoint from the final sync checkpoint when it is the relaunch.

The collective (`spec.sync.collective`): `plain` (default, `comm.collectives`),
`pipelined` (`comm.scatter_reduce`), or `ring`: a direct ring allreduce over
torch.distributed (`comm.ring_allreduce`) for targets whose workers reach each other,
rank 0 listening on `sync.ring_host` (default 127.0.0.1), with
`sync.ring_timeout_s` (default `sync_timeout_s`) for the rendezvous and each sync. A
torch.distributed group cannot take a relaunched rank, so with the ring a worker failure
fails the epoch attempt: the survivors raise `RingError` (a peer died) or `RingTimeout`
(a peer never came or stopped calling) instead of waiting, and the coordinator reruns the
epoch, every rank resuming from the sync checkpoint (steps 1 and 2 above; 3 does not apply).

Every step (`sync_period` 1, K-AVG on float32, `sync.every_step` = `gradients`, the
default): the replicas average gradients, not weights (`engine.local_sgd`,
`engine.gradient_buckets`), still one round per step. Round r's buckets are started during
step r's backward under `.../r<r>/b<bucket>` and waited for before its optimizer step; rank 0
writes checkpoint r after that step, as in step 1, before any bucket of round r + 1 starts.
Every replica then holds the same weights, optimizer state and (averaged in the first
bucket) float buffers, so the checkpoint is each replica's state, and steps 2-4 hold per
bucket: a relaunch from round c recomputes step c + 1's gradients from the same state and
batch, and each bucket's call replays as a round's call does (reduced slices already posted
are adopted, lost keys re-posted from a log kept per bucket). With the ring a failure still
fails the attempt, and the rerun resumes every rank from the checkpoint.

`sync.checkpoint_every` = n writes the sync checkpoint every n rounds (default 1;
the last round always) and keeps n rounds of results in the store; 0 turns sync
checkpoints off, and with them single-replica relaunch (each round then deletes the one
before, as without faults). Over the ring, and over the store when every step averages
gradients, the cadence is in seconds instead (`CheckpointCadence`, `cadence_for`): at most
one sync checkpoint per `sync.checkpoint_s` (default 1 s; the last round always), so an
every-step sync does not pay a put per step. The ring keeps nothing of its rounds, so its
checkpoint only bounds what a failed attempt loses (the rerun resumes every rank from it).
The store keeps every round since the last checkpoint, as with n rounds above, so steps
2-4 hold for a relaunch from it; a checkpoint is also due once those rounds hold
`REPLAY_KEPT_BYTES`, which bounds the scratch the replay needs. A float32 sync over the store
(no residuals: rank 0 alone decides which rounds are checkpointed) takes the same cadence in
seconds where `sync.checkpoint_interval_s` is set: the coordinator sets the interval that balances
a checkpoint's cost against the work a crash loses (`planners.checkpoint_cadence`). Its clock
starts at the epoch's start (the epoch checkpoint), and its last round is not checkpointed as
such: the rounds since the last checkpoint are kept until the group's release, so a rank lost
after the last round replays them as after any other (an epoch shorter than the interval
writes no sync checkpoint).

The outer step and the wire (`spec.sync.outer_optimizer`, `outer_lr`, `outer_momentum`,
`sync_dtype`; `engine.outer`, `comm.compression`): the outer momentum travels in both
checkpoints (`outer/...` tensors) and each rank's error-feedback residual in its own durable
keys (`engine.residuals`), written at every round the sync checkpoint is, before the rank
posts its reduced slice; so a relaunch at round c resumes both from round c as in step 2,
and the epoch checkpoint names the residuals the next epoch continues from (its own per
rank, or a world of another size its share of what is still owed).

A lone replica (world 1) writes no sync checkpoint at its last round: the epoch checkpoint
written next holds the same state (2 GB a write for GPT-2 small with Adam's moments) and names
the same point of the epoch (`position` in its metadata), so a relaunch that finds it complete
resumes from it with no step left (`load_start_point`); no peer waits on the relaunch.

Another world in the middle of an epoch (a resumed run with another worker count): a sync
checkpoint's position names the epoch's phases (`engine.epoch_order.Phase`: world, batch,
steps) before its own. A resuming replica (`spec.resume`) whose spec differs from the
checkpoint in its world only (`PHASE_FREE`) continues it as a new phase: the checkpoint's
phases plus (its world, batch, step) leave the samples not yet trained, which the new world
shares out (`engine.replica_data.replica_share`), each replica taking however many steps its
share holds; the state, the outer optimizer's and the round count continue, and with a
compressed sync each rank continues its slice of what every old rank still owed at that
round (`engine.residuals.continue_residual`; refused after a lone replica, whose residual is
not written mid-epoch). The coordinator deletes the epoch's sync keys before every attempt, so
no replica of the new world replays an old world's rounds. Each record in the history names
its phases and tallies the ids trained (`record_history`), so the epoch's records add up to
the dataset (`engine.replica_data.epoch_coverage`).

Work lost to a kill is therefore at most the steps since the last sync point, redone from
identical inputs; nothing is repeated or skipped beyond that interval. Every attempt
records what it trained in `runs/<id>/history/e<e>/r<rank>-a<attempt>.json`
(`read_epoch_history`) on the run's store, where its tensors go: the coordinator reads the
epoch's records once it ends, and a durable store bills a put and a read for each.

Lost scratch keys (Redis restarted without persistence): each rank keeps what it posted in
the current and previous round and posts it again when a wait stalls for
`sync.repost_s` seconds (default 5); a wait that still reaches `sync_timeout_s`
raises `StoreTimeout` (exit 3), after which the coordinator resumes the epoch from the sync
checkpoint. Checkpoints and data go to `spec.checkpoint_store` (a durable store URL) when the
worker's store is scratch-only, otherwise to the worker's store.
"""
from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
from torch import nn

from comm import heartbeat
from comm.compression import Compressor
from comm.ring_allreduce import RingGroup, open_ring
from comm.scatter_reduce import COLLECTIVES, allreduce_for
from comm.store import Store, open_store
from core.errors import OutOfMemory, ZooidValueError
from core.keys import (handover_key, residual_key, sync_checkpoint_key, sync_prefix, worker_history_key,
                       worker_history_prefix)
from core.outer_sync import averages_gradients, is_default, wire_bytes
from core.specs import WorkerResult, WorkerSpec
from engine.chaos import chaos_for
from engine import preemption
from engine.checkpoint import CheckpointWriter, load_checkpoint, read_checkpoint_meta, save_checkpoint
from engine.datasets import ShardSource, worker_shards
from engine.devices import to_compute, torch_device, torch_dtype
from engine.epoch_order import Phase, add_digests, sample_digest
from engine.iteration_clock import IterationClock
from engine.local_sgd import LocalSGD
from engine.models import build_model
from engine.objective import objective_for
from engine.optimizers import build_optimizer
from engine.outer import OuterStep
from engine.replica_data import check_steps, earlier_tally, replica_share
from engine.residuals import ResidualWriter, continue_residual, read_residual
from engine.shard_stream import ShardStream
from engine.validation_stream import streamed_validation

DEFAULT_COLLECTIVE = "plain"
"""A replica's collective when `spec.sync.collective` is None."""


def read_epoch_history(store: Store, run_id: str, epoch: int) -> list[dict]:
    """Every completed attempt's record for `epoch`, by rank then attempt."""
    records = [json.loads(store.get(k)) for k in store.list(worker_history_prefix(run_id, epoch))]
    return sorted(records, key=lambda r: (r["rank"], r["attempt"]))


def _validate(spec: WorkerSpec) -> None:
    if spec.world < 1 or not 0 <= spec.rank < spec.world:
        raise ZooidValueError("rank", f"must be in 0..world-1 with world >= 1, got {spec.rank}/{spec.world}")
    if spec.steps < 0 or spec.batch_size < 1:
        raise ZooidValueError("steps", f"steps >= 0 and batch_size >= 1 required, got {spec.steps}, {spec.batch_size}")
    if not spec.init_key or (spec.rank == 0 and not spec.out_key):
        raise ZooidValueError("init_key", "a worker needs init_key, and rank 0 an out_key")
    collective = spec.sync.collective or DEFAULT_COLLECTIVE
    if collective not in COLLECTIVES:
        raise ZooidValueError("sync.collective", f"must be one of {', '.join(COLLECTIVES)}, got {collective!r}")
    if spec.sync.sync_dtype == "int8" and spec.optimizer == "adam":
        raise ZooidValueError("sync.sync_dtype", "int8 rounds Adam's second moments on a per-block scale, "
                              "which can turn them negative; use bfloat16 with adam")
    if collective == "ring" and spec.sync.sync_dtype != "float32":
        raise ZooidValueError("sync.sync_dtype", "compressed syncs go through the store; the ring moves float32")


def wants_resume(spec: WorkerSpec) -> bool:
    """Whether this worker should continue from the epoch's sync checkpoint: a relaunch
    (`attempt > 0`) or an explicit `spec.resume`."""
    return spec.attempt > 0 or spec.resume


def _position_identity(spec: WorkerSpec) -> dict:
    """What a sync checkpoint must share with a spec to be a point of the same epoch."""
    identity = {"run_id": spec.run_id, "epoch": spec.epoch, "world": spec.world, "steps": spec.steps,
                "sync_period": spec.sync_period, "batch_size": spec.batch_size, "seed": spec.seed,
                "init_key": spec.init_key}
    if not is_default(spec.sync.outer_optimizer, spec.sync.sync_dtype):
        identity.update(outer_optimizer=spec.sync.outer_optimizer, sync_dtype=spec.sync.sync_dtype)
    if spec.sync_period == 1 and spec.sync.every_step != "gradients":
        identity.update(every_step=spec.sync.every_step)  # Adam's moments differ between the two
    return identity


PHASE_FREE = ("world", "steps")
"""What a spec may differ in from a sync checkpoint of its epoch and still continue it: the
world (and with it a fresh epoch's step count); its replicas then start a new phase over the
samples the checkpoint's world left (`engine.epoch_order`)."""


def _continues(meta: dict | None, spec: WorkerSpec) -> str | None:
    """How `spec` continues a sync checkpoint's `meta`: "step" (a point of this very phase),
    "phase" (another world's point of the same epoch), or None (not at all)."""
    if meta is None:
        return None
    identity = _position_identity(spec)
    if all(meta.get(k) == v for k, v in identity.items()):
        return "step"
    if all(meta.get(k) == v for k, v in identity.items() if k not in PHASE_FREE) and "world" in meta:
        return "phase"
    return None


def _phases(meta: dict) -> tuple[Phase, ...]:
    """The earlier phases of the epoch a checkpoint's position names (none: its first)."""
    return tuple(Phase.from_dict(p) for p in meta.get("phases") or ())


def _shared_residual(spec: WorkerSpec, ckpt_store: Store, meta: dict) -> dict:
    """This rank's residual when a world of another size continues a compressed sync's
    checkpoint in the middle of the epoch: its slice of what every rank of the old world still
    owed at the checkpoint's round (`continue_residual`)."""
    old = int(meta["world"])
    if old == 1:
        raise ZooidValueError("workers", f"a compressed sync cannot continue a lone replica's epoch {spec.epoch} "
                              f"with {spec.world} workers (its residual is not written mid-epoch)")
    keys = [residual_key(spec.run_id, spec.epoch, r, int(meta["round"])) for r in range(old)]
    return continue_residual(ckpt_store, keys, spec.rank, spec.world)


@dataclass(frozen=True)
class StartPoint:
    """Where in its epoch a replica starts."""

    step: int
    """Optimizer steps already covered (batches to skip)."""
    round: int
    """Index of the next sync round."""
    global_step_before: int
    """Global step at the start of the epoch (for the epoch checkpoint)."""
    from_sync_checkpoint: bool
    outer_state: dict = field(default_factory=dict)
    """The outer optimizer's checkpointed tensors (`outer/...`)."""
    residual: dict = field(default_factory=dict)
    """This rank's error-feedback residual to continue (empty: zeros)."""
    phases: tuple[Phase, ...] = ()
    """The epoch's earlier phases (other worlds' parts, `engine.epoch_order`) that this
    replica's phase continues; `step` counts steps of its own phase."""
    since_sync: int = 0
    """Steps since the last sync round (a handover's, between two rounds; 0 at a sync point)."""
    handover: bool = False
    """Whether it is a preempted predecessor's handover (`_handover`)."""


def load_start_point(spec: WorkerSpec, ckpt_store: Store, model: nn.Module,
                     optimizer: torch.optim.Optimizer) -> StartPoint:
    """Load the state this replica starts from into `model` and `optimizer`: the epoch's
    sync checkpoint when resuming and it matches, else `spec.init_key`; with it the outer
    state and, for a compressed sync, this rank's residual of the same point."""
    key = sync_checkpoint_key(spec.run_id, spec.epoch)
    compressed = spec.sync.sync_dtype != "float32"
    outer: dict = {}
    if wants_resume(spec):
        done = _completed_epoch(spec, ckpt_store, model, optimizer, outer)  # a lone replica's furthest point
        if done is not None:
            return done
        handed = _handover(spec, ckpt_store, model, optimizer, outer)  # a preempted predecessor's own state
        if handed is not None:
            return handed
        try:
            # One read: the checkpoint may be overwritten meanwhile, so the meta must come
            # from the same blob as the tensors.
            meta = load_checkpoint(ckpt_store, key, model, optimizer, extra=outer)
        except KeyError:
            meta = None
        how = _continues(meta, spec)
        if how == "step":
            residual = (read_residual(ckpt_store, residual_key(spec.run_id, spec.epoch, spec.rank, int(meta["round"])))
                        if compressed and spec.world > 1 else {})
            return StartPoint(int(meta["step"]), int(meta["round"]) + 1,
                              int(meta.get("global_step_before", 0)), True, outer, residual, _phases(meta))
        if how == "phase":  # another world stopped here: a new phase over what it left
            residual = _shared_residual(spec, ckpt_store, meta) if compressed else {}
            phases = _phases(meta) + (Phase(int(meta["world"]), spec.batch_size, int(meta["step"])),)
            return StartPoint(0, int(meta["round"]) + 1, int(meta.get("global_step_before", 0)), True, outer,
                              residual, phases)
    else:
        ckpt_store.delete(handover_key(spec.run_id, spec.epoch, spec.rank))  # nor an abandoned handover
        if spec.rank == 0:
            ckpt_store.delete(key)  # an abandoned attempt's point must not be resumed by a relaunch
    init_meta = load_checkpoint(ckpt_store, spec.init_key, model, optimizer, timeout=spec.sync_timeout_s,
                                extra=outer)
    residual = (continue_residual(ckpt_store, list(init_meta.get("residual_keys") or ()), spec.rank, spec.world)
                if compressed else {})
    return StartPoint(0, 0, int(init_meta.get("global_step", 0)), False, outer, residual)


def _handover(spec: WorkerSpec, ckpt_store: Store, model: nn.Module, optimizer: torch.optim.Optimizer,
              outer: dict) -> StartPoint | None:
    """A preempted predecessor's handover (`_ReplicaEpoch.hand_over`), loaded into `model` and
    `optimizer` (and `outer`), when it is a point of this very phase at or after the epoch's
    sync checkpoint; None otherwise (and always over the ring, whose attempt reruns every rank
    from the sync checkpoint). The handover is this rank's state after its round `round` and
    `since_sync` more local steps: a sync checkpoint of one rank, so the relaunch protocol
    (module docstring, steps 2-4) holds from it as from round `round`'s checkpoint."""
    if spec.sync.collective == "ring":
        return None
    key = handover_key(spec.run_id, spec.epoch, spec.rank)
    synced = read_checkpoint_meta(ckpt_store, sync_checkpoint_key(spec.run_id, spec.epoch))
    try:
        meta = load_checkpoint(ckpt_store, key, model, optimizer, extra=outer)
    except KeyError:
        return None
    if meta.get("kind") != "handover" or _continues(meta, spec) != "step":
        return None
    if synced is not None and _continues(synced, spec) == "step" and int(synced["step"]) > int(meta["step"]):
        return None  # the group went further since: an older attempt's handover
    round_ = int(meta["round"])
    residual = (read_residual(ckpt_store, residual_key(spec.run_id, spec.epoch, spec.rank, round_))
                if spec.sync.sync_dtype != "float32" and spec.world > 1 else {})
    return StartPoint(int(meta["step"]), round_ + 1, int(meta.get("global_step_before", 0)), True, outer,
                      residual, _phases(meta), since_sync=int(meta.get("since_sync", 0)), handover=True)


def _lone_last_round(spec: WorkerSpec, step: int, steps: int) -> bool:
    """Whether a sync at `step` (of a phase of `steps`) is a lone replica's last: its epoch
    checkpoint, written next, stands in for the sync checkpoint (module docstring)."""
    return spec.world == 1 and step >= steps


def _completed_epoch(spec: WorkerSpec, ckpt_store: Store, model: nn.Module, optimizer: torch.optim.Optimizer,
                     outer: dict) -> StartPoint | None:
    """A lone replica's relaunch after its epoch checkpoint was written: the point at the
    epoch's end, loaded into `model` and `optimizer` (and `outer`); None when `spec.out_key`
    holds no complete checkpoint of this very epoch."""
    if spec.world != 1 or not spec.out_key:
        return None
    try:
        meta = load_checkpoint(ckpt_store, spec.out_key, model, optimizer, extra=outer)
    except KeyError:
        return None
    position = meta.get("position") or {}
    if not meta.get("epoch_complete") or any(position.get(k) != v for k, v in _position_identity(spec).items()):
        return None
    return StartPoint(int(position.get("step", spec.steps)), int(position["round"]) + 1,
                      int(position["global_step_before"]), True, outer, phases=_phases(position))


def run_local_sgd_epoch(spec: WorkerSpec, store: Store, open_ref: Callable[[str], Store] = open_store) -> WorkerResult:
    """Run replica `spec.rank` of one Local-SGD epoch against `store` (see module docstring);
    `open_ref` opens `spec.checkpoint_store` when it is another store."""
    started = time.time()
    _validate(spec)
    url = spec.checkpoint_store
    ckpt_store = open_ref(url) if url and url != store.url else store
    ring = None
    try:
        ring = _open_ring(spec, store)
        with worker_shards(spec, ckpt_store, open_ref) as shards:
            return _run(spec, store, ckpt_store, started, ring, shards)
    except (torch.OutOfMemoryError, MemoryError) as exc:
        raise OutOfMemory(f"rank {spec.rank} of {spec.model}, batch {spec.batch_size}: "
                          f"{type(exc).__name__}: {exc}") from None
    finally:
        if ring is not None:
            ring.close()
        if ckpt_store is not store:
            ckpt_store.close()


checkpoint_clock: Callable[[], float] = time.monotonic
"""The clock of a checkpoint cadence in seconds (a test may set its own)."""

REPLAY_KEPT_BYTES = 64 * 2**20
"""With a cadence in seconds through the store, the most bytes of rounds the store keeps for
a relaunch to replay: a checkpoint is due once the rounds since the last one hold this much."""


class CheckpointCadence:
    """Which sync rounds rank 0 checkpoints: every `every` rounds, or with `min_s` > 0 the
    first round at least `min_s` seconds on `clock` after the last checkpoint (or the
    `max_rounds`-th round after it, whichever comes first); the epoch's last round
    (`step >= steps`) always unless `last_always` is False (then as any other round); none when
    `every` is 0. A round's answer is given once and kept, so everyone who asks about it agrees."""

    def __init__(self, every: int, steps: int, min_s: float = 0.0, clock: Callable[[], float] = time.monotonic,
                 max_rounds: int | None = None, last_always: bool = True):
        """`steps`: the epoch's; the round that reaches it is the last."""
        self.every, self.steps, self.min_s, self.clock, self.max_rounds = every, steps, min_s, clock, max_rounds
        self.last_always = last_always
        self.last, self.last_round = clock(), -1
        self._answer: tuple[int, bool] | None = None

    def due(self, round_: int, step: int) -> bool:
        if self._answer is None or self._answer[0] != round_:
            if not self.every:
                due = False
            elif step >= self.steps and self.last_always:
                due = True
            elif self.min_s:
                due = (self.clock() - self.last >= self.min_s
                       or (self.max_rounds is not None and round_ - self.last_round >= self.max_rounds))
            else:
                due = (round_ + 1) % self.every == 0
            self._answer = (round_, due)
        return self._answer[1]

    def written(self, round_: int) -> None:
        """Round `round_`'s checkpoint was just written: the next one is `min_s` from now."""
        self.last, self.last_round = self.clock(), round_


def cadence_for(spec: WorkerSpec, model: nn.Module, ring: RingGroup | None,
                steps: int | None = None) -> CheckpointCadence:
    """The checkpoint cadence of an epoch (of a phase of `steps` steps; None: `spec.steps`): in seconds (`sync.checkpoint_s`) over a ring, and over
    the store when every step averages gradients (no rank keeps residuals that would have
    to agree on the rounds), with the store's rounds kept for replay bounded by
    REPLAY_KEPT_BYTES; over the store in `sync.checkpoint_interval_s` seconds where it is set and
    the sync carries no residuals, bounded the same way; by `sync.checkpoint_every` rounds otherwise,
    a compressed sync's (whose ranks write residuals at its rounds: a count they all agree on) at
    most as many as REPLAY_KEPT_BYTES holds of its wire."""
    sync, steps = spec.sync, spec.steps if steps is None else steps
    if ring is not None:
        return CheckpointCadence(sync.checkpoint_every, steps, sync.checkpoint_s, checkpoint_clock)
    param_bytes = sum(t.numel() * t.element_size() for t in model.parameters()) or 1
    if averages_gradients(spec.sync_period, sync.outer_optimizer, sync.sync_dtype, sync.every_step):
        return CheckpointCadence(sync.checkpoint_every, steps, sync.checkpoint_s, checkpoint_clock,
                                 max_rounds=max(1, REPLAY_KEPT_BYTES // param_bytes))
    if sync.checkpoint_interval_s and sync.sync_dtype == "float32" and sync.checkpoint_every:
        # rank 0 alone decides (no rank writes residuals on the checkpoint's rounds); a round
        # carries the weights and up to two optimizer moments. The last round is not due as
        # such: a rank lost after it replays the rounds kept since the last checkpoint (or the
        # epoch's start, whose checkpoint the interval's clock starts from), as after any round
        return CheckpointCadence(sync.checkpoint_every, steps, sync.checkpoint_interval_s, checkpoint_clock,
                                 max_rounds=max(1, REPLAY_KEPT_BYTES // (3 * param_bytes)), last_always=False)
    if sync.sync_dtype != "float32" and sync.checkpoint_every:  # every rank computes the same bound
        kept = max(1, int(REPLAY_KEPT_BYTES // max(1.0, wire_bytes(3 * param_bytes, sync.sync_dtype))))
        return CheckpointCadence(min(sync.checkpoint_every, kept), steps)
    return CheckpointCadence(sync.checkpoint_every, steps)


def _outer_and_wire(spec: WorkerSpec, start: StartPoint, device: torch.device,
                    ckpt_store: Store) -> tuple[OuterStep | None, Compressor | None, ResidualWriter | None]:
    """The outer step (None: K-AVG on float32, today's arithmetic), the compressor and the
    residual keys of a compressed sync, each continuing `start`."""
    sync = spec.sync
    if is_default(sync.outer_optimizer, sync.sync_dtype):
        return None, None, None
    outer = OuterStep(sync.outer_optimizer, sync.outer_lr, sync.outer_momentum,
                      deltas=sync.sync_dtype != "float32")
    outer.load_state_tensors(start.outer_state, device)
    if sync.sync_dtype == "float32":
        return outer, None, None
    return (outer, Compressor(sync.sync_dtype, residual=start.residual),
            ResidualWriter(ckpt_store, spec.run_id, spec.epoch, spec.rank))


def _group(spec: WorkerSpec) -> str:
    return spec.sync.group or sync_prefix(spec.run_id, spec.epoch)


def _open_ring(spec: WorkerSpec, store: Store) -> RingGroup | None:
    """The epoch's ring when `spec.sync.collective` is `ring`, else None. Opened before
    training, so a missing peer fails the attempt before any work is done."""
    if spec.sync.collective != "ring":
        return None
    timeout = float(spec.sync.ring_timeout_s or spec.sync_timeout_s)
    return open_ring(store, _group(spec), spec.rank, spec.world, timeout,
                     host=spec.sync.ring_host, device=torch_device(spec.compute))


def _run(spec: WorkerSpec, store: Store, ckpt_store: Store, started: float,
         ring: RingGroup | None, shards: ShardSource) -> WorkerResult:
    """One replica's epoch in its steps (`_ReplicaEpoch`): set up, the inner loop with its
    syncs, the epoch's end (residuals, epoch checkpoint, release), evaluation and record."""
    epoch = _ReplicaEpoch(spec, store, ckpt_store, ring, shards)
    try:
        loss_sum = epoch.train()
        checkpoint_key = epoch.finish()
        train_loss = loss_sum.item() / max(1, epoch.trained)
        loop_s = time.perf_counter() - epoch.loop_started
        val = epoch.validate()
        epoch.record_history(loop_s)
        return epoch.result(started, train_loss, loop_s, val, checkpoint_key)
    finally:
        epoch.release()


class _ReplicaEpoch:
    """One replica's epoch as named steps over its state, called in order by `_run`."""

    def __init__(self, spec: WorkerSpec, store: Store, ckpt_store: Store, ring: RingGroup | None,
                 shards: ShardSource):
        """Set-up: `spec.steps` checked against the dataset (a fresh epoch's count), the
        model and optimizer at the start point (`load_start_point`), this replica's batches of
        global sample ids (`engine.replica_data`: the epoch's order over what the start
        point's earlier phases left), then the syncs' machinery (`_set_up_syncs`)."""
        self.spec, self.ckpt_store, self.shards = spec, ckpt_store, shards
        self.device, self.dtype = device, dtype = torch_device(spec.compute), torch_dtype(spec.compute)
        self.chaos = chaos_for(spec, store)
        self.scratch = store
        """The worker's store: its history record and preempted marker go there, beside the
        fault markers (`core.keys`: the worker's records)."""
        model = build_model(spec.model, spec.seed, **spec.compute.model_kwargs)
        # data shards are durable: beside the checkpoints (or a prepared dataset's), not in the scratch store
        check_steps(spec.steps, shards.manifest, spec.world, spec.batch_size)
        self.model = model = model.to(device=device, dtype=dtype)
        self.optimizer = build_optimizer(spec.optimizer, model, spec.lr)
        self.start = load_start_point(spec, ckpt_store, model, self.optimizer)
        self.batches = replica_share(shards.manifest, spec.seed, spec.epoch, self.start.phases, spec.world,
                                     spec.batch_size, spec.rank)
        self.steps = len(self.batches)
        """This phase's steps: `spec.steps` unless it continues another world's phase."""
        self.objective = objective_for(spec.loss)
        self.rows = self.tokens = 0
        """Samples and tokens this attempt trained."""
        self.digest = sample_digest(np.concatenate(self.batches[:self.start.step] or [np.empty(0, np.int64)]))
        """The digest of the phase's ids this replica's state has trained (`record_history`)."""
        self._set_up_syncs(store, ring)

    def _set_up_syncs(self, store: Store, ring: RingGroup | None) -> None:
        """The sync checkpoint's key and position, the outer step and wire, the checkpoint
        cadence and writer, and `averaging` (`LocalSGD`), which calls `_on_sync` after
        each round and, with a compressed sync, `_write_residual` before a rank posts."""
        spec = self.spec
        self.sync_key = sync_checkpoint_key(spec.run_id, spec.epoch)
        self.position = {**_position_identity(spec), "kind": "sync",
                         "global_step_before": self.start.global_step_before,
                         "phases": [p.to_dict() for p in self.start.phases],
                         "model": spec.model, "optimizer": spec.optimizer}
        self.outer, self.compressor, self.residuals = _outer_and_wire(spec, self.start, self.device,
                                                                      self.ckpt_store)
        self.cadence = cadence_for(spec, self.model, ring, self.steps)
        self.kept_from = self.start.round
        """Rounds before this one may go once the next sync checkpoint is stored: those up to the
        previous checkpoint's, which no relaunch can need (one that read an older checkpoint found
        this one's rounds, see step 3); the rounds after it stay."""
        self.writer = CheckpointWriter(self.ckpt_store)
        if self.compressor is not None:
            self.compressor.before_result = self._write_residual
        self.averaging = LocalSGD(
            self.model, self.optimizer, store, _group(spec), spec.rank, spec.world, spec.sync_period,
            spec.sync_timeout_s, replayable=bool(spec.sync.checkpoint_every),
            repost_s=float(spec.sync.repost_s) or None,
            on_sync=self._on_sync, start_round=self.start.round, start_step=self.start.step,
            since_sync=self.start.since_sync, replay=wants_resume(spec),
            allreduce=allreduce_for(spec.sync.collective or DEFAULT_COLLECTIVE, "mean", ring=ring),
            outer=self.outer, compressor=self.compressor, ring=ring,
            average_gradients=averages_gradients(spec.sync_period, spec.sync.outer_optimizer,
                                                 spec.sync.sync_dtype, spec.sync.every_step),
            bucket_bytes=int(spec.sync.bucket_mb * 2**20))
        self.averaging.before_sync = self.chaos.during_sync
        if self.outer is not None and self.start.handover:  # the last sync's θ_global, not the local state
            self.outer.load_ref_tensors(self.start.outer_state, self.device)

    def release(self) -> None:
        """Break the callbacks that point back here (`averaging.on_sync`, the compressor's
        `before_result`), so the epoch's model, optimizer and batches are freed when it returns
        rather than at Python's next full collection: the cycle held a warm worker's every
        epoch (resnet18: RSS +130 MB an epoch, and an OOM-killed container by its third)."""
        self.averaging.on_sync = None
        if self.compressor is not None:
            self.compressor.before_result = None

    def _on_sync(self, round_: int, step: int) -> None:
        """After sync round `round_` (at a period boundary): rank 0 starts the round's sync
        checkpoint when the cadence says it is due (step 1 of the module docstring)."""
        spec, averaging = self.spec, self.averaging
        if spec.rank == 0 and self.cadence.due(round_, step) and not _lone_last_round(spec, step, self.steps):
            # in the background; this waits for the one before
            meta = {**self.position, "step": step, "round": round_}
            kept_from, self.kept_from = self.kept_from, round_ + 1
            self.writer.write(self.sync_key, self.model, self.optimizer, meta,
                              extra=self.outer.state_tensors() if self.outer else None,
                              then=lambda: averaging.drop_rounds_before(kept_from))
            self.cadence.written(round_)
            if self.chaos.pending:
                self.writer.wait()  # a planned fault finds the checkpoint where it always did
        self.chaos.after_sync(step)

    def _write_residual(self) -> None:
        """Before this rank posts its reduced slice (`engine.residuals`): its error-feedback
        residual, at every round the sync checkpoint is written and at the epoch's last."""
        averaging = self.averaging
        if self.cadence.due(averaging.rounds, averaging.steps) or averaging.steps >= self.steps:
            self.residuals.write(averaging.rounds, self.compressor.residual)

    def train(self) -> torch.Tensor:
        """The inner loop: from the start point's step (the batches before it, which the
        checkpointed state already covers, are not read), each batch's rows read through a
        `ShardStream`, then the step's forward, backward and optimizer step, then
        `averaging.after_step`, which syncs at a period boundary. Returns the summed loss;
        `loop_started` and `clock` time it. While it runs, a notice that comes during a wait
        for a peer ends the wait (`leave_from_a_wait`)."""
        todo = self.batches[self.start.step:]
        loss_sum = torch.zeros((), device=self.device)
        self.model.train()
        self.clock = IterationClock()
        self.loop_started = time.perf_counter()
        heartbeat.set_wait_guard(preemption.stop_waiting)  # the notice ends a wait for a peer
        try:
            self._train_steps(todo, loss_sum)
        finally:
            heartbeat.set_wait_guard(None)
        if preemption.due():  # the notice came in the last step: the replacement only ends the epoch
            self.hand_over(self.steps)
        return loss_sum

    def _train_steps(self, todo: list, loss_sum: torch.Tensor) -> None:
        """The steps of `train`, their losses added into `loss_sum`."""
        spec, model, optimizer, averaging = self.spec, self.model, self.optimizer, self.averaging
        device, dtype = self.device, self.dtype
        with ShardStream(self.shards, todo, seed=spec.seed, epoch=spec.epoch) as stream:
            self.stream = stream
            for step, (ids, (x, y)) in enumerate(zip(todo, stream), start=self.start.step):
                if preemption.due():
                    self.hand_over(step)
                self.chaos.before_step(step)
                if preemption.due():  # a notice injected right here leaves here
                    self.hand_over(step)
                x, y = to_compute(x, device, dtype), to_compute(y, device, dtype)
                loss = self.objective.loss(model(x), y)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                loss_sum += loss.detach()
                self.rows += len(y)
                self.tokens += self.objective.tokens(y)
                self.digest = add_digests(self.digest, sample_digest(ids))
                try:
                    averaging.after_step()
                except preemption.NoticeWhileWaiting:
                    self.leave_from_a_wait(step + 1)
                self.clock.tick()

    def leave_from_a_wait(self, done: int) -> None:
        """The notice came while this rank waited at the sync after `done` steps for a peer
        that is not there (gone, its replacement still starting): waiting on would run into
        the SIGKILL at the end of the grace. It leaves now with nothing handed over (its round
        is not complete): the replacement starts from the epoch's sync checkpoint and replays
        the rounds since (the collective's keys are idempotent), redoing at most the steps
        since that checkpoint, as after a crash. Marked preempted at `done`, raises `Preempted`."""
        self.writer.wait()  # a sync checkpoint in flight: the replacement starts from it
        preemption.leave(self.scratch, self.spec, done, "", start_step=self.start.step,
                         trained_s=time.perf_counter() - self.loop_started, left="waiting at a sync")

    def hand_over(self, step: int) -> None:
        """The notice came (`engine.preemption`): at this step boundary, wait for a sync
        checkpoint in flight, write this rank's handover checkpoint (its local model and
        optimizer, the outer state: momentum and the last sync's snapshot that the next round's
        deltas and step start from; its position: phases, `step`, the last round and the steps
        since it; with a compressed sync its residual at that round, as a round's), mark the
        attempt preempted and raise `Preempted`. Over the ring nothing is handed over (the
        attempt reruns from the sync checkpoint)."""
        spec, averaging = self.spec, self.averaging
        self.writer.wait()
        key = ""
        if spec.sync.collective != "ring":
            round_ = averaging.rounds - 1
            if self.compressor is not None and spec.world > 1:
                self.residuals.write(round_, self.compressor.residual)
            key = handover_key(spec.run_id, spec.epoch, spec.rank)
            meta = {**self.position, "kind": "handover", "step": step, "round": round_,
                    "since_sync": averaging.since_sync, "attempt": spec.attempt}
            save_checkpoint(self.ckpt_store, key, self.model, self.optimizer, meta,
                            extra={**self.outer.state_tensors(), **self.outer.ref_tensors()} if self.outer else None)
        preemption.leave(self.scratch, spec, step, key, start_step=self.start.step,
                         trained_s=time.perf_counter() - self.loop_started)

    @property
    def trained(self) -> int:
        """Steps this attempt trained."""
        return self.steps - self.start.step

    def finish(self) -> str:
        """The epoch's end: the last sync and checkpoint put, the residuals' keys, rank 0's
        epoch checkpoint, then the group's release. Returns the epoch checkpoint's key
        (rank 0; "" for the others)."""
        self.averaging.flush()
        self.writer.wait()
        residual_meta = self._finish_residuals()
        checkpoint_key = ""
        if self.spec.rank == 0:
            # Written before the release: a relaunched rank 0 that finds the group released
            # knows this checkpoint is already there (it rewrites it anyway, same bytes).
            checkpoint_key = self._epoch_checkpoint(residual_meta)
        self.averaging.release(resumed=wants_resume(self.spec))
        return checkpoint_key

    def _finish_residuals(self) -> dict:
        """With a compressed sync, this rank's last residual and the metadata that names every
        rank's for the next epoch (`residual_keys`); {} otherwise."""
        spec = self.spec
        if self.compressor is None:
            return {}
        last = self.averaging.rounds - 1
        if spec.world == 1:  # no collective ran: the residual is the one this rank started with
            self.residuals.write(last, self.compressor.residual)
        self.residuals.finish(last)
        return {"residual_keys": [residual_key(spec.run_id, spec.epoch, r, last) for r in range(spec.world)]}

    def _epoch_checkpoint(self, residual_meta: dict) -> str:
        """Rank 0's epoch checkpoint at `spec.out_key`: the averaged state, the outer state and
        a position that names the epoch's end (`_completed_epoch`). Returns its key."""
        spec, start = self.spec, self.start
        epoch_steps = sum(p.steps for p in start.phases) + self.steps  # a replica's, over the epoch's phases
        meta = {
            "run_id": spec.run_id, "epoch": spec.epoch, "epoch_complete": True,
            "steps": spec.steps, "global_step": start.global_step_before + epoch_steps,
            "world": spec.world, "model": spec.model, "optimizer": spec.optimizer,
            "outer_optimizer": spec.sync.outer_optimizer, "sync_dtype": spec.sync.sync_dtype, **residual_meta,
            "position": {**_position_identity(spec), "round": self.averaging.rounds - 1, "step": self.steps,
                         "phases": [p.to_dict() for p in start.phases],
                         "global_step_before": start.global_step_before},
        }
        save_checkpoint(self.ckpt_store, spec.out_key, self.model, self.optimizer, meta,
                        extra=self.outer.state_tensors() if self.outer else None)
        return spec.out_key

    def validate(self):
        """Rank 0's validation metrics of the averaged model when `spec.evaluate`, else None."""
        spec, dtype = self.spec, self.dtype
        if spec.rank != 0 or not spec.evaluate:
            return None
        # chunk by chunk through a ShardStream: memory does not grow with the validation split
        return streamed_validation(self.model, self.shards, self.objective, seed=spec.seed,
                                   convert=lambda t: to_compute(t, t.device, dtype))

    def record_history(self, loop_s: float) -> None:
        """This attempt's record of what it trained (`read_epoch_history`): its steps and
        samples, and the tallies (count and digest of sample ids, `engine.replica_data`) of its
        phase's batches up to its end (`phase_tally`: what its state has trained, the steps a
        predecessor trained before the start point included) and of the earlier phases it
        continued (`earlier_tally`); `engine.replica_data.epoch_coverage` adds them up."""
        spec, start, stats = self.spec, self.start, self.averaging.stats
        record = {"run_id": spec.run_id, "epoch": spec.epoch, "rank": spec.rank, "attempt": spec.attempt,
                  "world": spec.world, "phases": [p.to_dict() for p in start.phases],
                  "start_step": start.step, "end_step": self.steps,
                  "steps_trained": self.trained, "samples": self.rows,
                  "phase_tally": {"samples": int(sum(len(b) for b in self.batches)), "digest": self.digest},
                  "earlier_tally": earlier_tally(self.shards.manifest, spec.seed, spec.epoch, start.phases),
                  "start_round": start.round, "end_round": self.averaging.rounds,
                  "from_sync_checkpoint": start.from_sync_checkpoint, "reposts": stats.reposts,
                  "compute_s": max(0.0, loop_s - stats.seconds), "sync_s": stats.seconds}
        self.scratch.put(worker_history_key(spec.run_id, spec.epoch, spec.rank, spec.attempt),
                         json.dumps(record).encode())

    def result(self, started: float, train_loss: float, loop_s: float, val, checkpoint_key: str) -> WorkerResult:
        """The worker's answer: losses, samples, tokens, seconds and bytes of the epoch."""
        spec, stats = self.spec, self.averaging.stats
        return WorkerResult(
            run_id=spec.run_id, epoch=spec.epoch, rank=spec.rank,
            started_at=started, stopped_at=time.time(),
            train_loss=train_loss, samples=self.rows,
            compute_s=max(0.0, loop_s - stats.seconds), sync_s=stats.seconds,
            upload_s=stats.upload_s, download_s=stats.download_s, bytes_synced=stats.bytes_total,
            **(val.result_fields() if val else {}), tokens=self.tokens,
            checkpoint_key=checkpoint_key,
            pid=os.getpid(), host=socket.gethostname(), iteration_s=self.clock.period_s(),
        )
