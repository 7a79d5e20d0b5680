"""Spot preemptions on the worker side: the provider's notice (SIGTERM, then SIGKILL after a
grace) injected with `ZOOID_CHAOS=preempt_worker`, the replica's handover, and its
replacement continuing from it.

The tests play the coordinator by hand, as `tests/test_faults_engine.py` does: start the
replicas as processes, wait for the preempted one to leave, read its marker, classify it,
relaunch that rank with the next attempt, and compare the final weights with an
uninterrupted run of the same seed. Events are ordered by the markers in the store and the
processes' exits, never by sleeps.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from comm.store_dir import DirectoryStore
from coordinator.bill.cost import spot_line, spot_tally
from coordinator.workers.failures import FailureKind, classify_failure
from coordinator.workers.preemptions import Preemptions, mark_ledger, redone_seconds
from core.cost_record import CostRecord
from core.errors import Preempted
from core.keys import handover_key
from core.specs import SyncSpec, WorkerSpec
from engine import preemption
from engine.chaos import ChaosError, parse_chaos, read_fault_marker
from engine.local_sgd_epoch import read_epoch_history
from engine.preemption import read_preempted_marker
from engine.replica_data import dataset_tally, epoch_coverage
from tests.test_faults_engine import Coordinator as Workers  # replicas as processes, as the inline launcher starts them
from tests.test_faults_engine import (N, PERIOD, final_weights, run_threads, specs, stage,
                                      wait_for_sync_checkpoint)
from tests.test_faults_engine import reference_weights

REPO = Path(__file__).resolve().parents[1]
reference = pytest.fixture(scope="module", name="reference")(reference_weights)


def gone(pid: int) -> bool:
    """Whether `pid` no longer runs (a zombie waiting for its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_gone(pid: int, timeout_s: float = 30.0) -> bool:
    """Wait for a process to end (an event: its exit), at most `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    return gone(pid)


def preempt_and_replace(tmp_path, chaos: str, victim: int, relaunches: int = 1, resume_step: int = 0, **fields):
    """Run epoch 0 with `chaos` aimed at `victim`; after each of its attempts ends, classify it
    and relaunch it with the next attempt (`relaunches` times); return the store, the
    classified failures and the exit codes of the victim's attempts."""
    store = DirectoryStore(tmp_path / "store")
    stage(store, "p")
    period = fields.pop("sync_period", PERIOD)
    worker_specs = [WorkerSpec.from_dict({**s.to_dict(), "sync_period": period})
                    for s in specs(store.url, "p", **fields)]
    workers = Workers(tmp_path, chaos)
    failures, codes = [], []
    try:
        for spec in worker_specs:
            workers.launch(spec)
        for attempt in range(relaunches + 1):
            code = workers.wait(victim, attempt)
            codes.append(code)
            if attempt == relaunches:
                assert code == 0, workers.output(victim, attempt)
                break
            notice = read_preempted_marker(store, "p", 0, victim, attempt)
            marker = read_fault_marker(store, "p", 0, victim, attempt)
            failure = classify_failure(code, workers.output(victim, attempt), injected=marker, preempted=notice)
            failures.append((failure, notice, marker))
            assert failure.kind is FailureKind.PREEMPTED and failure.retryable
            assert marker.get("watcher") is None or wait_gone(marker["watcher"])  # nothing left running
            assert workers.procs[1 - victim, 0].poll() is None  # its peer waits for the replacement
            if notice is None:  # no grace: the replacement starts from the sync checkpoint it finds
                wait_for_sync_checkpoint(store, "p", resume_step)
            workers.launch(WorkerSpec.from_dict({**worker_specs[victim].to_dict(), "attempt": attempt + 1}))
        assert workers.wait(1 - victim, 0) == 0, workers.output(1 - victim, 0)
    finally:
        workers.stop_all()
    return store, failures, codes


def assert_equal_weights(store, reference_weights) -> None:
    weights = final_weights(store, "runs/p/ckpt/e0")
    for name, expected in reference_weights.items():
        assert torch.equal(weights[name], expected), name


@pytest.mark.timeout(300)
def test_a_replica_preempted_mid_epoch_hands_over_and_ends_equal_to_the_uninterrupted_run(tmp_path, reference):
    store, failures, codes = preempt_and_replace(tmp_path, "preempt_worker:epoch=0:rank=1:step=4:grace=60", victim=1)
    assert codes[0] == 6  # Preempted: it left on its own, long before the SIGKILL
    failure, notice, marker = failures[0]
    assert (marker["kind"], marker["step"], marker["grace"]) == ("preempt_worker", 4, 60.0)
    assert notice["handover"] == handover_key("p", 0, 1) and notice["step"] == 4
    assert_equal_weights(store, reference)  # bit for bit: nothing was lost, nothing redone
    history = read_epoch_history(store, "p", 0)
    replacement = next(h for h in history if (h["rank"], h["attempt"]) == (1, 1))
    # step 4 lies between the syncs at 3 and 6: the replacement continued from 4, mid-interval
    assert (replacement["start_step"], replacement["steps_trained"], replacement["start_round"]) == (4, 5, 1)
    assert epoch_coverage(history) == dataset_tally(N)
    assert wait_gone(marker["watcher"])  # the SIGKILL watcher ended with the worker
    assert store.list("runs/p/sync/") == []


@pytest.mark.timeout(300)
def test_a_compressed_sync_with_an_outer_step_hands_over_its_residual_and_momentum(tmp_path):
    """bfloat16 syncs with DiLoCo's outer step: the handover carries the outer momentum and this
    rank's error-feedback residual (written as its round's), and the epoch still ends equal."""
    sync = SyncSpec(sync_dtype="bfloat16", outer_optimizer="nesterov", outer_lr=0.7, outer_momentum=0.9)
    ref_store = DirectoryStore(tmp_path / "ref")
    stage(ref_store, "p")
    run_threads(ref_store, specs(ref_store.url, "p", sync=sync))
    expected = final_weights(ref_store, "runs/p/ckpt/e0")
    store, failures, codes = preempt_and_replace(tmp_path, "preempt_worker:epoch=0:rank=1:step=5:grace=60", victim=1,
                                                 sync=sync)
    assert codes[0] == 6 and failures[0][1]["step"] == 5
    assert_equal_weights(store, expected)


@pytest.mark.timeout(300)
def test_gradients_averaged_every_step_hand_over_too(tmp_path):
    """sync_period 1: every step averages gradients in buckets; the handover is after a step's
    round, and the replacement's buckets join the next one."""
    ref_store = DirectoryStore(tmp_path / "ref")
    stage(ref_store, "p")
    run_threads(ref_store, [WorkerSpec.from_dict({**s.to_dict(), "sync_period": 1}) for s in specs(ref_store.url, "p")])
    expected = final_weights(ref_store, "runs/p/ckpt/e0")
    store, failures, codes = preempt_and_replace(tmp_path, "preempt_worker:epoch=0:rank=0:step=4:grace=60", victim=0,
                                                 sync_period=1)
    assert codes[0] == 6 and failures[0][1]["step"] == 4
    assert_equal_weights(store, expected)
    replacement = next(h for h in read_epoch_history(store, "p", 0) if (h["rank"], h["attempt"]) == (0, 1))
    assert (replacement["start_step"], replacement["start_round"]) == (4, 4)


@pytest.mark.timeout(300)
def test_a_replica_preempted_twice_in_one_epoch_ends_equal(tmp_path, reference):
    chaos = "preempt_worker:epoch=0:rank=0:step=2:grace=60,preempt_worker:epoch=0:rank=0:step=7:attempt=1:grace=60"
    store, failures, codes = preempt_and_replace(tmp_path, chaos, victim=0, relaunches=2)
    assert codes[:2] == [6, 6]
    assert [n["step"] for _, n, _ in failures] == [2, 7]
    assert_equal_weights(store, reference)
    history = read_epoch_history(store, "p", 0)
    assert [(h["attempt"], h["start_step"]) for h in history if h["rank"] == 0] == [(2, 7)]
    assert epoch_coverage(history) == dataset_tally(N)


@pytest.mark.timeout(300)
def test_a_preemption_during_a_sync_hands_over_after_it(tmp_path, reference):
    # the notice comes as the sync after step 6 starts; the collective completes, then the replica leaves
    store, failures, codes = preempt_and_replace(tmp_path, "preempt_worker:epoch=0:rank=0:step=5:at=sync:grace=60",
                                                 victim=0)
    failure, notice, marker = failures[0]
    assert codes[0] == 6 and (marker["at"], marker["step"]) == ("sync", 6)
    assert notice["step"] == 6
    assert_equal_weights(store, reference)
    replacement = next(h for h in read_epoch_history(store, "p", 0) if (h["rank"], h["attempt"]) == (0, 1))
    assert (replacement["start_step"], replacement["start_round"]) == (6, 2)


@pytest.mark.timeout(300)
def test_a_replica_noticed_while_its_peer_is_gone_leaves_from_the_wait_and_its_replacement_replays(tmp_path,
                                                                                                  reference):
    # rank 0 gets the notice as its first sync starts, rank 1 not started: it waits for rank 1's pieces
    # WAIT_AFTER_NOTICE_S, then leaves (exit 6), long before the SIGKILL at the grace's end (60 s)
    store = DirectoryStore(tmp_path / "store")
    stage(store, "p")
    worker_specs = specs(store.url, "p")
    workers = Workers(tmp_path, "preempt_worker:epoch=0:rank=0:step=2:at=sync:grace=60")
    try:
        workers.launch(worker_specs[0])
        code = workers.wait(0, 0)
        notice = read_preempted_marker(store, "p", 0, 0, 0)
        marker = read_fault_marker(store, "p", 0, 0, 0)
        assert code == 6, workers.output(0, 0)
        assert (notice["step"], notice["handover"], notice["left"]) == (PERIOD, "", "waiting at a sync")
        failure = classify_failure(code, workers.output(0, 0), injected=marker, preempted=notice)
        assert failure.kind is FailureKind.PREEMPTED
        assert wait_gone(marker["watcher"])  # the SIGKILL watcher ended with the worker
        workers.launch(worker_specs[1])
        workers.launch(WorkerSpec.from_dict({**worker_specs[0].to_dict(), "attempt": 1}))
        assert workers.wait(0, 1) == 0, workers.output(0, 1)
        assert workers.wait(1, 0) == 0, workers.output(1, 0)
    finally:
        workers.stop_all()
    weights = final_weights(store, "runs/p/ckpt/e0")
    for name, expected in reference.items():
        torch.testing.assert_close(weights[name], expected, rtol=1e-9, atol=1e-9)
    history = read_epoch_history(store, "p", 0)
    replacement = next(h for h in history if (h["rank"], h["attempt"]) == (0, 1))
    assert replacement["start_step"] == 0  # no sync checkpoint yet: the round is replayed, its steps redone
    assert epoch_coverage(history) == dataset_tally(N)


@pytest.mark.timeout(300)
def test_no_grace_is_a_sigkill_and_the_replacement_redoes_at_most_the_steps_since_the_sync(tmp_path, reference):
    store, failures, codes = preempt_and_replace(tmp_path, "preempt_worker:epoch=0:rank=1:step=5:grace=0",
                                                 victim=1, resume_step=3)
    failure, notice, marker = failures[0]
    assert codes[0] == -signal.SIGKILL and notice is None  # no notice: nothing handed over
    assert failure.injected and marker["step"] == 5
    weights = final_weights(store, "runs/p/ckpt/e0")
    for name, expected in reference.items():
        torch.testing.assert_close(weights[name], expected, rtol=1e-9, atol=1e-9)
    replacement = next(h for h in read_epoch_history(store, "p", 0) if (h["rank"], h["attempt"]) == (1, 1))
    assert replacement["start_step"] == 3  # the sync checkpoint: steps 3 and 4 are redone
    assert marker["step"] - replacement["start_step"] <= PERIOD
    assert not store.list("runs/p/ckpt/handover/")


@pytest.mark.timeout(300)
def test_over_the_ring_the_attempt_reruns_within_the_documented_bound(tmp_path):
    """The ring cannot take a new rank: the preempted rank leaves with nothing handed over, its
    peer's ring fails, and the attempt reruns every rank from the sync checkpoint: what is
    redone is at most the steps since the last sync checkpoint (`sync.checkpoint_s` = 0:
    every round), the README's bound."""
    ring = SyncSpec(collective="ring", checkpoint_s=0.0, ring_timeout_s=60.0)
    ref_store = DirectoryStore(tmp_path / "ref")
    stage(ref_store, "p")
    run_threads(ref_store, specs(ref_store.url, "p", sync=ring))
    expected = final_weights(ref_store, "runs/p/ckpt/e0")

    store = DirectoryStore(tmp_path / "store")
    stage(store, "p")
    first = specs(store.url, "p", sync=ring)
    workers = Workers(tmp_path, "preempt_worker:epoch=0:rank=1:step=5:grace=60")
    try:
        for spec in first:
            workers.launch(spec)
        assert workers.wait(1, 0) == 6
        assert workers.wait(0, 0) != 0  # the ring lost a peer: this attempt is over
        notice = read_preempted_marker(store, "p", 0, 1, 0)
        assert notice["handover"] == "" and notice["step"] == 5
        for spec in first:  # the coordinator's rerun: every rank, the next attempt
            workers.launch(WorkerSpec.from_dict({**spec.to_dict(), "attempt": 1}))
        assert [workers.wait(r, 1) for r in (0, 1)] == [0, 0], workers.output(0, 1)
    finally:
        workers.stop_all()
    weights = final_weights(store, "runs/p/ckpt/e0")
    for name, value in expected.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-9, atol=1e-9)
    reruns = [h for h in read_epoch_history(store, "p", 0) if h["attempt"] == 1]
    assert {h["start_step"] for h in reruns} == {3}  # the sync checkpoint at step 3
    assert all(notice["step"] - h["start_step"] <= PERIOD for h in reruns)


