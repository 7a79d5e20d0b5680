"""Faults injected into real runs (ZOOID_CHAOS): the run recovers, bills the dead attempt,
and ends where a fault-free run ends."""
from __future__ import annotations

import pytest
import torch

from coordinator.run.job import TrainJob

pytestmark = pytest.mark.usefixtures("prefect_api")

JOB = dict(workers=2, epochs=1, optimizer="sgd", lr=0.1, sync_period=4, batch_size=32, strategy="local_sgd",
           sync_checkpoint_s=0.0)  # a sync checkpoint every round: the faults below resume from one


def _final_weights(store_url: str, key: str) -> dict[str, torch.Tensor]:
    from comm.store import open_store
    from comm.tensor_codec import decode_tensors

    tensors, _ = decode_tensors(open_store(store_url).get(key))
    return {k: v for k, v in tensors.items() if k.startswith("model/")}


def fault_free_run(tmp_path_factory):
    """The job's run without faults: its summary and final weights (each module that compares
    with it makes it its own module-scoped fixture, `fault_free`)."""
    from flows.train import train

    url = f"file://{tmp_path_factory.mktemp('clean')}/store"
    summary = train(TrainJob(store=url, **JOB))
    return summary, _final_weights(url, summary.checkpoint_key)


fault_free = pytest.fixture(scope="module", name="fault_free")(fault_free_run)


def test_worker_killed_at_a_sync_point_is_relaunched_and_ends_equal(tmp_path, monkeypatch, fault_free):
    from comm.store import open_store
    from coordinator.bill.cost import read_ledger
    from flows.train import train

    clean, clean_weights = fault_free
    monkeypatch.setenv("ZOOID_CHAOS", "kill_worker:epoch=0:rank=1:step=8:at=sync")
    url = f"file://{tmp_path}/store"
    summary = train(TrainJob(store=url, **JOB))
    assert summary.status == "completed"
    weights = _final_weights(url, summary.checkpoint_key)
    for k, v in clean_weights.items():
        torch.testing.assert_close(weights[k], v, rtol=1e-6, atol=1e-7)
    assert summary.final_accuracy == pytest.approx(clean.final_accuracy, abs=1 / 360)
    ledger = read_ledger(open_store(url), summary.run_id)
    dead = [r for r in ledger["rows"] if r["kind"] == "failed_attempt"]
    assert [(r["rank"], r["attempt"], r["status"]) for r in dead] == [(1, 0, "crashed:injected")]
    assert dead[0]["usd"] > 0
    relaunched = [r for r in ledger["rows"] if r["kind"] == "worker" and r["rank"] == 1 and r["attempt"] is not None]
    assert [r["attempt"] for r in relaunched] == [1]


@pytest.mark.slow
def test_hung_worker_times_out_and_is_relaunched(tmp_path, monkeypatch, fault_free):
    from comm.store import open_store
    from coordinator.bill.cost import read_ledger
    from flows.train import train

    clean, _ = fault_free
    monkeypatch.setenv("ZOOID_CHAOS", "hang_worker:epoch=0:rank=0:step=4")
    url = f"file://{tmp_path}/store"
    summary = train(TrainJob(store=url, worker_timeout_s=8, **JOB))
    assert summary.status == "completed"
    assert summary.final_accuracy == pytest.approx(clean.final_accuracy, abs=0.01)
    ledger = read_ledger(open_store(url), summary.run_id)
    dead = [r for r in ledger["rows"] if r["kind"] == "failed_attempt"]
    assert [(r["rank"], r["status"]) for r in dead] == [(0, "timeout:injected")]
    assert dead[0]["seconds"] >= 8


