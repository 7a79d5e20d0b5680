"""The state and interpreter of one pipeline stage worker (`engine.pipeline_executor` runs
it): its model stages as one module (`ChunkSet`), its optimizer, data and transfer threads,
and the epoch it runs action by action: F and B on the calling thread, every RECV prefetched
on a download thread, every SEND put by an upload thread, SYNC averaging one model stage's
gradients with its replicas (bucketed and started during the stage's last backward); then the loss shared, validation and the canonical checkpoint.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

from comm import heartbeat
from engine import preemption
from engine.chaos import chaos_for
from comm.bandwidth import TransferStats
from comm.bucket_allreduce import BucketCollective, RingBuckets, StoreBuckets
from comm.collectives import release_group
from comm.compression import Compressor
from comm.ring_allreduce import RingGroup, open_ring
from comm.scatter_reduce import allreduce_for
from comm.store import Store
from comm.tensor_codec import decode_json, decode_tensors, encode_json, encode_tensors
from core.errors import StoreTimeout, ZooidValueError
from core.keys import activation_replica_prefix, stage_sync_prefix, sync_call_prefix
from core.kinds import Strategy
from core.schedules import Action, Kind, Layout, forward_only, lower
from core.specs import WorkerResult, WorkerSpec
from engine.checkpoint import FORMAT as CHECKPOINT_FORMAT
from engine.datasets import ShardSource
from engine.devices import to_compute, torch_device, torch_dtype
from engine.gradient_buckets import GradientBuckets
from engine.iteration_clock import IterationClock
from engine.models import build_model
from engine.objective import Metrics, Tally, objective_for
from engine.optimizers import build_optimizer, load_optimizer_state, optimizer_state_tensors
from engine.replica_data import check_steps, replica_share
from engine.shard_stream import ShardStream
from engine.stages import slice_full_state, split_stages
from engine.validation_stream import ChunkRows

DEFAULT_COLLECTIVE = "pipelined"
"""A stage's gradient sync when `spec.sync.collective` is None."""


class ChunkSet(nn.Module):
    """A worker's model stages as one module. Its children are the stages' layers under the
    unsplit model's names (as `split_stages` keeps them), so its `state_dict`, parameter names
    and optimizer state are the canonical checkpoint's keys for those layers, whichever
    stages the worker holds; `module(x, stage)` runs model stage `stage`'s layers only."""

    def __init__(self, parts: dict[int, nn.Module]):
        super().__init__()
        names = {stage: [name for name, _ in part.named_children()] for stage, part in parts.items()}
        for stage, part in sorted(parts.items()):
            for name, child in part.named_children():
                self.add_module(name, child)
        self._stage_layers = names

    def forward(self, x: torch.Tensor, stage: int) -> torch.Tensor:
        for name in self._stage_layers[stage]:
            x = self._modules[name](x)
        return x

    def stage_parameters(self, stage: int) -> dict[str, nn.Parameter]:
        """Model stage `stage`'s parameters by their full-model names."""
        return {f"{name}.{pname}": p for name in self._stage_layers[stage]
                for pname, p in self._modules[name].named_parameters()}

    def stage_state_dict(self, stage: int) -> dict[str, torch.Tensor]:
        """Model stage `stage`'s entries of `state_dict()`, in its order."""
        out: dict[str, torch.Tensor] = {}
        for name in self._stage_layers[stage]:
            out.update(self._modules[name].state_dict(prefix=f"{name}."))
        return out