def test_the_measured_interruption_rate_goes_to_the_run_terms():
    from coordinator.plan.run_terms import INTERRUPTIONS_KEY, RunClock

    def row(attempt, status, capacity="spot"):
        return CostRecord(run_id="r", resource=f"worker e0 r0 a{attempt}", kind="worker", offer="o", start=0.0,
                          stop=1800.0, unit_price_per_s=1.0, status=status, epoch=0, rank=0, attempt=attempt,
                          capacity=capacity, list_price_per_s=3.0)

    def samples(rows):
        ctx = SimpleNamespace(state=SimpleNamespace(startup_samples=[], ledger=rows), job=SimpleNamespace(warm=False))
        return RunClock().samples(ctx, [], 0.0)

    # one preemption in an hour of spot workers
    assert samples([row(0, "preempted"), row(1, "completed")])[INTERRUPTIONS_KEY] == [1.0]
    assert INTERRUPTIONS_KEY not in samples([row(0, "completed", "on_demand")])  # no spot: nothing measured


def test_the_notice_only_sets_a_flag_and_the_previous_handler_comes_back():
    previous = signal.getsignal(signal.SIGTERM)
    with preemption.listening() as installed:
        assert installed and not preemption.requested()
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while not preemption.requested() and time.monotonic() < deadline:
            pass  # the handler runs between bytecodes of the main thread
        assert preemption.requested()
    assert signal.getsignal(signal.SIGTERM) is previous
    store = DirectoryStore(Path("/tmp") / f"zooid-preempt-{os.getpid()}")
    spec = specs(store.url, "n")[0]
    try:
        with pytest.raises(Preempted, match="left at step 3"):
            preemption.leave(store, spec, 3)
        assert read_preempted_marker(store, "n", 0, 0, 0)["step"] == 3
    finally:
        store.delete_prefix("runs/n/")
        preemption.reset()  # the notice is this process's: no later test's epoch may see it