def test_redis_restarted_mid_epoch_loses_only_scratch(tmp_path, monkeypatch, redis_server, fault_free):
    """Tensors in flight and the warm workers' channel (commands, replies, statuses, the lease)
    live in Redis (scratch); data and checkpoints in the durable directory store. Redis restarts
    without persistence in the middle of the epoch: the workers re-post what was lost, the
    coordinator renews its lease and the run ends where the fault-free run ends.

    The event: rank 0 holds right after its first sync point (its sync checkpoint written) until
    a release key appears; the test restarts Redis while it is held, then releases it."""
    import threading

    from comm.store import open_store
    from coordinator.bill.cost import read_ledger
    from core.keys import sync_checkpoint_key
    from flows.train import train

    clean, clean_weights = fault_free
    durable = tmp_path / "durable"
    monkeypatch.setenv("ZOOID_CHAOS", "hold_worker:epoch=0:rank=0:step=1:at=sync:until=sync/released")
    restarted, finished = threading.Event(), threading.Event()
    seen = {}

    def restart_while_rank_0_is_held():
        scratch = open_store(redis_server.url)
        try:
            while not finished.is_set():
                held = [k for k in scratch.list("runs/") if k.endswith("/faults/held-e0-r0-a0.json")]
                runs = {k.split("/")[1] for k in held} & {p.name for p in (durable / "runs").glob("*")}
                if runs:
                    run = runs.pop()
                    seen["sync_checkpoint"] = (durable / sync_checkpoint_key(run, 0)).is_file()
                    seen["scratch"] = scratch.list(f"runs/{run}/")  # what is in flight in Redis
                    seen["durable"] = sorted(str(p.relative_to(durable)) for p in durable.rglob("*") if p.is_file())
                    scratch.put(f"runs/{run}/sentinel", b"scratch written before the restart", scratch=True)
                    redis_server.restart()
                    seen["sentinel_after"] = scratch.exists(f"runs/{run}/sentinel")
                    restarted.set()
                    scratch.put(f"runs/{run}/sync/released", b"1", scratch=True)  # rank 0 goes on
                    return
                finished.wait(0.05)
        finally:
            scratch.close()

    watcher = threading.Thread(target=restart_while_rank_0_is_held, daemon=True)
    watcher.start()
    try:
        summary = train(TrainJob(store=redis_server.url, durable_store=f"file://{durable}", **JOB))
    finally:
        finished.set()
        watcher.join(timeout=60)
    assert restarted.is_set()
    # the restart lost the scratch store: a key written to it just before is gone after
    assert seen["sentinel_after"] is False
    # only scratch lived there: every key in Redis at the restart was a sync round's, the warm
    # channel's (the epoch's commands, the lease, statuses) or the hold's own marker, while the
    # data and the sync checkpoint the round resumes from were on the durable store
    assert all(any(part in k for part in ("/sync/", "/warm/", "/faults/held-")) for k in seen["scratch"]), \
        seen["scratch"]
    assert any("/warm/" in k and "/cmd-" in k for k in seen["scratch"])  # the channel rode Redis
    run = summary.run_id
    assert seen["sync_checkpoint"] is True
    assert f"runs/{run}/data/manifest.json" in seen["durable"]
    assert summary.status == "completed"
    url = f"file://{durable}"
    weights = _final_weights(url, summary.checkpoint_key)
    for k, v in clean_weights.items():
        torch.testing.assert_close(weights[k], v, rtol=1e-5, atol=1e-6)
    assert summary.final_accuracy == pytest.approx(clean.final_accuracy, abs=0.01)
    ledger = read_ledger(open_store(url), summary.run_id)
    assert ledger["total_usd"] > 0 and ledger["rows"]
    # the workers' records went with their tensors to Redis, where the coordinator read them as
    # each epoch ended (every sample trained once) and teardown deleted them with the scratch
    assert all(e.samples_once for e in summary.epochs)
    assert not (durable / "runs" / run / "history").exists() and not (durable / "runs" / run / "faults").exists()
    assert open_store(redis_server.url).list(f"runs/{summary.run_id}/") == []  # scratch cleaned
