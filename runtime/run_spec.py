"""Run one WorkerSpec with the engine its strategy needs (Local-SGD replica or pipeline stage)."""
from __future__ import annotations

from comm.store import Store
from core.errors import ZooidValueError
from core.specs import WorkerResult, WorkerSpec
from engine.chaos import chaos_for, chaos_requested  # noqa: F401 - chaos_requested kept for callers
from engine.malloc import pin_malloc_thresholds


def run_spec(spec: WorkerSpec, store: Store) -> WorkerResult:
    """Dispatch on `spec.extra["strategy"]` (default `local_sgd`)."""
    pin_malloc_thresholds()  # the allocator the profile measured with (engine.malloc)
    # Injected faults (ZOOID_CHAOS, off when unset) that fire at worker start, for every
    # strategy; the Local-SGD loop fires the step and sync ones.
    chaos_for(spec, store).at_start()
    threads = spec.extra.get("threads")
    if threads is not None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ZooidValueError("extra.threads", f"must be a thread count >= 1, got {threads!r}")
        import torch

        torch.set_num_threads(threads)  # the worker's own vCPU, set per epoch (warm workers stay)
    strategy = spec.extra.get("strategy", "local_sgd")
    if strategy == "local_sgd":
        from engine.local_sgd import run_local_sgd_epoch

        return run_local_sgd_epoch(spec, store)
    if strategy in ("pipeline", "hybrid"):
        from engine.pipeline_executor import run_pipeline_worker

        return run_pipeline_worker(spec, store)
    raise ZooidValueError("strategy", f"unknown worker strategy {strategy!r}")