def test_chaos_parses_preemptions():
    (f,) = parse_chaos("preempt_worker:epoch=1:rank=0:step=4:grace=2.5:at=sync")
    assert (f.kind, f.epoch, f.rank, f.step, f.grace, f.at) == ("preempt_worker", 1, 0, 4, 2.5, "sync")
    assert parse_chaos("preempt_worker:at=profile:grace=0")[0].at == "profile"
    for bad in ("preempt_worker:grace=-1", "preempt_worker:grace=x", "kill_worker:grace=1", "kill_worker:at=profile"):
        with pytest.raises(ChaosError):
            parse_chaos(bad)


@pytest.mark.parametrize("code, output, preempted, kind", [
    (6, "", None, FailureKind.PREEMPTED),
    (None, "Flow run failed: Preempted: rank 1 of epoch 0 got the notice", None, FailureKind.PREEMPTED),
    (-15, "", None, FailureKind.PREEMPTED),
    (143, "", None, FailureKind.PREEMPTED),
    (None, "Execution was aborted by a termination signal.", None, FailureKind.PREEMPTED),  # Prefect's crash
    (1, "Execution was aborted by a termination signal.", None, FailureKind.CRASH),  # the exit says otherwise
    (None, "Execution was aborted by an interrupt signal.", None, FailureKind.CRASH),
    (None, "Flow run infrastructure exited with non-zero status code 143. Terminated", None, FailureKind.PREEMPTED),
    (None, "Flow run infrastructure exited with non-zero status code 1.", None, FailureKind.CRASH),
    (None, "Flow run infrastructure exited with non-zero status code 2.", None, FailureKind.BAD_INPUT),
    (1, "", {"step": 4, "handover": "k"}, FailureKind.PREEMPTED),
    (-9, "", None, FailureKind.CRASH),
])
def test_classification_of_preemptions(code, output, preempted, kind):
    assert classify_failure(code, output, preempted=preempted).kind is kind


