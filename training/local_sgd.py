"""One Local-SGD (K-AVG) replica's epoch: train on its subsets, average through the store.

Each of `world` replicas starts from the reference checkpoint, takes `steps` optimizer
steps on its own subsets, and every `sync_period` steps (None: only at the end of the
epoch; there is always a sync at the end) the replicas replace their weights by the mean
over all replicas (KubeML Eq. 3.1) with the decentralised `allreduce_mean`. Rank 0 then
writes the averaged reference checkpoint for the next epoch.

Optimizer state at a sync: the momentum buffers (SGD momentum) and the Adam moments are
averaged in the same collective as the weights, and kept by the checkpoint. KubeML
(Sec. 4.5) reset momentum at each model load and saw noisy updates after every merge;
averaging the state instead (Yu et al., cited there) keeps the replicas' optimizers
consistent with the averaged point. With period 1 it is exact for plain and momentum
SGD: the averaged buffer is mu * b + mean(g_i) and the averaged weight w - lr * that
buffer, which is one process's step on the concatenated batch (mean-reduced loss,
equal-size batches). Adam's moments are nonlinear in the gradients, so there the average
is an approximation; its step counter is equal on all replicas and is not averaged.
"""
from __future__ import annotations

import math
import os
import socket
import time
from typing import Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from training.checkpoint import load_checkpoint, save_checkpoint
from training.collectives import SyncStats, allreduce_mean, release_group
from training.datasets import read_manifest, read_subsets
from training.errors import OutOfMemory, ZooidValueError
from training.models import build_model
from training.optimizers import build_optimizer, optimizer_state_tensors
from training.specs import WorkerResult, WorkerSpec
from training.store import Store


def sync_group(run_id: str, epoch: int) -> str:
    """Key prefix of an epoch's Local-SGD syncs. A coordinator that relaunches an epoch
    deletes this prefix first, so no replica reads a failed attempt's slices."""
    return f"runs/{run_id}/sync/e{epoch}"


def steps_per_epoch(n_train: int, world: int, batch_size: int) -> int:
    """Steps each replica takes so that together they see about `n_train` samples."""
    return max(1, math.ceil(n_train / (world * batch_size)))


class LocalSGD:
    """Wraps a training loop: call `after_step()` after every optimizer step and `finish()`
    at the end; every `period` steps (None: only at `finish`) the weights, float buffers
    and optimizer state are replaced by their mean over the replicas."""

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
    ):
        if period is not None and period < 1:
            raise ZooidValueError("sync_period", f"must be a positive step count or None, got {period}")
        self.model, self.optimizer, self.store = model, optimizer, store
        self.group, self.rank, self.world = group, rank, world
        self.period, self.timeout = period, timeout
        self.stats = SyncStats()
        self.rounds = 0
        self._since_sync = 0

    def _shared_tensors(self) -> dict[str, torch.Tensor]:
        """The live tensors every replica must agree on, by name."""
        out = {f"param/{n}": p.data for n, p in self.model.named_parameters()}
        out.update({f"buffer/{n}": b for n, b in self.model.named_buffers() if b.is_floating_point()})
        for n, t in optimizer_state_tensors(self.model, self.optimizer).items():
            # Scalars are step counters, equal on every replica; only moments are averaged.
            if t.is_floating_point() and t.dim() > 0:
                out[f"optim/{n}"] = t
        return out

    def sync(self) -> None:
        """Average the shared tensors over the replicas now (in place)."""
        live = self._shared_tensors()
        previous = f"{self.group}/r{self.rounds - 1}" if self.rounds else None
        mean = allreduce_mean(
            self.store, f"{self.group}/r{self.rounds}", self.rank, self.world, live,
            self.timeout, stats=self.stats, previous_prefix=previous,
        )
        with torch.no_grad():
            for name, t in live.items():
                if mean[name] is not t:
                    t.copy_(mean[name])
        self.rounds += 1
        self._since_sync = 0

    def after_step(self) -> None:
        """Count one optimizer step; sync when the period is reached."""
        self._since_sync += 1
        if self.period is not None and self._since_sync >= self.period:
            self.sync()

    def finish(self) -> None:
        """Sync the steps taken since the last sync, then release the group's keys."""
        if self._since_sync:
            self.sync()
        release_group(self.store, self.group, self.rank, self.world, self.timeout, stats=self.stats)


