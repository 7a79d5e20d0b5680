"""Spot preemptions through the whole flow (inline workers): the coordinator classifies the
preempted worker, replaces it at once (a Local-SGD replica alone, from its handover; a
pipeline's attempt rerun whole), and the ledger bills every interval once, the preempted ones
marked and the work redone counted."""
from __future__ import annotations

import pytest
import torch

from coordinator.run.job import TrainJob
from tests.test_chaos import JOB, _final_weights, fault_free_run
from tests.test_preemption import wait_gone

pytestmark = pytest.mark.usefixtures("prefect_api")
fault_free = pytest.fixture(scope="module", name="fault_free")(fault_free_run)


def _ledger(url: str, run_id: str) -> list[dict]:
    from comm.store import open_store
    from coordinator.bill.cost import read_ledger

    return read_ledger(open_store(url), run_id)["rows"]


def _billed_once(rows: list[dict]) -> None:
    """Every second of a rank's workers billed once: one row per worker attempt of an epoch, and
    a rank's rows (a warm worker's start-up, idle and busy rows; its replacement's after it)
    one after the other, none overlapping another."""
    workers = [r for r in rows if r["kind"] in ("worker", "failed_attempt")]
    attempts = [(r["epoch"], r["rank"], r["attempt"]) for r in workers if r["attempt"] is not None]
    assert len(attempts) == len(set(attempts))
    for rank in {r["rank"] for r in workers}:
        mine = sorted((r for r in workers if r["rank"] == rank), key=lambda r: (r["start"], r["stop"]))
        assert all(b["start"] >= a["stop"] - 1e-6 for a, b in zip(mine, mine[1:])), mine


def _marker(url: str, run_id: str, rank: int, attempt: int) -> dict:
    from comm.store import open_store
    from engine.chaos import read_fault_marker

    return read_fault_marker(open_store(url), run_id, 0, rank, attempt)


def test_a_preempted_replica_is_replaced_from_its_handover_and_billed_once(tmp_path, monkeypatch, fault_free):
    from flows.train import train

    clean, clean_weights = fault_free
    monkeypatch.setenv("ZOOID_CHAOS", "preempt_worker:epoch=0:rank=1:step=5:grace=60")
    url = f"file://{tmp_path}/store"
    summary = train(TrainJob(store=url, **JOB))
    assert summary.status == "completed"
    weights = _final_weights(url, summary.checkpoint_key)
    for k, v in clean_weights.items():
        torch.testing.assert_close(weights[k], v, rtol=1e-6, atol=1e-7)
    rows = _ledger(url, summary.run_id)
    mine = {(r["rank"], r["attempt"]): r for r in rows if r["kind"] in ("worker", "failed_attempt")}
    assert mine[1, 0]["status"] == "preempted" and mine[1, 0]["usd"] > 0
    assert mine[1, 1]["status"] == "busy" and mine[1, 1]["redone_s"] == 0.0  # a clean handover
    assert [r["failure"]["kind"] for r in summary.epochs[0].relaunches] == ["preempted"]
    assert (summary.spot["preemptions"], summary.spot["redone_s"]) == (1, 0.0)
    _billed_once(rows)
    marker = _marker(url, summary.run_id, 1, 0)
    assert wait_gone(marker["pid"]) and wait_gone(marker["watcher"])
    assert all(wait_gone(pid) for pid in summary.epochs[0].worker_pids.values())


@pytest.mark.slow
def test_a_preempted_pipeline_stage_reruns_its_attempt_at_once(tmp_path, monkeypatch):
    from flows.train import train

    monkeypatch.setenv("ZOOID_CHAOS", "preempt_worker:epoch=0:rank=1:step=2:grace=60")
    url = f"file://{tmp_path}/store"
    summary = train(TrainJob(store=url, epochs=1, optimizer="sgd", lr=0.1, batch_size=16, prestart=False,
                             strategy="pipeline", stages=2, microbatches=4))
    assert summary.status == "completed"
    relaunches = summary.epochs[0].relaunches
    assert "timeout" not in {r["status"] for r in relaunches}  # nobody waited out a timeout
    rows = _ledger(url, summary.run_id)
    mine = {(r["rank"], r["attempt"]): r for r in rows if r["kind"] in ("worker", "failed_attempt")}
    assert mine[1, 0]["status"] == "preempted"
    assert mine[0, 0]["kind"] == "failed_attempt"  # stopped by the coordinator: the attempt is rerun
    # the rerun started the epoch over: both stages redid the 2 iterations the preempted attempt had done
    assert mine[0, 1]["redone_s"] > 0 and mine[1, 1]["redone_s"] > 0
    assert summary.spot["preemptions"] == 1
    _billed_once(rows)
    marker = _marker(url, summary.run_id, 1, 0)
    assert wait_gone(marker["pid"]) and wait_gone(marker["watcher"])


def test_a_worker_preempted_while_profiling_is_replaced_and_its_interval_marked(tmp_path, monkeypatch):
    """The notice comes as rank 0's warm worker starts the profile (outside an epoch: the worker
    marks its status preempted and exits at once, `engine.preemption.leaving`); the profile is
    taken again on a new worker and the run trains."""
    from flows.train import train

    monkeypatch.setenv("ZOOID_CHAOS", "preempt_worker:at=profile:grace=60")
    url = f"file://{tmp_path}/store"
    summary = train(TrainJob(store=url, **JOB))
    assert summary.status == "completed" and len(summary.epochs) == 1
    rows = _ledger(url, summary.run_id)
    preempted = [r for r in rows if r["status"] == "preempted"]
    assert [(r["rank"], r["epoch"]) for r in preempted] == [(0, None)] and preempted[0]["seconds"] > 0
    profiled = [r["resource"] for r in rows if r["status"] == "profile"]
    assert preempted[0]["resource"] not in profiled and len(profiled) == 2  # rank 1's, and rank 0's replacement's
    assert summary.spot["preemptions"] == 1
    _billed_once(rows)
    marker = _marker(url, summary.run_id, 0, 0)
    assert (marker["kind"], marker["at"]) == ("preempt_worker", "profile")
    assert wait_gone(marker["pid"]) and wait_gone(marker["watcher"])