def test_a_spot_rank_moves_to_on_demand_after_the_policy_s_preemptions():
    policy = Preemptions(before_on_demand=2)
    spec = WorkerSpec(run_id="r", epoch=0, rank=1, world=2, store_url="file:///x", model="digits_mlp",
                      dataset="digits", steps=1, batch_size=1, lr=0.1, init_key="k", capacity="spot")
    policy.record(1)
    assert policy.respec(spec).capacity == "spot"  # once: spot again
    policy.record(1)
    assert policy.respec(spec).capacity == "on_demand"  # twice in the epoch: on-demand
    assert policy.capacity(0, "spot") == "spot"  # per rank
    assert policy.capacity(1, "on_demand") == "on_demand"


def test_the_relaunch_policy_replaces_a_preempted_replica_without_counting_a_crash(tmp_path, monkeypatch):
    from coordinator.workers import epoch_run
    from coordinator.workers.launchers import WorkerOutcome
    from core.kinds import Strategy

    store = DirectoryStore(tmp_path / "s")
    ctx = SimpleNamespace(run_id="r", job=SimpleNamespace(), open_store=lambda: DirectoryStore(tmp_path / "s"),
                          state=SimpleNamespace(attempts={}))
    plan = SimpleNamespace(strategy=Strategy.LOCAL_SGD)
    on_failure = epoch_run.relaunch_policy(ctx, plan, max_relaunches=0)
    spec = WorkerSpec(run_id="r", epoch=0, rank=1, world=2, store_url=store.url, model="digits_mlp",
                      dataset="digits", steps=9, batch_size=1, lr=0.1, init_key="k", capacity="spot")
    capacities = []
    for attempt in range(3):
        spec = WorkerSpec.from_dict({**spec.to_dict(), "attempt": attempt})
        preemption.mark_preempted(store, spec, 2 + attempt, handover="h")
        outcome = WorkerOutcome(rank=1, attempt=attempt, started_at=0.0, status="failed", extra={"exit_code": 6})
        spec = on_failure(outcome, spec)  # max_relaunches=0: a crash would not be relaunched
        assert outcome.extra["failure"]["kind"] == "preempted" and outcome.extra["reached_step"] == 2 + attempt
        capacities.append(spec.capacity)
    assert capacities == ["spot", "on_demand", "on_demand"]


