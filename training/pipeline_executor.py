"""One stage worker of a D x M pipeline for one epoch: an interpreter over its action list.

`run_pipeline_worker(spec, store)` trains stage `extra["stage"]` of replica
`extra["replica"]`. Each iteration it runs its row of the lowered schedule
(`training.pipeline_schedule`: GPipe, or 1F1B with `extra["pipeline_schedule"]`) on three threads, as FuncPipe's task executor (Sec. 4) and
Hydrozoa's prefetching workers (Sec. 3.2) do:

- compute (the calling thread): F and B in schedule order, then SYNC and the optimizer step;
- download: every RECV of the iteration is queued at its start and fetched in order, so an
  activation or gradient arrives while earlier micro-batches are still computing;
- upload: a SEND queues the tensor and returns at once; the thread encodes and puts it.

Activations stay in memory from a micro-batch's forward to its backward. Micro-batch m of
an iteration's batch of N rows has n_m rows and its mean loss is scaled by n_m / N, so the
gradients accumulated over the micro-batches are the full batch's mean-loss gradient. SYNC
averages the stage's gradients over the D replicas of that stage (pipelined scatter-reduce
by default), right after the stage's own last backward, while earlier stages may still be
computing. The data order is Local-SGD's (`batch_stream` seeded by `batch_seed(seed, epoch,
replica)`), which stage 0 (inputs) and the last stage (labels) both follow, so hybrid D x M
with plain SGD equals Local-SGD with D replicas averaging every step.

After the last iteration replica 0 validates through the pipeline (forward only) and its
stages send their weights and optimizer state to its last stage, which writes one canonical
full-model checkpoint (`training.checkpoint` format, unsplit model's keys) at `spec.out_key`.

Store keys (all scratch, each deleted by its one reader):
`runs/<run>/act/e<epoch>/r<replica>/it<step>/{f,b}<from stage>m<micro-batch>` (activations,
gradients), `.../val/f<stage>m<chunk>`, `.../loss/s<stage>`, `.../ckpt/s<stage>`; gradient
syncs use `runs/<run>/sync/e<epoch>/s<stage>/r<step>`.

`spec.extra` keys (`PipelineSettings`): `stage`, `cuts`, `microbatches`, `replica`,
`replicas`; optional `sync` (`pipelined`/`plain`), `pipeline_schedule` (`gpipe`, `1f1b`),
`schedule` (one action line per stage; default the lowered `pipeline_schedule`), `val_chunk`, `dtype`, `device`, `model_kwargs`. `spec.rank` and
`spec.world` are not used: `pipeline_worker_specs` fills them as replica * S + stage, D * S.

Reporting: every stage reports its replica's mean training loss (the last stage sends it to
the others) and `samples` = rows its replica trained on, so throughput sums stage-0 workers
only. `compute_s` is time in F and B only (so 1 - compute_s / training time is the stage's
measured bubble), `sync_s` time in SYNC, `upload_s` / `download_s` the transfer threads'
busy time (a download's includes waiting for the neighbour to post). Replica 0's last stage
reports validation and `checkpoint_key`.
"""
from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from training import heartbeat
from training.checkpoint import FORMAT as CHECKPOINT_FORMAT
from training.iteration_clock import IterationClock
from training.collectives import SyncStats, release_group
from training.datasets import read_manifest, read_subsets
from training.errors import OutOfMemory, StoreTimeout, ZooidValueError
from training.local_sgd import batch_seed, batch_stream
from training.models import build_model
from training.optimizers import build_optimizer, load_optimizer_state, optimizer_state_tensors
from training.pipeline_schedule import (
    TRANSFER, Action, Kind, ScheduleError, build_schedule, forward_only, lower, parse_schedule, validate,
)
from training.scatter_reduce import COLLECTIVES, allreduce_for
from training.specs import WorkerResult, WorkerSpec
from training.stages import slice_full_state, split_stages
from training.store import Store
from training.tensor_codec import decode_json, decode_tensors, encode_json, encode_tensors


