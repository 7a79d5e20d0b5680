"""Faults on the worker side: relaunch inside an epoch, chaos injection, failure classes,
and a Redis restart in the middle of a sync round.

The kill tests play the coordinator by hand: start the replicas as processes, wait for the
injected death, read the fault marker, classify, relaunch that one replica with
`attempt=1`, and compare the final weights with a fault-free run of the same seed.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import comm.collectives as collectives
import comm.store_base as store_base
from comm.collectives import allreduce_mean, release_group
from comm.store_dir import DirectoryStore
from comm.store_redis import RedisStore
from coordinator.workers.worker_forks import ForkedWorker
from coordinator.workers.failures import FailureKind, MemoryEvents, classify_failure, read_memory_events
from core.errors import StoreTimeout, ZooidValueError
from core.keys import sync_checkpoint_key
from core.specs import ComputeSpec, SyncSpec, WorkerSpec
from engine.chaos import ChaosError, Fault, fault_marker_key, parse_chaos, read_fault_marker
from engine.checkpoint import initial_checkpoint, load_checkpoint, read_checkpoint_meta
from engine.datasets import publish_dataset
from engine.local_sgd_epoch import read_epoch_history, run_local_sgd_epoch
from engine.models import build_model
from engine.replica_data import dataset_tally, epoch_coverage
from tests.memory_store import Died, DyingStore, MemoryStore
from tests.fake_clock import FakeClock
from tests.forked_workers import start_worker

REPO = Path(__file__).resolve().parents[1]
WORLD, STEPS, PERIOD, BATCH = 2, 9, 3, 16
DATA, N = "synthetic:64:10:288:32", 288
"""An epoch of STEPS steps: 288 rows = 9 x 2 replicas x 16."""
# One thread per worker process: the relaunch then computes the very same float64 sums.
WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def stage(store, run_id: str) -> None:
    """Publish the data and an initial checkpoint for `run_id`."""
    publish_dataset(store, run_id, DATA, subset_size=32)
    initial_checkpoint(store, f"runs/{run_id}/ckpt/init", "digits_mlp", "sgd", lr=0.1, seed=3)


def specs(store_url: str, run_id: str, **fields) -> list[WorkerSpec]:
    """Float64 plain-SGD replicas of epoch 0, every rank with an out_key."""
    return [WorkerSpec(run_id=run_id, epoch=0, rank=r, world=WORLD, store_url=store_url,
                       model="digits_mlp", dataset=DATA, steps=STEPS,
                       batch_size=BATCH, lr=0.1, sync_period=PERIOD, seed=3,
                       init_key=f"runs/{run_id}/ckpt/init", out_key=f"runs/{run_id}/ckpt/e0",
                       sync_timeout_s=60, evaluate=False, compute=ComputeSpec(dtype="float64"), **fields)
            for r in range(WORLD)]


def run_threads(store, worker_specs):
    """Run the replicas as threads of this process against `store`."""
    with ThreadPoolExecutor(len(worker_specs)) as pool:
        return list(pool.map(lambda s: run_local_sgd_epoch(s, store), worker_specs))


def final_weights(store, key: str) -> dict[str, torch.Tensor]:
    model = build_model("digits_mlp", 0).double()
    load_checkpoint(store, key, model)
    return model.state_dict()


def reference_weights(tmp_path_factory):
    """The fault-free epoch's final weights (threads; the same seed and data as the kill tests;
    each module that compares with them makes it its own module-scoped fixture, `reference`)."""
    store = DirectoryStore(tmp_path_factory.mktemp("ref"))
    stage(store, "ref")
    run_threads(store, specs(store.url, "ref"))
    return final_weights(store, "runs/ref/ckpt/e0")


reference = pytest.fixture(scope="module", name="reference")(reference_weights)


class Coordinator:
    """Launch workers as processes, as `coordinator.workers.launchers.InlineLauncher` does (forked
    ready-imported)."""

    def __init__(self, logs: Path, chaos: str):
        self.logs, self.chaos = logs, chaos
        self.procs: dict[tuple[int, int], ForkedWorker] = {}

    def launch(self, spec: WorkerSpec) -> None:
        env = {**os.environ, **WORKER_ENV, "ZOOID_CHAOS": self.chaos}
        self.procs[spec.rank, spec.attempt] = start_worker(spec, env, self.logs / f"r{spec.rank}-a{spec.attempt}.log")

    def wait(self, rank: int, attempt: int) -> int:
        return self.procs[rank, attempt].wait(timeout=120)

    def output(self, rank: int, attempt: int) -> str:
        return (self.logs / f"r{rank}-a{attempt}.log").read_text()

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()


def wait_for_sync_checkpoint(store, run_id: str, step: int) -> None:
    """Block until the epoch's sync checkpoint is at `step` (rank 0 writes it right after
    the sync; waiting makes the relaunch's starting point deterministic)."""
    while step and (read_checkpoint_meta(store, sync_checkpoint_key(run_id, 0)) or {}).get("step") != step:
        time.sleep(0.02)  # a hang here is caught by the callers' pytest timeout