def batch_stream(n: int, batch_size: int, steps: int, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """`steps` index batches of exactly `batch_size` over `n` rows: consecutive seeded
    permutations, read as one stream, so a small shard wraps around instead of shrinking."""
    pending = torch.empty(0, dtype=torch.long)
    for _ in range(steps):
        while len(pending) < batch_size:
            pending = torch.cat([pending, torch.randperm(n, generator=generator)])
        yield pending[:batch_size]
        pending = pending[batch_size:]


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, chunk: int = 1024) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of `model` on (x, y), in eval mode."""
    was_training = model.training
    model.eval()
    loss_sum, correct = 0.0, 0
    device = next(model.parameters()).device
    with torch.no_grad():
        for start in range(0, len(y), chunk):
            xb, yb = x[start : start + chunk].to(device), y[start : start + chunk].to(device)
            logits = model(xb)
            loss_sum += F.cross_entropy(logits, yb, reduction="sum").item()
            correct += (logits.argmax(1) == yb).sum().item()
    model.train(was_training)
    return loss_sum / len(y), correct / len(y)


def batch_seed(seed: int, epoch: int, rank: int) -> int:
    """Seed of replica `rank`'s batch order in `epoch` (distinct per replica and epoch)."""
    return int(np.random.SeedSequence([seed, epoch, rank]).generate_state(1)[0])


def _validate(spec: WorkerSpec) -> None:
    if spec.world < 1 or not 0 <= spec.rank < spec.world:
        raise ZooidValueError("rank", f"must be in 0..world-1 with world >= 1, got {spec.rank}/{spec.world}")
    if spec.steps < 0 or spec.batch_size < 1:
        raise ZooidValueError("steps", f"steps >= 0 and batch_size >= 1 required, got {spec.steps}, {spec.batch_size}")
    if not spec.init_key or (spec.rank == 0 and not spec.out_key):
        raise ZooidValueError("init_key", "a worker needs init_key, and rank 0 an out_key")


def run_local_sgd_epoch(spec: WorkerSpec, store: Store) -> WorkerResult:
    """Run replica `spec.rank` of one Local-SGD epoch against `store` (see module docstring)."""
    started = time.time()
    _validate(spec)
    try:
        return _run(spec, store, started)
    except torch.OutOfMemoryError as exc:
        raise OutOfMemory(f"rank {spec.rank} of {spec.model}, batch {spec.batch_size}: {exc}") from None


def _run(spec: WorkerSpec, store: Store, started: float) -> WorkerResult:
    # extra["device"] / extra["dtype"] override the defaults (the GPU when there is one,
    # float32); tests train in float64 to compare replicas with one process exactly.
    device = torch.device(spec.extra.get("device") or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, str(spec.extra.get("dtype", "float32")), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ZooidValueError("extra.dtype", f"must name a floating dtype, got {spec.extra.get('dtype')!r}")
    model = build_model(spec.model, spec.seed, **spec.extra.get("model_kwargs", {}))
    model = model.to(device=device, dtype=dtype)
    optimizer = build_optimizer(spec.optimizer, model, spec.lr)
    init_meta = load_checkpoint(store, spec.init_key, model, optimizer, timeout=spec.sync_timeout_s)
    x, y = read_subsets(store, spec.run_id, spec.subsets, timeout=spec.sync_timeout_s)
    x, y = x.to(device=device, dtype=dtype if x.is_floating_point() else x.dtype), y.to(device)

    group = spec.extra.get("sync_group") or sync_group(spec.run_id, spec.epoch)
    averaging = LocalSGD(model, optimizer, store, group, spec.rank, spec.world,
                         spec.sync_period, spec.sync_timeout_s)
    generator = torch.Generator().manual_seed(batch_seed(spec.seed, spec.epoch, spec.rank))
    loss_sum = torch.zeros((), device=device)
    model.train()
    t0 = time.perf_counter()
    for idx in batch_stream(len(y), spec.batch_size, spec.steps, generator):
        idx = idx.to(device)
        loss = F.cross_entropy(model(x[idx]), y[idx])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        loss_sum += loss.detach()
        averaging.after_step()
    averaging.finish()
    train_loss = loss_sum.item() / max(1, spec.steps)
    loop_s = time.perf_counter() - t0

    val_loss = val_acc = None
    checkpoint_key = ""
    if spec.rank == 0:
        meta = {
            "run_id": spec.run_id, "epoch": spec.epoch, "epoch_complete": True,
            "steps": spec.steps, "global_step": int(init_meta.get("global_step", 0)) + spec.steps,
            "world": spec.world, "model": spec.model, "optimizer": spec.optimizer,
        }
        save_checkpoint(store, spec.out_key, model, optimizer, meta)
        checkpoint_key = spec.out_key
        if spec.evaluate:
            manifest = read_manifest(store, spec.run_id, timeout=spec.sync_timeout_s)
            vx, vy = read_subsets(store, spec.run_id, range(manifest.n_val_subsets), split="val")
            val_loss, val_acc = evaluate(model, vx.to(dtype), vy)
    stats = averaging.stats
    return WorkerResult(
        run_id=spec.run_id, epoch=spec.epoch, rank=spec.rank,
        started_at=started, stopped_at=time.time(),
        train_loss=train_loss, samples=spec.steps * spec.batch_size,
        compute_s=max(0.0, loop_s - stats.seconds), sync_s=stats.seconds,
        upload_s=stats.upload_s, download_s=stats.download_s, bytes_synced=stats.bytes_total,
        val_loss=val_loss, val_accuracy=val_acc, checkpoint_key=checkpoint_key,
        pid=os.getpid(), host=socket.gethostname(),
    )
