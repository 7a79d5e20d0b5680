"""Run one WorkerSpec with the engine it needs: a pipeline stage worker when `spec.stage` is
set, else a Local-SGD replica."""
from __future__ import annotations

from typing import Callable

import torch

from comm.store import Store, open_store
from core.specs import WorkerResult, WorkerSpec
from engine.chaos import chaos_for, chaos_requested  # noqa: F401 - chaos_requested kept for callers
from engine.local_sgd_epoch import run_local_sgd_epoch
from engine.malloc import pin_malloc_thresholds
from engine.pipeline_executor import run_pipeline_worker


def run_spec(spec: WorkerSpec, store: Store, open_ref: Callable[[str], Store] = open_store) -> WorkerResult:
    """Dispatch on `spec.stage` (None: Local-SGD); `open_ref` opens any other store the spec
    names (a Local-SGD replica's `checkpoint_store`, a prepared dataset's `data.store`)."""
    pin_malloc_thresholds()  # the allocator the profile measured with (engine.malloc)
    # Injected faults (ZOOID_CHAOS, off when unset) that fire at worker start, for every
    # strategy; the Local-SGD loop fires the step and sync ones.
    chaos_for(spec, store).at_start()
    if spec.compute.threads is not None:  # checked >= 1 by ComputeSpec
        torch.set_num_threads(spec.compute.threads)  # the worker's own vCPU, set per epoch (warm workers stay)
    if spec.stage is None:
        return run_local_sgd_epoch(spec, store, open_ref)
    return run_pipeline_worker(spec, store, open_ref)
