"""The coordinator's check that a Local-SGD epoch trained every sample once
(`coordinator.workers.epoch_samples.check_samples`) reads the workers' history records on the run's
store: True when they add up to the dataset, False when they do not, and unknown (None, with a
line) when a rank's record is missing from a store that a restart may empty (Redis without
persistence: `Store.keeps_keys`), where a missing record says nothing about the training."""
from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from coordinator.workers.epoch_samples import check_samples
from core.epoch_summary import EpochSummary
from core.keys import worker_history_key
from core.plan import Plan
from engine.epoch_order import sample_digest
from tests.memory_store import MemoryStore

N = 10


class RestartableStore(MemoryStore):
    keeps_keys = False


def record(rank: int, ids: range) -> dict:
    return {"rank": rank, "attempt": 0, "world": 2, "phases": [],
            "phase_tally": {"samples": len(ids), "digest": sample_digest(np.arange(ids.start, ids.stop))},
            "earlier_tally": {"samples": 0, "digest": 0}}


def checked(store, records: list[dict]) -> EpochSummary:
    for r in records:
        store.put(worker_history_key("zs", 0, r["rank"], r["attempt"]), json.dumps(r).encode())
    ctx = SimpleNamespace(run_id="zs", open_store=lambda: store, state=SimpleNamespace(dataset={"n_train": N}))
    return check_samples(ctx, Plan(strategy="local_sgd", data_parallel=2), EpochSummary(epoch=0, workers=2, seconds=1.0,
                                                                                         train_loss=1.0))


@pytest.mark.parametrize("kind", [MemoryStore, RestartableStore])
def test_the_records_of_a_whole_world_that_add_up_pass(kind):
    assert checked(kind(), [record(0, range(0, 5)), record(1, range(5, N))]).samples_once is True


@pytest.mark.parametrize("kind", [MemoryStore, RestartableStore])
def test_a_sample_trained_twice_fails(kind):
    assert checked(kind(), [record(0, range(0, 5)), record(1, range(4, 9))]).samples_once is False


def test_a_missing_record_fails_where_the_store_keeps_its_keys(capsys):
    assert checked(MemoryStore(), [record(0, range(0, 5))]).samples_once is False
    assert "not one whole world" in capsys.readouterr().out


def test_a_missing_record_is_unknown_where_a_restart_may_have_emptied_the_store(capsys):
    assert checked(RestartableStore(), [record(0, range(0, 5))]).samples_once is None
    assert "not checked, the run's store may have lost records" in capsys.readouterr().out