@dataclass(frozen=True, kw_only=True)
class PipelineSettings:
    """The pipeline part of a WorkerSpec, read from `spec.extra`."""

    stage: int
    """This worker's stage, 0..len(cuts)."""
    cuts: tuple[int, ...]
    """Child indices where stages 1..S-1 begin (`training.stages.split_stages`)."""
    microbatches: int
    """Micro-batches per iteration; the iteration's batch is `spec.batch_size` rows."""
    replica: int = 0
    """This worker's replica, 0..replicas-1 (selects its data and sync rank)."""
    replicas: int = 1
    """D: replicas of the whole pipeline; each stage's replicas sync every iteration."""
    sync: str = "pipelined"
    """Gradient sync among a stage's replicas: `pipelined` or `plain` scatter-reduce."""
    pipeline_schedule: str = "gpipe"
    """The named schedule (`gpipe`, `1f1b`) run when `schedule` gives no action lines."""
    schedule: tuple[str, ...] = ()
    """One action line per stage for one iteration; empty = the lowered `pipeline_schedule`."""
    val_chunk: int = 256
    """Validation rows per micro-batch."""
    dtype: str = "float32"
    device: str = ""
    """Empty: the GPU when there is one, else the CPU."""
    model_kwargs: dict = field(default_factory=dict)

    @property
    def stages(self) -> int:
        """S, the number of stages."""
        return len(self.cuts) + 1

    def __post_init__(self):
        for name in ("stage", "microbatches", "replica", "replicas", "val_chunk"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ZooidValueError(f"extra.{name}", f"must be an integer, got {value!r}")
        if not 0 <= self.stage < self.stages:
            raise ZooidValueError("extra.stage", f"must be in 0..{self.stages - 1}, got {self.stage}")
        if self.microbatches < 1 or self.val_chunk < 1 or self.replicas < 1:
            raise ZooidValueError("extra.microbatches", "microbatches, val_chunk and replicas must be >= 1")
        if not 0 <= self.replica < self.replicas:
            raise ZooidValueError("extra.replica", f"must be in 0..{self.replicas - 1}, got {self.replica}")
        if self.sync not in COLLECTIVES:
            raise ZooidValueError("extra.sync", f"must be one of {', '.join(COLLECTIVES)}, got {self.sync!r}")
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ZooidValueError("extra.dtype", f"must name a floating dtype, got {self.dtype!r}")

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> "PipelineSettings":
        """Read the settings from `spec.extra`, ignoring keys meant for others."""
        missing = [k for k in ("stage", "cuts", "microbatches") if k not in extra]
        if missing:
            raise ZooidValueError(f"extra.{missing[0]}", "is required for a pipeline worker")
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in extra.items() if k in names}
        values["cuts"] = tuple(values["cuts"])
        values["schedule"] = tuple(values.get("schedule", ()))
        return cls(**values)

    def iteration_schedule(self) -> list[Action]:
        """This stage's validated action list for one training iteration."""
        if self.pipeline_schedule not in ("gpipe", "1f1b"):  # interleaved needs several chunks per worker
            raise ZooidValueError("extra.pipeline_schedule", f"must be gpipe or 1f1b, got {self.pipeline_schedule!r}")
        rows = (parse_schedule(self.schedule) if self.schedule
                else build_schedule(self.pipeline_schedule, self.stages, self.microbatches))
        if len(rows) != self.stages:
            raise ScheduleError(f"has {len(rows)} rows for {self.stages} stages")
        if not any(a.kind in TRANSFER or a.kind is Kind.SYNC for row in rows for a in row):
            rows = lower(rows, sync=True)  # a compute-only schedule: add what it implies
        validate(rows)
        if self.replicas > 1 and not any(a.kind is Kind.SYNC for a in rows[self.stage]):
            raise ScheduleError(f"stage {self.stage} has {self.replicas} replicas but no SYNC")
        return rows[self.stage]