class StageWorker:
    """State of one stage worker: its model stages (one module), optimizer, data and
    transfer threads."""

    def __init__(self, spec: WorkerSpec, store: Store, actions: list[Action], shards: ShardSource):
        """`spec.stage` says which worker this is; `actions` is its validated row of the
        iteration's schedule (`engine.pipeline_executor.iteration_schedule`)."""
        settings = spec.stage
        self.spec, self.cfg, self.store, self.actions = spec, settings, store, actions
        self.chaos = chaos_for(spec, store)
        self.shards = shards
        self.layout = Layout(settings.workers, settings.stages)
        self.last = settings.stages - 1
        """The last model stage (the loss)."""
        self.own_stages = self.layout.stages_of(settings.index)
        """The model stages this worker holds, in model order."""
        self.last_worker = self.layout.worker_of(self.last)
        self.device = torch_device(spec.compute)
        self.dtype = torch_dtype(spec.compute)
        self.objective = objective_for(spec.loss)
        self.tokens = 0
        """Tokens trained when the targets are tokens (`engine.objective`), else 0."""
        self.collective = spec.sync.collective or DEFAULT_COLLECTIVE
        if spec.batch_size < settings.microbatches:
            raise ZooidValueError("stage.microbatches", f"{settings.microbatches} micro-batches "
                                  f"exceed the batch of {spec.batch_size} rows")
        model = build_model(spec.model, spec.seed, **spec.compute.model_kwargs)
        parts = split_stages(model, settings.cuts)
        self.module = ChunkSet({s: parts[s] for s in self.own_stages}).to(self.device, self.dtype)
        del model, parts  # the other workers' layers are not this worker's to keep
        # one optimizer over every chunk: each parameter's update reads only its own state
        self.optimizer = build_optimizer(spec.optimizer, self.module, spec.lr)
        self.uploads = ThreadPoolExecutor(1, thread_name_prefix=f"upload-s{settings.index}")
        self.downloads = ThreadPoolExecutor(1, thread_name_prefix=f"download-s{settings.index}")
        self.sync_stats = TransferStats()
        self.upload_s = self.download_s = self.compute_s = 0.0
        self.pending: list[Future] = []
        self.compressors: dict[int, Compressor] = {}
        """Per model stage, the wire of its compressed gradient syncs (`spec.sync.sync_dtype`)."""
        self.rings: dict[int, RingGroup] = {}
        """Per model stage, its direct ring among its replicas (collective `ring`), opened at its first sync."""
        self.buckets: dict[int, GradientBuckets] = {}
        """Per model stage, its bucketed gradient averaging (float32 syncs), made at its first use."""
        bucketed = settings.replicas > 1 and spec.sync.sync_dtype == "float32"
        last_backward = {a.stage: i for i, a in enumerate(actions) if a.kind is Kind.B} if bucketed else {}
        self.arm_at = {i: stage for stage, i in last_backward.items()}
        """Action index -> model stage whose last backward of the iteration it is: armed just before."""
        self.prefix = activation_replica_prefix(spec.run_id, spec.epoch, settings.replica)

    def close(self) -> None:
        for buckets in self.buckets.values():
            buckets.remove()
        for ring in self.rings.values():
            ring.close()
        self.uploads.shutdown(wait=True)
        self.downloads.shutdown(wait=True, cancel_futures=True)

    def _group(self, stage: int) -> str:
        """The store prefix of model stage `stage`'s gradient syncs this epoch."""
        return stage_sync_prefix(self.spec.run_id, self.spec.epoch, stage)

    # --- the epoch ------------------------------------------------------------------

    def run(self, started: float) -> WorkerResult:
        spec, cfg = self.spec, self.cfg
        manifest = self.shards.manifest
        check_steps(spec.steps, manifest, cfg.replicas, spec.batch_size)
        # replica r of D takes Local-SGD rank r's batches of the epoch's order (`engine.replica_data`)
        batches = replica_share(manifest, spec.seed, spec.epoch, (), cfg.replicas, spec.batch_size, cfg.replica)
        init_meta = self._load_initial_state()
        loss_sum = 0.0
        self.module.train()
        clock = IterationClock()
        with self._train_stream(batches) as stream:
            for step, rows in enumerate(stream):
                self.chaos.before_step(step)  # ZOOID_CHAOS faults due before iteration `step`
                self._leave_on_notice(step)
                loss_sum += self._iteration(step, rows)
                clock.tick()
                heartbeat.step()
        if cfg.replicas > 1:
            for stage in self.own_stages:
                release_group(self.store, self._group(stage), cfg.replica, cfg.replicas, spec.sync_timeout_s,
                              stats=self.sync_stats)
        train_loss = self._share_train_loss(loss_sum / max(1, spec.steps))

        val = None
        checkpoint_key = ""
        if cfg.replica == 0:
            if spec.evaluate:
                val = self._validate()
            checkpoint_key = self._checkpoint(init_meta)
        stats = self.sync_stats
        return WorkerResult(
            run_id=spec.run_id, epoch=spec.epoch, rank=spec.rank,
            started_at=started, stopped_at=time.time(),
            train_loss=train_loss, samples=int(sum(len(b) for b in batches)),
            compute_s=self.compute_s, sync_s=stats.seconds,
            upload_s=self.upload_s, download_s=self.download_s, bytes_synced=stats.bytes_total,
            **(val.result_fields() if val else {}), tokens=self.tokens,
            checkpoint_key=checkpoint_key,
            pid=os.getpid(), host=socket.gethostname(), iteration_s=clock.period_s(),
        )

    def _leave_on_notice(self, step: int) -> None:
        """The notice came (`engine.preemption`): a stage has nothing a new stage could take
        (its neighbours' tensors in flight belong to this attempt), so it leaves at once with
        the preempted marker, and the coordinator reruns the attempt now."""
        if preemption.due():
            preemption.leave(self.store, self.spec, step)

    def _train_stream(self, batches):
        """The rows of `batches` (`ShardStream`) on the workers that hold data (model stage 0's
        inputs, the last model stage's targets); None per step on the others, which only need
        to know that an iteration happens."""
        if not (0 in self.own_stages or self.last in self.own_stages):
            return contextlib.nullcontext([None] * len(batches))
        return ShardStream(self.shards, batches, seed=self.spec.seed, epoch=self.spec.epoch)

    def _iteration(self, step: int, rows: tuple[torch.Tensor, torch.Tensor] | None) -> float:
        """Run this worker's actions for one batch (`rows`: its (x, y) where this worker holds
        data); return the batch's mean loss (on the worker of the last model stage)."""
        cfg = self.cfg
        x = y = chunks = None
        if rows is not None:
            x, y = rows
            self.tokens += self.objective.tokens(y)
            chunks = torch.tensor_split(torch.arange(len(y)), cfg.microbatches)
            x = to_compute(x, self.device, self.dtype) if 0 in self.own_stages else None
            y = to_compute(y, self.device, self.dtype) if self.last in self.own_stages else None
        # what the batch's mean loss divides by, known where the targets are (the last stage)
        batch_scored = self.objective.divisor(y) if y is not None else 0
        base = f"{self.prefix}/it{step}"
        received = self._prefetch(base, self.actions)
        # keyed by (model stage, micro-batch): an interleaved worker holds several stages
        inputs: dict[tuple[int, int], torch.Tensor] = {}
        outputs: dict[tuple[int, int], torch.Tensor] = {}
        loss_total = 0.0
        for i, a in enumerate(self.actions):
            s, m = a.stage, a.microbatch
            self._leave_on_notice(step)
            if i in self.arm_at:  # this stage's last backward: its buckets start as they fill
                self._stage_buckets(s).arm(step)
            if a.kind in (Kind.F, Kind.B):
                # Waiting for a neighbour's tensor is idle time, not compute.
                arrived = received[a].result() if a in received else None
                began = time.perf_counter()
                if a.kind is Kind.F:
                    if s == 0:
                        inp = x[chunks[m]]
                    elif arrived is not None:
                        inp = arrived.requires_grad_(True)
                    else:  # the previous model stage is on this worker (p = 1): hand over in memory
                        inp = outputs[(s - 1, m)].detach().requires_grad_(True)
                    out = self.module(inp, s)
                    if s == self.last:
                        # The micro-batch's term of the batch's mean loss (`Objective.part_loss`):
                        # the terms sum to it, as Local-SGD computes it on the whole batch.
                        out = self.objective.part_loss(out, y[chunks[m]], batch_scored, len(y))
                        loss_total += out.item()
                    inputs[(s, m)], outputs[(s, m)] = inp, out
                else:
                    if s == self.last:
                        grad = None  # d loss = 1
                    elif arrived is not None:
                        grad = arrived
                    else:  # the next model stage is on this worker: its input's gradient
                        grad = inputs.pop((s + 1, m)).grad
                    outputs.pop((s, m)).backward(grad)
                self.compute_s += time.perf_counter() - began
            elif a.kind is Kind.SEND_F:
                self._send(f"{base}/f{s}m{m}", outputs[(s, m)].detach())
            elif a.kind is Kind.SEND_B:
                self._send(f"{base}/b{s}m{m}", inputs.pop((s, m)).grad)
            elif a.kind is Kind.SYNC:
                self._sync_gradients(s, step)
            # RECV actions were queued by _prefetch; their consumer waits for them.
        self._drain_uploads()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_total

    def _ring(self, stage: int) -> RingGroup | None:
        """Model stage `stage`'s ring among its replicas (collective `ring`), opened on first use."""
        if self.collective == "ring" and stage not in self.rings:
            self.rings[stage] = open_ring(self.store, self._group(stage), self.cfg.replica, self.cfg.replicas,
                                          self.spec.sync_timeout_s, host=self.spec.sync.ring_host)
        return self.rings.get(stage)

    def _stage_buckets(self, stage: int) -> GradientBuckets:
        """Model stage `stage`'s bucketed gradient averaging (`engine.gradient_buckets`): each
        bucket starts during the stage's last backward, the SYNC action waits for them."""
        if stage not in self.buckets:
            ring = self._ring(stage)
            collective: BucketCollective = (RingBuckets(ring) if ring is not None else StoreBuckets(
                allreduce_for(self.collective, "mean"), self.store, self._group(stage), self.cfg.replica,
                self.cfg.replicas, self.spec.sync_timeout_s))
            self.buckets[stage] = GradientBuckets(self.module.stage_parameters(stage), collective,
                                                  stats=self.sync_stats,
                                                  bucket_bytes=int(self.spec.sync.bucket_mb * 2**20))
        return self.buckets[stage]

    def _sync_gradients(self, stage: int, step: int) -> None:
        """Average model stage `stage`'s gradients with the same stage of the other replicas:
        wait for its buckets (float32), or one compressed call after the backward."""
        cfg = self.cfg
        if cfg.replicas == 1:
            return
        if stage in self.buckets:
            self.buckets[stage].finish()
            return
        group = self._group(stage)
        grads = {n: p.grad for n, p in self.module.stage_parameters(stage).items() if p.grad is not None}
        allreduce = allreduce_for(self.collective, "mean", ring=self._ring(stage))
        wire = {}
        if self.spec.sync.sync_dtype != "float32":
            # Error feedback within the epoch; the epoch's last sync sends the gradient plus
            # the residual losslessly, so nothing is owed when the epoch (or its rerun) ends.
            if stage not in self.compressors:
                self.compressors[stage] = Compressor(self.spec.sync.sync_dtype)
            compressor = self.compressors[stage]
            compressor.flushing = step == self.spec.steps - 1
            wire = {"compressor": compressor}
        mean = allreduce(self.store, sync_call_prefix(group, step), cfg.replica, cfg.replicas, grads,
                         self.spec.sync_timeout_s, stats=self.sync_stats,
                         previous_prefix=sync_call_prefix(group, step - 1) if step else None, **wire)
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
            raise StoreTimeout(f"stage {self.cfg.index} of replica {self.cfg.replica} waited "
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

    def _val_rows(self, chunks) -> ChunkRows | None:
        """The validation chunks' inputs for the worker of model stage 0, their labels for the
        worker of the last (a one-worker pipeline needs both), read chunk by chunk as the
        schedule takes them (`ChunkRows`): memory does not grow with the validation split."""
        parts = tuple(p for p, stage in ((0, 0), (1, self.last)) if stage in self.own_stages)
        if not parts:
            return None
        return ChunkRows(self.shards, [c.numpy() for c in chunks], parts, seed=self.spec.seed, epoch=self.spec.epoch,
                         convert=lambda t: to_compute(t, self.device, self.dtype))

    def _load_initial_state(self) -> dict[str, Any]:
        """Load this worker's slice of the full-model checkpoint at `spec.init_key`."""
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
        """The last model stage's worker knows the loss; it sends it to the replica's others."""
        if self.cfg.workers == 1:
            return mean_loss
        if self.cfg.index == self.last_worker:
            for w in range(self.cfg.workers):
                if w != self.last_worker:
                    self.store.put(f"{self.prefix}/loss/s{w}", encode_json({"loss": mean_loss}), scratch=True)
            return mean_loss
        key = f"{self.prefix}/loss/s{self.cfg.index}"
        value = decode_json(self.store.get(key, timeout=self.spec.sync_timeout_s))["loss"]
        self.store.delete(key)
        return float(value)

    @torch.no_grad()
    def _validate(self) -> Metrics | None:
        """Forward-only pass of replica 0 over the validation set; the last model stage's
        worker scores it."""
        cfg = self.cfg
        manifest = self.shards.manifest
        n = manifest.n_val
        chunks = torch.tensor_split(torch.arange(n), -(-n // cfg.val_chunk))
        actions = lower(forward_only(cfg.workers, len(chunks), cfg.chunks), sync=False)[cfg.index]
        base = f"{self.prefix}/val"
        received = self._prefetch(base, actions)
        rows = self._val_rows(chunks)
        self.module.eval()
        tally = Tally()
        outputs: dict[tuple[int, int], torch.Tensor] = {}
        try:
            for a in actions:
                s, m = a.stage, a.microbatch
                if a.kind is Kind.F:
                    if s == 0:
                        inp = rows.take(m, 0)
                    elif a in received:
                        inp = received[a].result()
                    else:  # the previous model stage is on this worker
                        inp = outputs.pop((s - 1, m))
                    outputs[(s, m)] = self.module(inp, s)
                    if s == self.last:
                        self.objective.tally(outputs.pop((s, m)), rows.take(m, 1), tally)
                elif a.kind is Kind.SEND_F:
                    self._send(f"{base}/f{s}m{m}", outputs.pop((s, m)))
        finally:
            if rows is not None:
                rows.close()
        self._drain_uploads()
        self.module.train()
        if self.last not in self.own_stages:
            return None
        return tally.metrics()

    def _stage_tensors(self, stage: int) -> dict[str, torch.Tensor]:
        """Model stage `stage`'s weights and optimizer state under the checkpoint's keys."""
        params = self.module.stage_parameters(stage)
        out = {f"model/{k}": v.detach() for k, v in self.module.stage_state_dict(stage).items()}
        out.update({f"optim/{k}": v.detach()
                    for k, v in optimizer_state_tensors(self.module, self.optimizer).items()
                    if k.rpartition(".")[0] in params})
        return out

    def _checkpoint(self, init_meta: dict[str, Any]) -> str:
        """Send the weights and optimizer state of this worker's model stages to the last
        model stage's worker, which assembles them in model-stage order and writes the
        canonical full-model checkpoint; return its key there, else ""."""
        if self.cfg.index != self.last_worker:
            for stage in self.own_stages:
                self.store.put(f"{self.prefix}/ckpt/s{stage}", encode_tensors(self._stage_tensors(stage)),
                               scratch=True)
            return ""
        full: dict[str, torch.Tensor] = {}
        for stage in range(self.cfg.stages):
            if stage in self.own_stages:
                full.update(self._stage_tensors(stage))
                continue
            key = f"{self.prefix}/ckpt/s{stage}"
            part, _ = decode_tensors(self.store.get(key, timeout=self.spec.sync_timeout_s))
            self.store.delete(key)
            full.update(part)
        spec = self.spec
        meta = {"run_id": spec.run_id, "epoch": spec.epoch, "epoch_complete": True,
                "steps": spec.steps,
                "global_step": int(init_meta.get("global_step", 0)) + spec.steps,
                "world": self.cfg.replicas, "model": spec.model, "optimizer": spec.optimizer,
                "strategy": Strategy.PIPELINE, "cuts": list(self.cfg.cuts)}
        if self.cfg.chunks > 1:  # the cuts are model stages, v of them per worker
            meta["chunks"] = self.cfg.chunks
        blob = encode_tensors({k: v.contiguous() for k, v in full.items()},
                              metadata={"format": CHECKPOINT_FORMAT, "meta": json.dumps(meta)})
        self.store.put(spec.out_key, blob)
        return spec.out_key
