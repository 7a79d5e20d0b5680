"""Local-SGD replicas as threads of this process: the engine's own epoch
(`engine.local_sgd_epoch.run_local_sgd_epoch`) against a directory store, as `run_epoch` drives
it minus the process launches, and the trace of accuracy, seconds and bytes it leaves."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from comm.store_dir import DirectoryStore
from core.keys import checkpoint_key, init_checkpoint_key
from core.specs import ComputeSpec, SyncSpec, WorkerSpec
from engine.checkpoint import initial_checkpoint
from engine.datasets import publish_dataset
from engine.epoch_order import epoch_steps
from engine.local_sgd_epoch import run_local_sgd_epoch

SUBSET_ROWS = 64
"""Rows per published data subset, as the flow publishes a dataset for up to 8 workers."""


@dataclass
class Trace:
    """One configuration's run: accuracy, wall seconds and bytes after each epoch."""

    name: str
    seed: int
    accuracy: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    bytes_synced: list[int] = field(default_factory=list)

    def reached(self, target: float) -> int | None:
        """1-based epoch at which validation accuracy first reached `target`, or None."""
        return next((i + 1 for i, a in enumerate(self.accuracy) if a >= target), None)

    def totals(self, target: float) -> tuple[int | None, float, int]:
        """(epochs, wall seconds, bytes) up to the target, or over every epoch when missed."""
        n = self.reached(target) or len(self.accuracy)
        return self.reached(target), sum(self.seconds[:n]), sum(self.bytes_synced[:n])


def train_replicas(store: DirectoryStore, model: str, dataset: str, batch: int, optimizer: str, lr: float,
                   name: str, seed: int, period: int | None, epochs: int, *, workers: int,
                   sync: SyncSpec | None = None, stop_at: float | None = None) -> Trace:
    """`workers` replicas of `model` as threads, through `store`, for `epochs` epochs (or until rank
    0's validation accuracy reaches `stop_at`), synced every `period` steps (None: once per
    epoch) as `sync` says (default: K-AVG in float32). The dataset is published once in subsets
    of `SUBSET_ROWS`; each epoch every sample is trained once, the epoch's order shared out among
    the replicas (`engine.replica_data`); each epoch starts from the previous one's checkpoint and
    rank 0 evaluates the result."""
    run_id = "bench"
    manifest = publish_dataset(store, run_id, dataset, subset_size=SUBSET_ROWS)
    init = init_checkpoint_key(run_id)
    initial_checkpoint(store, init, model, optimizer, lr, seed=seed)
    steps = epoch_steps(manifest.n_train, workers, batch)
    trace = Trace(name, seed)
    with ThreadPoolExecutor(workers) as pool:
        for epoch in range(epochs):
            out = checkpoint_key(run_id, epoch)
            specs = [WorkerSpec(run_id=run_id, epoch=epoch, rank=r, world=workers, store_url=store.url,
                                model=model, dataset=dataset, steps=steps,
                                batch_size=batch, lr=lr, optimizer=optimizer, sync_period=period,
                                seed=seed, init_key=init, out_key=out, evaluate=True,
                                compute=ComputeSpec(device="cpu"), sync=sync or SyncSpec())
                     for r in range(workers)]
            t0 = time.perf_counter()
            results = list(pool.map(lambda s: run_local_sgd_epoch(s, store), specs))
            trace.seconds.append(time.perf_counter() - t0)
            trace.accuracy.append(next(r.val_accuracy for r in results if r.rank == 0))
            trace.bytes_synced.append(sum(r.bytes_synced for r in results))
            init = out
            if stop_at is not None and trace.accuracy[-1] >= stop_at:
                break
    return trace