def test_the_ledger_marks_preempted_intervals_and_the_work_redone():
    def row(rank, attempt, start, stop, kind="worker", status="completed"):
        return CostRecord(run_id="r", resource=f"worker e0 r{rank} a{attempt}", kind=kind, offer="fargate-spot",
                          start=start, stop=stop, unit_price_per_s=1.0, status=status, epoch=0, rank=rank,
                          attempt=attempt)

    rows = [row(0, 0, 0, 10), row(1, 0, 0, 4, "failed_attempt", "failed:preempted"), row(1, 1, 4, 11)]
    marked = mark_ledger(rows, 0, {(1, 0)}, {(1, 1): redone_seconds(5, 3, 0.5)},
                         priced={(1, 1): ("fargate-cpu", 3.0, "on_demand", 3.0), (1, 0): ("fargate-spot", 1.0, "spot", 3.0),
                                 (0, 0): ("fargate-spot", 1.0, "spot", 3.0)})
    assert [(r.kind, r.status, r.redone_s) for r in marked] == [
        ("worker", "completed", 0.0), ("worker", "preempted", 0.0), ("worker", "completed", 1.0)]
    assert (marked[2].offer, marked[2].unit_price_per_s) == ("fargate-cpu", 3.0)
    assert redone_seconds(4, 4, 0.5) == 0.0 and redone_seconds(None, 0, 1.0) == 0.0
    tally = spot_tally([r.to_dict() for r in marked])
    # 14 spot seconds billed at $1 instead of $3, and 7 on-demand seconds at $3: $28 saved
    assert tally == {"preemptions": 1, "redone_s": 1.0, "spot_worker_s": 14.0, "saved_usd": 28.0,
                     "interruptions_per_worker_hour": 1 / (14 / 3600)}
    assert spot_line(tally) == "1 preemption, 1 s of work redone, $28.0000 saved against on-demand"
    assert spot_line(spot_tally([])) is None
