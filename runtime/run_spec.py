"""Run one WorkerSpec with the engine it needs: a pipeline stage worker when `spec.stage` is
set, else a Local-SGD replica; its result carries the store requests the epoch made
(`WorkerResult.store_ops`)."""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from comm.store import Store, open_store
from core.specs import WorkerResult, WorkerSpec
from engine import preemption
from engine.chaos import chaos_for, chaos_requested  # noqa: F401 - chaos_requested kept for callers
from engine.local_sgd_epoch import run_local_sgd_epoch
from engine.malloc import pin_malloc_thresholds
from engine.pipeline_executor import run_pipeline_worker
from runtime.store_report import unreported


def run_spec(spec: WorkerSpec, store: Store, open_ref: Callable[[str], Store] = open_store) -> WorkerResult:
    """Dispatch on `spec.stage` (None: Local-SGD); `open_ref` opens any other store the spec
    names (a Local-SGD replica's `checkpoint_store`, a prepared dataset's `data.store`). The
    result's `store_ops`: the requests on `store` since its last report, every request on the
    stores `open_ref` opened for the epoch, and those of `runtime.store_report.also_report`'s;
    an epoch that raises carries them on the exception (`store_ops`)."""
    opened: list[Store] = []

    def open_counted(url: str) -> Store:
        other = open_ref(url)
        opened.append(other)
        return other

    try:
        result = _run(spec, store, open_counted)
    except BaseException as exc:  # a failed epoch's requests are billed too (`runtime.warm` replies them)
        exc.store_ops = unreported([store, *opened])  # type: ignore[attr-defined]
        raise
    return dataclasses.replace(result, store_ops=unreported([store, *opened]))


def _run(spec: WorkerSpec, store: Store, open_ref: Callable[[str], Store]) -> WorkerResult:
    """The epoch itself, on the engine `spec` asks for."""
    pin_malloc_thresholds()  # the allocator the profile measured with (engine.malloc)
    # The provider's notice (SIGTERM) only sets a flag during the epoch: the engine hands over
    # and leaves at its next step boundary (`engine.preemption`); the handler in force before
    # (Prefect's, in a flow run) is back once the epoch ends.
    with preemption.listening():
        return _epoch(spec, store, open_ref)


def _epoch(spec: WorkerSpec, store: Store, open_ref: Callable[[str], Store]) -> WorkerResult:
    # Injected faults (ZOOID_CHAOS, off when unset) that fire at worker start, for every
    # strategy; the Local-SGD loop fires the step and sync ones.
    chaos_for(spec, store).at_start()
    if spec.compute.threads is not None:  # checked >= 1 by ComputeSpec
        torch.set_num_threads(spec.compute.threads)  # the worker's own vCPU, set per epoch (warm workers stay)
    if spec.stage is None:
        return run_local_sgd_epoch(spec, store, open_ref)
    return run_pipeline_worker(spec, store, open_ref)
