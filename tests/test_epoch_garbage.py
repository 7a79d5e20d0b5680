"""An epoch leaves no cyclic garbage: a warm worker runs epoch after epoch in one process, and
whatever an epoch's objects hold in a reference cycle (its model, optimizer, batches) stays
until Python's oldest generation is collected, which few allocations trigger. A callback from
`LocalSGD` back to the epoch once held every epoch's resnet18 alive (+130 MB of RSS an epoch;
the docker target's rank 0 was OOM-killed in its third). Each engine epoch here runs with
the collector's DEBUG_SAVEALL, and nothing of torch may be among what it finds."""
from __future__ import annotations

import gc

import pytest
import torch

from core.specs import SyncSpec
from engine.local_sgd_epoch import run_local_sgd_epoch
from engine.pipeline_executor import pipeline_worker_specs, run_pipeline_worker
from tests.test_pipeline_equivalence import RUN, base_spec, run_threads, staged  # noqa: F401 - a fixture


def _torch_garbage(run) -> list[str]:
    """`run()`, then the types of the torch objects the collector found only in cycles."""
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        run()
        gc.collect()
    finally:
        gc.set_debug(0)
    found = sorted({type(o).__qualname__ for o in gc.garbage
                    if isinstance(o, (torch.Tensor, torch.nn.Module, torch.optim.Optimizer))})
    gc.garbage.clear()
    return found


@pytest.mark.parametrize("sync", [SyncSpec(), SyncSpec(outer_optimizer="nesterov", sync_dtype="int8")],
                         ids=["k-avg", "diloco-int8"])
def test_a_local_sgd_epoch_leaves_no_model_in_a_cycle(staged, sync):  # noqa: F811 - the fixture
    url, _ = staged
    import dataclasses

    specs = [dataclasses.replace(base_spec(url, 2, f"runs/{RUN}/garbage-{sync.sync_dtype}"), rank=r, sync=sync,
                                 sync_period=4, optimizer="momentum", compute=base_spec(url, 2, "").compute)
             for r in range(2)]
    assert _torch_garbage(lambda: run_threads(specs, run_local_sgd_epoch)) == []


def test_a_pipeline_epoch_leaves_no_model_in_a_cycle(staged):  # noqa: F811 - the fixture
    url, _ = staged
    specs = pipeline_worker_specs(base_spec(url, 1, f"runs/{RUN}/garbage-pipe"), cuts=[2], microbatches=4, replicas=1)
    assert _torch_garbage(lambda: run_threads(specs, run_pipeline_worker)) == []
