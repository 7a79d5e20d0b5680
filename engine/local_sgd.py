"""Local-SGD (K-AVG): replicas that train on their own subsets and average through the store.

Each of `world` replicas starts from the reference checkpoint, takes `steps` optimizer
steps on its own subsets, and every `sync_period` steps (None: only at the end of the
epoch; there is always a sync at the end) the replicas replace their weights by the mean
over all replicas (KubeML Eq. 3.1) with the decentralised `allreduce_mean`. Rank 0 then
writes the averaged reference checkpoint for the next epoch.

Optimizer state at a sync: the momentum buffers (SGD momentum) and the Adam moments are
averaged in the same collective as the weights, and kept by the checkpoint. KubeML
(Sec. 4.5) reset momentum at each model load and saw noisy updates after every merge;
averaging the state instead (Yu et al., cited there) keeps the replicas' optimizers
consistent with the averaged point. Adam's moments are nonlinear in the gradients, so
there the average is an approximation; its step counter is equal on all replicas and is
not averaged.

Every step (period 1): gradients, not parameters. With period 1 (float32 wire, no outer
step) the replicas average their gradients instead, as DDP does (`engine.gradient_buckets`):
in buckets of `bucket_bytes` (25 MiB by default), each started as soon as backward has
produced its gradients, over the ring's asynchronous work or a store call per bucket on a
background thread; before `optimizer.step()` (an optimizer step pre-hook) every bucket is
waited for and its means written into `.grad`. Each step then moves one model's worth of
gradients, once, mostly hidden behind backward, where averaging parameters and optimizer
state moves two and only after the step. The replicas take identical steps from identical
states, so nothing else needs averaging:
- plain and momentum SGD give the same numbers as averaging parameters and momentum
  (w - lr * mean(g_i) = mean(w - lr * g_i); the momentum buffer mu * b + mean(g_i) is the
  average of the replicas' buffers), up to rounding; both are one process's step on the
  concatenated batch (mean-reduced loss, equal-size batches);
- Adam keeps the moments of the averaged gradient, equal on every replica: exactly DDP's
  semantics, and not what averaging parameters gives (the average of moments built from
  each replica's own gradient). `average_gradients=False` (`sync.every_step=parameters`)
  keeps the old behaviour;
- float buffers (batch-norm running statistics) are not gradients: they ride in the first
  bucket of every step and are replaced by their mean, as parameter averaging does, so the
  sync checkpoint rank 0 writes after each step holds every replica's buffers.
Rounds and keys are those of parameter averaging, one round per step; a round's call is one
call per bucket under `{group}/r{round}/b{bucket}`, so the relaunch protocol
(`engine.local_sgd_epoch`) holds as it is: round r's checkpoint is the state after step r,
a relaunch replays from there, and each bucket's call is idempotent and replayable.

This module holds the algorithm (`LocalSGD`, `validation_metrics`); the data order every
strategy shares is `engine.replica_data` (the epoch's order, `engine.epoch_order`); one
replica's epoch as a worker runs it, with the relaunch protocol and the collective's settings,
is `engine.local_sgd_epoch`.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Callable

import torch
from torch import nn

from comm import heartbeat
from comm.bandwidth import TransferStats
from comm.bucket_allreduce import RingBuckets, StoreBuckets
from comm.collectives import PostLog, flatten_by_dtype, allreduce_mean, release_group
from comm.compression import Compressor
from comm.ring_allreduce import RingGroup
from comm.scatter_reduce import Allreduce
from comm.store import Store
from core.errors import ZooidValueError
from core.keys import sync_call_prefix
from core.outer_sync import DEFAULT_BUCKET_MB
from engine.epoch_order import epoch_steps
from engine.gradient_buckets import GradientBuckets
from engine.objective import CROSS_ENTROPY, Metrics, Objective, Tally
from engine.optimizers import optimizer_state_tensors
from engine.outer import BUFFER_PREFIX, OuterStep

DEFAULT_REPOST_S = 5.0
"""Seconds a stalled wait lasts before a replica re-posts its pieces (`SyncSpec.repost_s`)."""


steps_per_epoch = epoch_steps
"""Steps each replica takes in a fresh epoch of `n_train` samples (`engine.epoch_order.epoch_steps`:
every sample once)."""


class LocalSGD:
    """Wraps a training loop: call `after_step()` after every optimizer step and `finish()`
    at the end; every `period` steps (None: only at `finish`) the weights, float buffers
    and optimizer state are replaced by their mean over the replicas. Averaging gradients
    (period 1), it hooks the parameters and the optimizer instead: one backward pass per
    step, and the step itself waits for the averaged gradients.

    `replayable`: keep each round's results until `drop_rounds_before` (called by whoever
    checkpoints), so a relaunched replica can replay rounds; otherwise each round deletes
    the previous one's. `on_sync(round, step)` runs after every sync. `start_round` and
    `start_step` place a resumed replica in the epoch (`since_sync`: its steps since the last
    sync, where it resumes between two, from a handover); `replay` marks a relaunch, which
    may find results of rounds its previous life took part in. `allreduce` is the
    collective (`scatter_reduce.allreduce_for`; the plain store one by default). `outer`
    is the round's outer step (`engine.outer`; None: K-AVG, the mean replaces the tensors)
    and `compressor` the wire format of a compressed sync (`comm.compression`).

    `average_gradients`: average each step's gradients in buckets during backward instead
    of the parameters after the step (see the module docstring); None: whenever the period
    is 1 with no outer step and a lossless wire. `ring` is the open ring the buckets use
    (the store collective `allreduce` otherwise), `bucket_bytes` their size."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        store: Store,
        group: str,
        rank: int,
        world: int,
        period: int | None = None,
        timeout: float = 120.0,
        *,
        replayable: bool = False,
        repost_s: float | None = DEFAULT_REPOST_S,
        on_sync: Callable[[int, int], None] | None = None,
        start_round: int = 0,
        start_step: int = 0,
        since_sync: int = 0,
        replay: bool = False,
        allreduce: Allreduce = allreduce_mean,
        outer: OuterStep | None = None,
        compressor: Compressor | None = None,
        average_gradients: bool | None = None,
        ring: RingGroup | None = None,
        bucket_bytes: int = int(DEFAULT_BUCKET_MB * 2**20),
    ):
        if period is not None and period < 1:
            raise ZooidValueError("sync_period", f"must be a positive step count or None, got {period}")
        plain = outer is None and (compressor is None or not compressor.lossy)
        if average_gradients is None:
            average_gradients = period == 1 and plain
        elif average_gradients and not (period == 1 and plain):
            raise ZooidValueError("sync.every_step", "gradients are averaged only every step (sync_period 1) "
                                  "with no outer optimizer and a float32 wire")
        self.model, self.optimizer, self.store = model, optimizer, store
        self.group, self.rank, self.world = group, rank, world
        self.period, self.timeout = period, timeout
        self.replayable, self.repost_s, self.on_sync = replayable, repost_s, on_sync
        self.replay, self.allreduce = replay, allreduce
        self.stats = TransferStats()
        self.log = PostLog()
        self.rounds = self._dropped = start_round
        self.steps = start_step
        self._since_sync = since_sync
        self.before_sync: Callable[[int], None] | None = None
        """Called with the step count as each sync starts (`engine.chaos`: a notice during a sync)."""
        self.outer, self.compressor = outer, compressor
        self._exact_layout: tuple | None = None
        self._exact: dict[str, torch.Tensor] | None = None
        if outer is not None:
            outer.start(self._shared_tensors())
        self.average_gradients = average_gradients
        self._buckets: GradientBuckets | None = None
        self._step_hook = None
        if average_gradients and world > 1:
            collective = (RingBuckets(ring) if ring is not None else
                          StoreBuckets(allreduce, store, group, rank, world, timeout, replayable=replayable,
                                       repost_s=repost_s, replay=replay))
            self._buckets = GradientBuckets(dict(model.named_parameters()), collective, stats=self.stats,
                                            bucket_bytes=bucket_bytes, extras=self._float_buffers)
            self._buckets.arm(self.rounds)
            # Before the step reads `.grad`: whatever loop drives the optimizer.
            self._step_hook = optimizer.register_step_pre_hook(lambda *_: self._buckets.finish())

    @property
    def since_sync(self) -> int:
        """Steps taken since the last sync (what a handover names, `engine.local_sgd_epoch`)."""
        return self._since_sync

    def _float_buffers(self) -> dict[str, torch.Tensor]:
        return {n: b for n, b in self.model.named_buffers() if b.is_floating_point()}

    def _shared_tensors(self) -> dict[str, torch.Tensor]:
        """The live tensors every replica must agree on, by name."""
        out = {f"param/{n}": p.data for n, p in self.model.named_parameters()}
        out.update({f"{BUFFER_PREFIX}{n}": b for n, b in self._float_buffers().items()})
        for n, t in optimizer_state_tensors(self.model, self.optimizer).items():
            # Scalars are step counters, equal on every replica; only moments are averaged.
            if t.is_floating_point() and t.dim() > 0:
                out[f"optim/{n}"] = t
        return out

    def sync(self) -> None:
        """Average the shared tensors over the replicas now (in place), through the outer
        step when there is one."""
        if self.before_sync is not None:
            self.before_sync(self.steps)
        live = self._shared_tensors()
        previous = sync_call_prefix(self.group, self.rounds - 1) if self.rounds and not self.replayable else None
        payload = live if self.outer is None else self.outer.payload(live)
        wire = {}
        if self.compressor is not None:
            self.compressor.exact = self._exact_positions(payload)
            wire = {"compressor": self.compressor}
        mean = self.allreduce(
            self.store, sync_call_prefix(self.group, self.rounds), self.rank, self.world, payload,
            self.timeout, stats=self.stats, previous_prefix=previous, log=self.log,
            repost_s=self.repost_s, replay=self.replay, **wire,
        )
        if self.outer is not None:
            self.outer.apply(live, mean)
        else:
            with torch.no_grad():
                for name, t in live.items():
                    if mean[name] is not t:
                        t.copy_(mean[name])
        self.rounds += 1
        self._since_sync = 0
        if self.on_sync is not None:
            self.on_sync(self.rounds - 1, self.steps)

    def _exact_positions(self, payload: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """The buffers' positions in the collective's flat vectors (`Compressor.exact`): a
        compressed sync rounds parameters and optimizer state, never batch-norm statistics
        (an int8 block shared with large values could turn a running variance near zero
        negative). None when the model has no float buffers."""
        if not any(n.startswith(BUFFER_PREFIX) for n in payload):
            return None
        layout = tuple((n, t.dtype, tuple(t.shape)) for n, t in sorted(payload.items()))
        if self._exact_layout != layout:
            marks = {n: torch.full(t.shape, float(n.startswith(BUFFER_PREFIX)), dtype=t.dtype)
                     for n, t in payload.items()}
            self._exact_layout = layout
            self._exact = {d: v != 0 for d, v in flatten_by_dtype(marks).items()}
        return self._exact

    def drop_rounds_before(self, round_: int) -> None:
        """Delete the scratch keys of every round before `round_` (a replayable group)."""
        for r in range(self._dropped, round_):
            self.store.delete_prefix(sync_call_prefix(self.group, r) + "/")
        self._dropped = max(self._dropped, round_)

    def after_step(self) -> None:
        """Count one optimizer step; sync when the period is reached. Averaging gradients,
        the step's gradients were averaged before it: the round is complete."""
        heartbeat.step()
        self.steps += 1
        if self.average_gradients:
            self._end_gradient_round()
            return
        self._since_sync += 1
        if self.period is not None and self._since_sync >= self.period:
            self.sync()

    def _end_gradient_round(self) -> None:
        if self._buckets is not None:
            self._buckets.finish()  # no-op after the step's pre-hook; a step without one still agrees
        self.rounds += 1
        if self._buckets is not None:
            self._buckets.arm(self.rounds)
        if self.on_sync is not None:
            self.on_sync(self.rounds - 1, self.steps)

    def flush(self) -> None:
        """Sync the steps taken since the last sync, if any."""
        if self._since_sync:
            self.sync()

    def release(self, resumed: bool = False) -> None:
        """Take the gradient hooks off, then release the group's keys (see
        `comm.collectives.release_group`)."""
        if self._buckets is not None:
            self._buckets.remove()
            self._step_hook.remove()
            self._buckets = None
        release_group(self.store, self.group, self.rank, self.world, self.timeout,
                      stats=self.stats, resumed=resumed)

    def finish(self) -> None:
        """Sync the steps taken since the last sync, then release the group's keys."""
        self.flush()
        self.release()


VALIDATION_ROWS, VALIDATION_TOKENS = 1024, 16384
"""Rows a validation forward pass scores at most; for token inputs, positions at most (GPT-2's
[rows, T, 50257] logits of 1024 rows of 128 tokens would take 26 GB, 16384 positions 3.3 GB)."""


def validation_chunk(x: torch.Tensor) -> int:
    """Rows of `x` a validation forward pass takes: VALIDATION_ROWS, or for integer token rows
    [N, T] as many as hold VALIDATION_TOKENS positions (at least one)."""
    if x.dim() == 2 and not x.is_floating_point():
        return max(1, min(VALIDATION_ROWS, VALIDATION_TOKENS // max(1, x.shape[1])))
    return VALIDATION_ROWS


def validation_metrics(model: nn.Module, x: torch.Tensor, y: torch.Tensor, objective: Objective = CROSS_ENTROPY,
                       chunk: int | None = None) -> Metrics:
    """The objective's figures of `model` on (x, y), in eval mode (`engine.objective`: loss and
    accuracy for class targets, loss, perplexity and token accuracy for token targets), scored
    `chunk` rows at a time (None: `validation_chunk`)."""
    chunk = chunk or validation_chunk(x)
    return chunked_metrics(model, ((x[start : start + chunk], y[start : start + chunk])
                                   for start in range(0, len(y), chunk)), objective)


def chunked_metrics(model: nn.Module, chunks: Iterable[tuple[torch.Tensor, torch.Tensor]],
                    objective: Objective = CROSS_ENTROPY) -> Metrics:
    """The objective's figures of `model`, in eval mode, over `chunks` of (x, y) rows scored one
    at a time as they come (each moved to the model's device): a pass whose memory does not grow
    with the data (`engine.validation_stream`); equal to `validation_metrics` of the rows put
    together when its chunks are the same."""
    was_training = model.training
    model.eval()
    tally = Tally()
    device = next(model.parameters()).device
    with torch.no_grad():
        for xb, yb in chunks:
            objective.tally(model(xb.to(device)), yb.to(device), tally)
    model.train(was_training)
    return tally.metrics()


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, chunk: int = VALIDATION_ROWS) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of a classifier `model` on (x, y), in eval mode."""
    m = validation_metrics(model, x, y, CROSS_ENTROPY, chunk)
    return m.loss, m.accuracy