def pipeline_worker_specs(base: WorkerSpec, *, cuts, microbatches: int,
                          replica_subsets: list[tuple[int, ...]], sync: str = "pipelined",
                          **extra: Any) -> list[WorkerSpec]:
    """The D x S worker specs of one epoch: replica r's stages read `replica_subsets[r]`."""
    stages = len(cuts) + 1
    replicas = len(replica_subsets)
    specs = []
    for r, subsets in enumerate(replica_subsets):
        for s in range(stages):
            settings = {**base.extra, **extra, "stage": s, "cuts": list(cuts),
                        "microbatches": microbatches, "replica": r, "replicas": replicas,
                        "sync": sync}
            PipelineSettings.from_extra(settings)  # fail here, not in a worker
            specs.append(dataclasses.replace(base, rank=r * stages + s, world=replicas * stages,
                                             subsets=tuple(subsets), extra=settings))
    return specs


def activation_prefix(run_id: str, epoch: int) -> str:
    """Scratch prefix of an epoch's inter-stage tensors (delete it before relaunching)."""
    return f"runs/{run_id}/act/e{epoch}"


def run_pipeline_worker(spec: WorkerSpec, store: Store) -> WorkerResult:
    """Run one stage worker of one replica for one epoch (see the module docstring)."""
    started = time.time()
    settings = PipelineSettings.from_extra(spec.extra)
    if not spec.init_key or not spec.out_key:
        raise ZooidValueError("init_key", "a pipeline worker needs init_key and out_key")
    worker = _StageWorker(spec, settings, store)
    try:
        return worker.run(started)
    except torch.OutOfMemoryError as exc:
        raise OutOfMemory(f"stage {settings.stage} of {spec.model}, batch {spec.batch_size}: {exc}") from None
    finally:
        worker.close()