def kill_and_relaunch(tmp_path, chaos: str, victim: int, resume_step: int):
    """Run an epoch whose `victim` dies by `chaos`; relaunch it once from the sync
    checkpoint at `resume_step`; return the store, the classified failure and the marker."""
    store = DirectoryStore(tmp_path / "store")
    stage(store, "k")
    worker_specs = specs(store.url, "k")
    coordinator = Coordinator(tmp_path, chaos)
    try:
        for spec in worker_specs:
            coordinator.launch(spec)
        code = coordinator.wait(victim, 0)
        marker = read_fault_marker(store, "k", 0, victim, 0)
        failure = classify_failure(code, coordinator.output(victim, 0), injected=marker)
        assert failure.retryable
        # The contract: same spec, attempt + 1, no key deleted; the survivor is still waiting.
        assert coordinator.procs[1 - victim, 0].poll() is None
        wait_for_sync_checkpoint(store, "k", resume_step)
        coordinator.launch(WorkerSpec.from_dict({**worker_specs[victim].to_dict(), "attempt": 1}))
        assert coordinator.wait(victim, 1) == 0, coordinator.output(victim, 1)
        assert coordinator.wait(1 - victim, 0) == 0, coordinator.output(1 - victim, 0)
    finally:
        coordinator.stop_all()
    return store, failure, marker


@pytest.mark.timeout(300)
def test_replica_killed_at_a_sync_point_ends_equal_to_the_fault_free_run(tmp_path, reference):
    store, failure, marker = kill_and_relaunch(
        tmp_path, "kill_worker:epoch=0:rank=1:step=3:at=sync", victim=1, resume_step=3)
    assert failure.kind is FailureKind.INJECTED and failure.injected
    assert (marker["kind"], marker["step"], marker["attempt"]) == ("kill_worker", 3, 0)
    for name, expected in reference.items():
        torch.testing.assert_close(final_weights(store, "runs/k/ckpt/e0")[name], expected, rtol=1e-12, atol=1e-12)
    history = read_epoch_history(store, "k", 0)
    relaunch = next(h for h in history if (h["rank"], h["attempt"]) == (1, 1))
    # Died right after the sync at step 3, so the relaunch redid nothing.
    assert (relaunch["start_step"], relaunch["steps_trained"], relaunch["start_round"]) == (3, 6, 1)
    assert store.list("runs/k/sync/") == []


