"""Run one WorkerSpec with the engine it needs: a pipeline stage worker when `spec.stage` is
set, else a Local-SGD replica."""
from __future__ import annotations

from comm.store import Store
from core.specs import WorkerResult, WorkerSpec
from engine.chaos import chaos_for, chaos_requested  # noqa: F401 - chaos_requested kept for callers
from engine.malloc import pin_malloc_thresholds


def run_spec(spec: WorkerSpec, store: Store) -> WorkerResult:
    """Dispatch on `spec.stage` (None: Local-SGD)."""
    pin_malloc_thresholds()  # the allocator the profile measured with (engine.malloc)
    # Injected faults (ZOOID_CHAOS, off when unset) that fire at worker start, for every
    # strategy; the Local-SGD loop fires the step and sync ones.
    chaos_for(spec, store).at_start()
    if spec.compute.threads is not None:  # checked >= 1 by ComputeSpec
        import torch

        torch.set_num_threads(spec.compute.threads)  # the worker's own vCPU, set per epoch (warm workers stay)
    if spec.stage is None:
        from engine.local_sgd_epoch import run_local_sgd_epoch

        return run_local_sgd_epoch(spec, store)
    from engine.pipeline_executor import run_pipeline_worker

    return run_pipeline_worker(spec, store)