class _StageWorker:
    """State of one stage worker: its module, optimizer, data and transfer threads."""

    def __init__(self, spec: WorkerSpec, settings: PipelineSettings, store: Store):
        self.spec, self.cfg, self.store = spec, settings, store
        self.last = settings.stages - 1
        self.device = torch.device(settings.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = getattr(torch, settings.dtype)
        self.actions = settings.iteration_schedule()
        if spec.batch_size < settings.microbatches:
            raise ZooidValueError("extra.microbatches", f"{settings.microbatches} micro-batches "
                                  f"exceed the batch of {spec.batch_size} rows")
        model = build_model(spec.model, spec.seed, **settings.model_kwargs)
        self.module = split_stages(model, settings.cuts)[settings.stage].to(self.device, self.dtype)
        del model  # the other stages' layers are not this worker's to keep
        self.optimizer = build_optimizer(spec.optimizer, self.module, spec.lr)
        self.uploads = ThreadPoolExecutor(1, thread_name_prefix=f"upload-s{settings.stage}")
        self.downloads = ThreadPoolExecutor(1, thread_name_prefix=f"download-s{settings.stage}")
        self.sync_stats = SyncStats()
        self.upload_s = self.download_s = self.compute_s = 0.0
        self.pending: list[Future] = []
        self.ring = None
        """The stage's direct ring among its replicas (sync `ring`), opened at its first sync."""
        self.prefix = f"{activation_prefix(spec.run_id, spec.epoch)}/r{settings.replica}"

    def close(self) -> None:
        if self.ring is not None:
            self.ring.close()
        self.uploads.shutdown(wait=True)
        self.downloads.shutdown(wait=True, cancel_futures=True)

    # --- the epoch ------------------------------------------------------------------

    def run(self, started: float) -> WorkerResult:
        spec, cfg = self.spec, self.cfg
        init_meta = self._load_initial_state()
        x, y = self._read_data("train", spec.subsets)
        generator = torch.Generator().manual_seed(batch_seed(spec.seed, spec.epoch, cfg.replica))
        group = f"runs/{spec.run_id}/sync/e{spec.epoch}/s{cfg.stage}"
        loss_sum = 0.0
        self.module.train()
        clock = IterationClock()
        for step, idx in enumerate(self._batches(x, y, generator)):
            loss_sum += self._iteration(step, idx, x, y, group)
            clock.tick()
            heartbeat.step()
        if cfg.replicas > 1:
            release_group(self.store, group, cfg.replica, cfg.replicas, spec.sync_timeout_s,
                          stats=self.sync_stats)
        train_loss = self._share_train_loss(loss_sum / max(1, spec.steps))

        val_loss = val_acc = None
        checkpoint_key = ""
        if cfg.replica == 0:
            if spec.evaluate:
                val_loss, val_acc = self._validate()
            checkpoint_key = self._checkpoint(init_meta)
        stats = self.sync_stats
        return WorkerResult(
            run_id=spec.run_id, epoch=spec.epoch, rank=spec.rank,
            started_at=started, stopped_at=time.time(),
            train_loss=train_loss, samples=spec.steps * spec.batch_size,
            compute_s=self.compute_s, sync_s=stats.seconds,
            upload_s=self.upload_s, download_s=self.download_s, bytes_synced=stats.bytes_total,
            val_loss=val_loss, val_accuracy=val_acc, checkpoint_key=checkpoint_key,
            pid=os.getpid(), host=socket.gethostname(), iteration_s=clock.period_s(),
        )

    def _batches(self, x, y, generator: torch.Generator):
        """Local-SGD's index batches on the stages that hold data; None on middle stages,
        which only need to know that an iteration happens."""
        rows = x if x is not None else y
        if rows is None:
            return [None] * self.spec.steps
        return batch_stream(len(rows), self.spec.batch_size, self.spec.steps, generator)

    def _iteration(self, step: int, idx: torch.Tensor, x, y, group: str) -> float:
        """Run this stage's actions for one batch; return the batch's mean loss (last stage)."""
        cfg = self.cfg
        chunks = torch.tensor_split(idx, cfg.microbatches) if idx is not None else None
        base = f"{self.prefix}/it{step}"
        received = self._prefetch(base, self.actions)
        inputs: dict[int, torch.Tensor] = {}
        outputs: dict[int, torch.Tensor] = {}
        loss_total = 0.0
        for a in self.actions:
            m = a.microbatch
            if a.kind in (Kind.F, Kind.B):
                # Waiting for a neighbour's tensor is idle time, not compute.
                arrived = received[a].result() if a in received else None
                began = time.perf_counter()
                if a.kind is Kind.F:
                    inp = x[chunks[m]] if cfg.stage == 0 else arrived.requires_grad_(True)
                    out = self.module(inp)
                    if cfg.stage == self.last:
                        # Scaled by the micro-batch's share: the sum is the batch's mean loss.
                        out = F.cross_entropy(out, y[chunks[m]]) * (len(chunks[m]) / len(idx))
                        loss_total += out.item()
                    inputs[m], outputs[m] = inp, out
                else:
                    outputs.pop(m).backward(arrived)  # None on the last stage: d loss = 1
                self.compute_s += time.perf_counter() - began
            elif a.kind is Kind.SEND_F:
                self._send(f"{base}/f{cfg.stage}m{m}", outputs[m].detach())
            elif a.kind is Kind.SEND_B:
                self._send(f"{base}/b{cfg.stage}m{m}", inputs.pop(m).grad)
            elif a.kind is Kind.SYNC:
                self._sync_gradients(group, step)
            # RECV actions were queued by _prefetch; their consumer waits for them.
        self._drain_uploads()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_total

    def _sync_gradients(self, group: str, step: int) -> None:
        cfg = self.cfg
        if cfg.replicas == 1:
            return
        grads = {n: p.grad for n, p in self.module.named_parameters() if p.grad is not None}
        if cfg.sync == "ring" and self.ring is None:
            from training.ring_allreduce import open_ring

            self.ring = open_ring(self.store, group, cfg.replica, cfg.replicas, self.spec.sync_timeout_s,
                                  host=self.spec.extra.get("ring_host", "127.0.0.1"))
        allreduce = allreduce_for(cfg.sync, "mean", ring=self.ring)
        mean = allreduce(self.store, f"{group}/r{step}", cfg.replica, cfg.replicas, grads,
                         self.spec.sync_timeout_s, stats=self.sync_stats,
                         previous_prefix=f"{group}/r{step - 1}" if step else None)
        for name, g in grads.items():
            g.copy_(mean[name].to(g.device))

    # --- transfers --------------------------------------------------------------------

    def _prefetch(self, base: str, actions: list[Action]) -> dict[Action, Future]:
        """Queue every RECV in schedule order; map each consuming F/B to its future."""
        futures = {}
        for a in actions:
            if a.kind is Kind.RECV_F:
                key = f"{base}/f{a.stage - 1}m{a.microbatch}"
                futures[Action(a.stage, Kind.F, a.microbatch)] = self.downloads.submit(self._fetch, key)
            elif a.kind is Kind.RECV_B:
                key = f"{base}/b{a.stage + 1}m{a.microbatch}"
                futures[Action(a.stage, Kind.B, a.microbatch)] = self.downloads.submit(self._fetch, key)
        return futures

    def _fetch(self, key: str) -> torch.Tensor:
        t0 = time.perf_counter()
        try:
            blob = self.store.get(key, timeout=self.spec.sync_timeout_s)
        except (StoreTimeout, KeyError):
            raise StoreTimeout(f"stage {self.cfg.stage} of replica {self.cfg.replica} waited "
                               f"{self.spec.sync_timeout_s:g}s for {key}; a neighbour is missing or slow") from None
        self.store.delete(key)  # the only reader: the scratch key is done
        tensors, _ = decode_tensors(blob)
        self.download_s += time.perf_counter() - t0
        return tensors["t"].to(self.device)

    def _send(self, key: str, tensor: torch.Tensor) -> None:
        self.pending.append(self.uploads.submit(self._put, key, tensor))

    def _put(self, key: str, tensor: torch.Tensor) -> None:
        t0 = time.perf_counter()
        self.store.put(key, encode_tensors({"t": tensor}), scratch=True)
        self.upload_s += time.perf_counter() - t0

    def _drain_uploads(self) -> None:
        pending, self.pending = self.pending, []
        for f in pending:
            f.result()  # re-raises a failed upload here, in the compute thread

    # --- data, state, validation, checkpoint ------------------------------------------

    def _read_data(self, split: str, subsets) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Inputs for stage 0, labels for the last stage (a one-stage pipeline needs both)."""
        if 0 < self.cfg.stage < self.last:
            return None, None
        x, y = read_subsets(self.store, self.spec.run_id, subsets, split=split,
                            timeout=self.spec.sync_timeout_s)
        x = x.to(self.device, self.dtype if x.is_floating_point() else x.dtype)
        return (x if self.cfg.stage == 0 else None,
                y.to(self.device) if self.cfg.stage == self.last else None)

    def _load_initial_state(self) -> dict[str, Any]:
        """Load this stage's slice of the full-model checkpoint at `spec.init_key`."""
        blob = self.store.get(self.spec.init_key, timeout=self.spec.sync_timeout_s)
        tensors, header = decode_tensors(blob)
        if header.get("format") != CHECKPOINT_FORMAT:
            raise ZooidValueError("init_key", f"{self.spec.init_key} is not a Zooid checkpoint")
        full = {k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")}
        self.module.load_state_dict(slice_full_state(full, self.module), strict=True)
        names = {n for n, _ in self.module.named_parameters()}
        optim = {k.removeprefix("optim/"): v for k, v in tensors.items()
                 if k.startswith("optim/") and k.removeprefix("optim/").rpartition(".")[0] in names}
        load_optimizer_state(self.module, self.optimizer, optim)
        return json.loads(header.get("meta", "{}"))

    def _share_train_loss(self, mean_loss: float) -> float:
        """The last stage knows the loss; it sends it to the replica's other stages."""
        if self.cfg.stages == 1:
            return mean_loss
        if self.cfg.stage == self.last:
            for s in range(self.last):
                self.store.put(f"{self.prefix}/loss/s{s}", encode_json({"loss": mean_loss}), scratch=True)
            return mean_loss
        key = f"{self.prefix}/loss/s{self.cfg.stage}"
        value = decode_json(self.store.get(key, timeout=self.spec.sync_timeout_s))["loss"]
        self.store.delete(key)
        return float(value)

    @torch.no_grad()
    def _validate(self) -> tuple[float | None, float | None]:
        """Forward-only pass of replica 0 over the validation set; the last stage scores it."""
        manifest = read_manifest(self.store, self.spec.run_id, timeout=self.spec.sync_timeout_s)
        x, y = self._read_data("val", range(manifest.n_val_subsets))
        n = manifest.n_val
        chunks = torch.tensor_split(torch.arange(n), -(-n // self.cfg.val_chunk))
        actions = lower(forward_only(self.cfg.stages, len(chunks)), sync=False)[self.cfg.stage]
        base = f"{self.prefix}/val"
        received = self._prefetch(base, actions)
        self.module.eval()
        loss_sum, correct = 0.0, 0
        outputs: dict[int, torch.Tensor] = {}
        for a in actions:
            m = a.microbatch
            if a.kind is Kind.F:
                inp = x[chunks[m]] if self.cfg.stage == 0 else received[a].result()
                outputs[m] = self.module(inp)
                if self.cfg.stage == self.last:
                    logits = outputs.pop(m)
                    loss_sum += F.cross_entropy(logits, y[chunks[m]], reduction="sum").item()
                    correct += int((logits.argmax(1) == y[chunks[m]]).sum().item())
            elif a.kind is Kind.SEND_F:
                self._send(f"{base}/f{self.cfg.stage}m{m}", outputs.pop(m))
        self._drain_uploads()
        self.module.train()
        if self.cfg.stage != self.last:
            return None, None
        return loss_sum / n, correct / n

    def _checkpoint(self, init_meta: dict[str, Any]) -> str:
        """Send this stage's weights and optimizer state to the last stage, which writes the
        canonical full-model checkpoint; return its key on the last stage, else ""."""
        mine = {f"model/{k}": v.detach() for k, v in self.module.state_dict().items()}
        mine.update({f"optim/{k}": v.detach()
                     for k, v in optimizer_state_tensors(self.module, self.optimizer).items()})
        if self.cfg.stage != self.last:
            self.store.put(f"{self.prefix}/ckpt/s{self.cfg.stage}", encode_tensors(mine), scratch=True)
            return ""
        full: dict[str, torch.Tensor] = {}
        for s in range(self.last):
            key = f"{self.prefix}/ckpt/s{s}"
            part, _ = decode_tensors(self.store.get(key, timeout=self.spec.sync_timeout_s))
            self.store.delete(key)
            full.update(part)
        full.update(mine)
        spec = self.spec
        meta = {"run_id": spec.run_id, "epoch": spec.epoch, "epoch_complete": True,
                "steps": spec.steps,
                "global_step": int(init_meta.get("global_step", 0)) + spec.steps,
                "world": self.cfg.replicas, "model": spec.model, "optimizer": spec.optimizer,
                "strategy": "pipeline", "cuts": list(self.cfg.cuts)}
        blob = encode_tensors({k: v.contiguous() for k, v in full.items()},
                              metadata={"format": CHECKPOINT_FORMAT, "meta": json.dumps(meta)})
        self.store.put(spec.out_key, blob)
        return spec.out_key