@pytest.mark.timeout(300)
def test_replica_killed_at_a_random_step_covers_every_batch_once(tmp_path, reference):
    step = random.Random(11).choice([s for s in range(1, STEPS) if s % PERIOD])  # not a sync point
    last_sync = step // PERIOD * PERIOD
    store, failure, marker = kill_and_relaunch(tmp_path, f"kill_worker:epoch=0:rank=0:step={step}", victim=0,
                                               resume_step=last_sync)
    assert failure.kind is FailureKind.INJECTED and marker["step"] == step
    weights = final_weights(store, "runs/k/ckpt/e0")
    for name, expected in reference.items():
        torch.testing.assert_close(weights[name], expected, rtol=1e-9, atol=1e-9)
    # Per rank: what the dead attempt committed (up to its last sync point) and what the
    # completed attempts trained tile the epoch's steps exactly once.
    history = read_epoch_history(store, "k", 0)
    covered = {0: [(0, last_sync)], 1: []}
    for h in history:
        covered[h["rank"]].append((h["start_step"], h["end_step"]))
    assert covered == {0: [(0, last_sync), (last_sync, STEPS)], 1: [(0, STEPS)]}
    assert step - last_sync < PERIOD  # lost work stays inside one sync interval
    # and their tallies add up to every sample once, the dead attempt's steps included
    assert epoch_coverage(history) == dataset_tally(N)
    assert sum(h["samples"] for h in history) == N - last_sync * BATCH  # the relaunch skipped those
    meta = read_checkpoint_meta(store, sync_checkpoint_key("k", 0))
    assert (meta["step"], meta["round"], meta["epoch"]) == (STEPS, STEPS // PERIOD - 1, 0)


@pytest.mark.timeout(300)
def test_redis_restart_mid_round_loses_scratch_keys_and_the_round_completes(tmp_path, redis_server, reference,
                                                                          monkeypatch):
    durable = DirectoryStore(tmp_path / "durable")
    scratch = RedisStore(redis_server.url)
    stage(durable, "rr")  # data and checkpoints are durable; Redis holds the syncs
    stage(scratch, "rr")  # a copy the restart will wipe, to show the keys really were lost
    # Rank 1 straggles after round 0, so rank 0 waits inside round 1 with its piece posted.
    monkeypatch.setenv("ZOOID_CHAOS", f"slow_worker:epoch=0:rank=1:step={PERIOD}:seconds=2")
    piece = "runs/rr/sync/e0/r1/part-1-0"

    finished, restarted = threading.Event(), threading.Event()

    def restart_when_rank0_waits():  # the piece appearing is the event: rank 0 is in round 1
        while not scratch.exists(piece):
            if finished.is_set():
                return
            time.sleep(0.01)
        redis_server.restart(down_s=0.2)
        restarted.set()

    restarter = threading.Thread(target=restart_when_rank0_waits)
    restarter.start()
    try:
        run_threads(scratch, specs(scratch.url, "rr", checkpoint_store=durable.url, sync=SyncSpec(repost_s=0.3)))
    finally:
        finished.set()
        restarter.join()
    assert restarted.is_set()  # the restart came while rank 0 waited inside round 1
    assert not scratch.exists("runs/rr/data/manifest.json")  # the restart really lost the keys
    for name, expected in reference.items():
        torch.testing.assert_close(final_weights(durable, "runs/rr/ckpt/e0")[name], expected, rtol=1e-12, atol=1e-12)
    history = read_epoch_history(scratch, "rr", 0)  # the records go with the tensors
    assert sum(h["reposts"] for h in history) >= 1
    assert scratch.list("runs/rr/sync/") == []
    scratch.close()


@pytest.mark.parametrize("dies", ["before_its_mean", "after_its_mean"])
def test_a_rank_relaunched_inside_a_round_completes_it_with_the_survivors(dies):
    store, world = MemoryStore(), 3
    inputs = [{"w": torch.randn(10, generator=torch.Generator().manual_seed(r), dtype=torch.float64)}
              for r in range(world)]
    if dies == "before_its_mean":  # it has read its pieces and posts its result
        when = lambda op, key: op == "put" and key.endswith("/mean-1")  # noqa: E731
    else:  # its result is posted, its pieces are being deleted
        when = lambda op, key: op == "delete" and "/part-1-" in key  # noqa: E731

    def rank(r):
        if r != 1:
            out = allreduce_mean(store, "runs/t/sync/e0/r0", r, world, inputs[r], 20)
        else:
            with pytest.raises(Died):
                allreduce_mean(DyingStore(store, when), "runs/t/sync/e0/r0", 1, world, inputs[1], 20)
            out = allreduce_mean(store, "runs/t/sync/e0/r0", 1, world, inputs[1], 20, replay=True)  # relaunch
        release_group(store, "runs/t/sync/e0", r, world, 20, resumed=r == 1)
        return out

    with ThreadPoolExecutor(world) as pool:
        outs = list(pool.map(rank, range(world)))
    expected = torch.stack([t["w"] for t in inputs]).mean(0)
    for out in outs:
        torch.testing.assert_close(out["w"], expected, rtol=1e-15, atol=1e-15)
        assert torch.equal(out["w"], outs[0]["w"])
    assert store.list("runs/") == []


class RecordingStore(MemoryStore):
    """A MemoryStore that records the calls made on it and refuses to wait: `get`, the one
    call that waits for a key, fails the test."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, str]] = []  # `ops` is every Store's request count

    def put(self, key, data, **kwargs):
        self.calls.append(("put", key))
        super().put(key, data, **kwargs)

    def get(self, key, timeout=None):
        raise AssertionError(f"waited for {key}")

    def list(self, prefix):
        self.calls.append(("list", prefix))
        return super().list(prefix)

    def delete_prefix(self, prefix):
        self.calls.append(("delete_prefix", prefix))
        return super().delete_prefix(prefix)


def test_a_relaunched_rank_0_after_the_release_returns_at_once(monkeypatch):
    """Its previous life released the group (no call keys left) and left a done key behind:
    the relaunch looks for call keys once, deletes what is left and returns, posting no done
    key and waiting for none (no `get`; the fake clock never moves)."""
    store = RecordingStore()
    store._data["runs/t/sync/e0/done/1"] = b"1"  # a peer's, posted after the release
    clock = FakeClock()
    monkeypatch.setattr(collectives, "time", clock)
    monkeypatch.setattr(store_base, "time", clock)
    release_group(store, "runs/t/sync/e0", 0, 2, 0.5, resumed=True)
    assert store.calls == [("list", "runs/t/sync/e0/r"), ("delete_prefix", "runs/t/sync/e0/")]
    assert clock.now == clock.start
    assert store.list("runs/") == []


def test_rank_0_stops_waiting_for_done_keys_a_restarted_store_lost(monkeypatch):
    """The scratch store restarts (Redis without persistence) after rank 1 posted its done
    key: rank 0, releasing, finds the call keys gone too and returns within a stall or two
    instead of waiting out the sync timeout (the chaos run once hung here for 600 s)."""
    store, world = MemoryStore(), 2
    inputs = [{"w": torch.full((6,), float(r))} for r in range(world)]
    with ThreadPoolExecutor(world) as pool:
        list(pool.map(lambda r: allreduce_mean(store, "runs/t/sync/e0/r0", r, world, inputs[r], 20), range(world)))
    release_group(store, "runs/t/sync/e0", 1, world, 20)
    assert store.list("runs/t/sync/e0/done/") == ["runs/t/sync/e0/done/1"]
    store.delete_prefix("runs/")  # the restart: every scratch key is gone
    with ThreadPoolExecutor(world) as pool:  # the next group's calls, done, before the fake clock
        list(pool.map(lambda r: allreduce_mean(store, "runs/t/sync/e1/r0", r, world, inputs[r], 20), range(world)))
    clock = FakeClock()
    monkeypatch.setattr(collectives, "time", clock)
    monkeypatch.setattr(store_base, "time", clock)
    release_group(store, "runs/t/sync/e0", 0, world, 60)
    assert clock.now - clock.start == pytest.approx(1.0)  # one stall of a 1 s get, not the 60 s timeout
    assert store.list("runs/t/sync/e0/") == []

    # with the call keys still there a missing done key is waited for, up to the timeout
    clock.start = clock.now
    with pytest.raises(StoreTimeout, match="done/1"):
        release_group(store, "runs/t/sync/e1", 0, world, 1.5)
    assert clock.now - clock.start == pytest.approx(1.5)


def test_chaos_parsing():
    assert parse_chaos("") == []
    kill, crash, oom = parse_chaos("kill_worker:epoch=1:rank=0:step=5:at=sync, crash_worker:epoch=0:rank=1,"
                                   "oom_worker:mode=kill:attempt=any")
    assert kill == Fault(kind="kill_worker", epoch=1, rank=0, attempt=0, step=5, at="sync")
    assert crash == Fault(kind="crash_worker", epoch=0, rank=1, attempt=None)  # the original: every attempt
    assert (oom.mode, oom.attempt, oom.epoch) == ("kill", None, None)
    spec = WorkerSpec(run_id="x", epoch=1, rank=0, world=2, store_url="", model="m", dataset="d",
                      steps=1, batch_size=1, lr=0.1)
    assert kill.matches(spec) and not kill.matches(WorkerSpec.from_dict({**spec.to_dict(), "attempt": 1}))
    for bad, words in [("explode_worker", "unknown fault"), ("kill_worker:step=x", "not an integer"),
                       ("kill_worker:rank", "not key=value"), ("hang_worker:mode=kill", "not a valid setting"),
                       ("kill_worker:epoch=-1", ">= 0")]:
        with pytest.raises(ChaosError, match=words) as info:
            parse_chaos(bad)
        assert isinstance(info.value, ValueError) and str(info.value).startswith("ZOOID_CHAOS:")
    assert fault_marker_key("r", 1, 2, 3) == "runs/r/faults/e1-r2-a3.json"


def test_a_held_worker_goes_on_when_its_key_appears():
    """`hold_worker` waits for a key under its run, written here by another thread once the
    worker is known to be waiting (an event, not a sleep), and then returns."""
    import threading

    from engine.chaos import Chaos

    (hold,) = parse_chaos("hold_worker:epoch=0:rank=0:step=3:until=warm/r1-")
    assert (hold.until, hold.seconds, hold.step) == ("warm/r1-", 600.0, 3)
    for bad in ("hold_worker:epoch=0", "hold_worker:until="):
        with pytest.raises(ChaosError, match="until"):
            parse_chaos(bad)
    spec = WorkerSpec(run_id="held", epoch=0, rank=0, world=1, store_url="", model="m", dataset="d",
                      steps=5, batch_size=1, lr=0.1)
    store, waiting, released = MemoryStore(), threading.Event(), threading.Event()
    listed = store.list

    def list_and_tell(prefix):
        waiting.set()  # the worker has looked for its key at least once
        return listed(prefix)

    store.list = list_and_tell
    chaos = Chaos(spec, store, [hold])
    worker = threading.Thread(target=lambda: (chaos.before_step(3), released.set()))
    worker.start()
    assert waiting.wait(60) and not released.is_set()
    store.put("runs/held/warm/r1-w0/status.json", b"{}")
    worker.join(60)
    assert released.is_set() and chaos.pending == []


@pytest.mark.parametrize("code, output, extra, kind", [
    (-9, "", {}, FailureKind.CRASH),  # SIGKILL without memory evidence
    (137, "", {"events_before": MemoryEvents(0, 0), "events_after": MemoryEvents(1, 1)}, FailureKind.OOM),
    (137, "", {"events_before": MemoryEvents(0, 2), "events_after": MemoryEvents(0, 2)}, FailureKind.CRASH),
    (-9, "", {"peak_rss_bytes": 990, "memory_limit_bytes": 1000}, FailureKind.OOM),
    (-9, "", {"peak_rss_bytes": 500, "memory_limit_bytes": 1000}, FailureKind.CRASH),
    (4, '{"error": "OutOfMemory"}', {}, FailureKind.OOM),
    (1, "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", {}, FailureKind.OOM),
    (2, '{"error": "ZooidValueError", "message": "model: ..."}', {}, FailureKind.BAD_INPUT),
    (3, "StoreTimeout: rank 1 waited 120s for runs/x/sync/e0/r3/mean-0", {}, FailureKind.STORE_TIMEOUT),
    (7, "", {}, FailureKind.DATA),
    (None, "ShardError: dataset shard train/1 of file:///b is corrupt (...) after 3 reads", {}, FailureKind.DATA),
    (1, "RuntimeError: boom", {}, FailureKind.CRASH),
    (None, "", {"timed_out": True}, FailureKind.TIMEOUT),
    (17, "", {"injected": {"kind": "crash_worker", "step": 0}}, FailureKind.INJECTED),
    (-9, "", {"injected": {"kind": "oom_worker", "step": 0}}, FailureKind.OOM),
])
def test_classification(code, output, extra, kind):
    failure = classify_failure(code, output, **extra)
    assert failure.kind is kind
    assert failure.retryable == (kind not in (FailureKind.OOM, FailureKind.BAD_INPUT, FailureKind.DATA))
    assert failure.to_dict()["kind"] == kind.value


def test_classification_refuses_a_success_and_reads_cgroup_counters(tmp_path):
    with pytest.raises(ZooidValueError, match="exit_code"):
        classify_failure(0)
    (tmp_path / "memory.events").write_text("low 0\nhigh 0\nmax 4\noom 2\noom_kill 1\n")
    assert read_memory_events(tmp_path) == MemoryEvents(oom=2, oom_kill=1)
    assert read_memory_events(tmp_path / "absent") is None


def test_a_real_memory_error_is_oom_and_not_retried():
    code = ("import resource\n"
            "resource.setrlimit(resource.RLIMIT_AS, (256 << 20, resource.RLIM_INFINITY))\n"
            "hoard = [bytearray(16 << 20) for _ in range(64)]\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    failure = classify_failure(out.returncode, out.stdout + out.stderr)
    assert out.returncode == 1 and "MemoryError" in out.stderr
    assert failure.kind is FailureKind.OOM and not failure.retryable


def test_injected_oom_worker_exits_with_the_oom_status_and_a_marker(tmp_path):
    store = DirectoryStore(tmp_path / "store")
    [spec, _] = specs(store.url, "o")
    env = {**os.environ, **WORKER_ENV, "ZOOID_CHAOS": "oom_worker:epoch=0:rank=0"}
    out = subprocess.run([sys.executable, "-m", "runtime.worker_main", "--spec-json", json.dumps(spec.to_dict())],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 4, out.stderr
    assert "MemoryError" in json.loads(out.stdout.strip().splitlines()[-1])["message"]
    marker = read_fault_marker(store, "o", 0, 0, 0)
    failure = classify_failure(out.returncode, out.stdout, injected=marker)
    assert (failure.kind, failure.injected, failure.retryable) == (FailureKind.OOM, True, False)
