"""Checkpoints and resume: a new run with `resume=<run_id>` continues from the last complete
checkpoint; a killed coordinator's workers are swept and its epoch continues from the last
sync point."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from coordinator.run.job import TrainJob

pytestmark = pytest.mark.usefixtures("prefect_api")
ROOT = Path(__file__).resolve().parent.parent
JOB = dict(workers=2, optimizer="momentum", lr=0.05, sync_period=4, batch_size=32, strategy="local_sgd",
           sync_checkpoint_s=0.0)  # a sync checkpoint every round: the faults below resume from one


def _weights(url: str, key: str) -> dict[str, torch.Tensor]:
    from comm.store import open_store
    from comm.tensor_codec import decode_tensors

    tensors, _ = decode_tensors(open_store(url).get(key))
    return {k: v for k, v in tensors.items() if k.startswith("model/")}


@pytest.mark.slow
def test_resume_continues_from_the_last_checkpoint_and_ends_equal(tmp_path):
    from comm.store import open_store
    from coordinator.bill.cost import read_ledger
    from flows.train import train

    clean_url = f"file://{tmp_path}/clean"
    clean = train(TrainJob(store=clean_url, epochs=2, **JOB))

    url = f"file://{tmp_path}/store"
    first = train(TrainJob(store=url, epochs=1, **JOB))
    resumed = train(TrainJob(store=url, epochs=2, resume=first.run_id, **JOB))
    assert resumed.run_id == first.run_id and resumed.status == "completed"
    assert [e.epoch for e in resumed.epochs] == [0, 1]
    for k, v in _weights(clean_url, clean.checkpoint_key).items():
        torch.testing.assert_close(_weights(url, resumed.checkpoint_key)[k], v, rtol=1e-5, atol=1e-6)
    ledger = read_ledger(open_store(url), first.run_id)
    assert sum(r["kind"] == "coordinator" for r in ledger["rows"]) == 2
    # one row per epoch a worker trained (a warm worker's start-up and idle rows carry no attempt)
    assert sum(r["kind"] == "worker" and r["attempt"] is not None for r in ledger["rows"]) == 4


def test_resume_of_an_unknown_run_is_refused(tmp_path, capsys):
    """Exit 2 (bad input), the command line's one line last on stderr naming the field and the
    run it did not find (the lines above it are the flow run's own log)."""
    from flows.train import main

    assert main(["--param", f"store=file://{tmp_path}/s", "--param", "resume=znothere"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert [line for line in lines if line.startswith("error:")] == [lines[-1]]
    assert lines[-1] == f"error: resume: no run 'znothere' in file://{tmp_path}/s"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_killed_coordinator_is_swept_and_its_epoch_resumes_from_the_sync_point(tmp_path):
    from prefect.settings import PREFECT_API_URL

    from coordinator.workers.sweep import orphan_pids, tagged_pids
    from core.keys import sync_checkpoint_key
    from engine.chaos import fault_marker_key
    from flows.train import train

    store_dir = tmp_path / "store"
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(),
           "ZOOID_CHAOS": "hang_worker:epoch=1:rank=0:step=6"}
    argv = [sys.executable, "-m", "flows.train", "--param", f"store=file://{store_dir}",
            "--param", "epochs=2"] + [a for k, v in JOB.items() for a in ("--param", f"{k}={v}")]
    coordinator = subprocess.Popen(argv, cwd=ROOT, env=env, start_new_session=True,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        run_id = None
        # the events: epoch 1's sync checkpoint is written, then rank 0 hangs at step 6 (its
        # fault marker is written as it hangs); a hang is the test's timeout
        while run_id is None or not (store_dir / fault_marker_key(run_id, 1, 0, 0)).exists():
            runs = list((store_dir / "runs").glob("*")) if (store_dir / "runs").exists() else []
            if runs and (store_dir / sync_checkpoint_key(runs[0].name, 1)).exists():
                run_id = runs[0].name
            assert coordinator.poll() is None, "the coordinator ended early"
            time.sleep(0.2)
        os.kill(coordinator.pid, signal.SIGKILL)  # no hook, no finally: a lost coordinator
        coordinator.wait()
        workers = tagged_pids(run_id)
        assert workers and set(workers) <= set(orphan_pids())
    finally:
        if coordinator.poll() is None:
            coordinator.kill()

    summary = train(TrainJob(store=f"file://{store_dir}", epochs=2, resume=run_id, **JOB))
    assert tagged_pids(run_id) == []  # the orphans were swept before anything else ran
    assert summary.status == "completed" and [e.epoch for e in summary.epochs] == [0, 1]
    assert summary.final_accuracy > 0.7  # it trained (chance is 0.1; a fresh-clone run at 2a67fcd ended at 0.794)
    history = sorted((store_dir / "runs" / run_id / "history" / "e1").glob("*.json"))
    resumed = [json.loads(p.read_text()) for p in history]
    # the second coordinator's workers started at the sync point, not at step 0
    assert resumed and all(h["start_step"] == 4 for h in resumed)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_killed_coordinator_s_epoch_resumed_by_fewer_workers_trains_every_sample_once(tmp_path):
    """3 workers stop inside epoch 0 (rank 0 hangs at step 6, the coordinator is killed); the run
    resumed with 2 workers continues from the sync point at step 4 as a new phase of the epoch
    (`engine.local_sgd_epoch`): the workers' history records add up to every sample once."""
    from comm.store_dir import DirectoryStore
    from core.keys import sync_checkpoint_key
    from engine.chaos import fault_marker_key
    from engine.local_sgd_epoch import read_epoch_history
    from engine.replica_data import dataset_tally, epoch_coverage
    from flows.train import train
    from prefect.settings import PREFECT_API_URL

    store_dir, job = tmp_path / "store", {**JOB, "workers": 3}
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(),
           "ZOOID_CHAOS": "hang_worker:epoch=0:rank=0:step=6"}
    argv = [sys.executable, "-m", "flows.train", "--param", f"store=file://{store_dir}",
            "--param", "epochs=1"] + [a for k, v in job.items() for a in ("--param", f"{k}={v}")]
    coordinator = subprocess.Popen(argv, cwd=ROOT, env=env, start_new_session=True,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        run_id = None
        while run_id is None or not (store_dir / fault_marker_key(run_id, 0, 0, 0)).exists():
            runs = list((store_dir / "runs").glob("*")) if (store_dir / "runs").exists() else []
            if runs and (store_dir / sync_checkpoint_key(runs[0].name, 0)).exists():
                run_id = runs[0].name
            assert coordinator.poll() is None, "the coordinator ended early"
            time.sleep(0.2)
        os.kill(coordinator.pid, signal.SIGKILL)
        coordinator.wait()
    finally:
        if coordinator.poll() is None:
            coordinator.kill()

    summary = train(TrainJob(store=f"file://{store_dir}", epochs=1, resume=run_id, **JOB))
    assert summary.status == "completed" and summary.epochs[0].workers == 2
    history = read_epoch_history(DirectoryStore(store_dir), run_id, 0)
    assert {(h["world"], json.dumps(h["phases"])) for h in history} == {
        (2, json.dumps([{"world": 3, "batch": 32, "steps": 4}]))}
    assert epoch_coverage(history) == dataset_tally(1437)  # digits' training rows, each once
    assert summary.epochs[0].samples == 1437 - 3 * 4 * 32
    assert summary.epochs[0].samples_once is True  # the coordinator's own check of the same records
