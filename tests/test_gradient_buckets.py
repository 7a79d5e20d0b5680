"""Every-step syncs average gradients in buckets while backward runs (`engine.gradient_buckets`):
the same weights as averaging parameters under plain and momentum SGD, over the store
collectives and the ring; buckets really start before backward ends; a replica relaunched
inside a bucketed round, and a ring epoch rerun from its sync checkpoint, end equal to the
uninterrupted run. Replicas run as threads of this process, in float64."""
from __future__ import annotations

import copy
import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F

import engine.local_sgd_epoch as local_sgd_epoch
from comm.bandwidth import TransferStats
from comm.bucket_allreduce import RingBuckets, StoreBuckets
from comm.collectives import allreduce_mean
from comm.ring_allreduce import RingError, open_ring
from comm.store_dir import DirectoryStore
from core.errors import ZooidValueError
from core.keys import sync_prefix
from core.schedules import Kind
from core.specs import ComputeSpec, SyncSpec, WorkerSpec
from engine.chaos import Chaos
from engine.checkpoint import initial_checkpoint, load_checkpoint
from engine.datasets import ShardSource, publish_dataset
from engine.gradient_buckets import GradientBuckets, plan_buckets
from engine.local_sgd import LocalSGD
from engine.local_sgd_epoch import read_epoch_history, run_local_sgd_epoch
from engine.models import build_model
from engine.optimizers import build_optimizer, optimizer_state_tensors
from engine.pipeline_executor import iteration_schedule, pipeline_worker_specs
from engine.pipeline_stage_worker import StageWorker
from tests.epoch_data import replica_rows
from tests.memory_store import Died, DyingStore, MemoryStore

STEPS, BATCH, LR = 6, 8, 0.2
SMALL_BUCKETS = SyncSpec(bucket_mb=1000 / 2**20)  # 1000 bytes: digits_mlp in float64 is 4 buckets
DATA = "synthetic:64:10:96:32"
"""An epoch of STEPS steps for 2 replicas of BATCH rows."""


def test_buckets_are_cut_in_reverse_registration_order_under_the_cap():
    sizes = [("a", 400), ("b", 100), ("c", 600), ("d", 50), ("e", 2000)]
    assert plan_buckets(sizes, 1000) == [["e"], ["d", "c", "b"], ["a"]]
    assert plan_buckets(sizes, 10**9) == [["e", "d", "c", "b", "a"]]
    with pytest.raises(ZooidValueError, match="^sync.bucket_mb"):
        plan_buckets(sizes, 0)
    with pytest.raises(ZooidValueError, match="^sync.every_step"):
        SyncSpec(every_step="weights")


def stage(store, run_id: str, optimizer: str) -> None:
    publish_dataset(store, run_id, DATA, subset_size=16)
    initial_checkpoint(store, f"runs/{run_id}/ckpt/init", "digits_mlp", optimizer, lr=LR, seed=1)


def specs(store, run_id: str, optimizer: str, sync: SyncSpec, **fields) -> list[WorkerSpec]:
    return [WorkerSpec(run_id=run_id, epoch=0, rank=r, world=2, store_url=store.url, model="digits_mlp",
                       dataset=DATA, steps=STEPS, batch_size=BATCH, lr=LR,
                       optimizer=optimizer, sync_period=1, seed=1, init_key=f"runs/{run_id}/ckpt/init",
                       out_key=f"runs/{run_id}/ckpt/e0", evaluate=False, sync_timeout_s=30.0,
                       compute=ComputeSpec(dtype="float64"), sync=sync, **fields) for r in range(2)]


def run_threads(store, worker_specs, stores=None):
    """Run the replicas as threads against `store` (or each against its own of `stores`)."""
    stores = stores or [store] * len(worker_specs)
    with ThreadPoolExecutor(len(worker_specs)) as pool:
        return list(pool.map(run_local_sgd_epoch, worker_specs, stores))


def final_state(store, run_id: str, optimizer: str):
    model = build_model("digits_mlp", 0).double()
    opt = build_optimizer(optimizer, model, LR)
    load_checkpoint(store, f"runs/{run_id}/ckpt/e0", model, opt)
    return model.state_dict(), optimizer_state_tensors(model, opt)


def assert_same_state(a, b, tol: float) -> None:
    for got, want in zip(a, b):
        assert got.keys() == want.keys()
        for name in want:
            assert got[name].dtype == torch.float64
            torch.testing.assert_close(got[name], want[name], rtol=tol, atol=tol)


@pytest.mark.parametrize("collective", ["plain", "pipelined", "ring"])
@pytest.mark.parametrize("optimizer", ["sgd", "momentum"])
def test_every_step_gradient_averaging_equals_parameter_averaging(tmp_path, collective, optimizer):
    store = DirectoryStore(tmp_path)
    results = {}
    for mode in ("gradients", "parameters"):
        stage(store, mode, optimizer)
        sync = dataclasses.replace(SMALL_BUCKETS, collective=collective, every_step=mode)
        results[mode] = run_threads(store, specs(store, mode, optimizer, sync))
    grads, params = final_state(store, "gradients", optimizer), final_state(store, "parameters", optimizer)
    assert_same_state(grads, params, 1e-9)
    assert bool(grads[1]) == (optimizer == "momentum")  # momentum buffers equal, never sent
    start = build_model("digits_mlp", 1).double().state_dict()
    assert not torch.equal(grads[0]["0.weight"], start["0.weight"])  # it trained
    # Truthful traffic: 4 buckets a step, gradients only (parameter averaging adds the momentum).
    model_bytes = sum(t.numel() * 8 for t in start.values())
    for g, p in zip(results["gradients"], results["parameters"]):
        assert g.sync_s > 0 and g.compute_s > 0
        assert STEPS * 2 * model_bytes <= g.bytes_synced < 1.1 * STEPS * 2 * model_bytes
        if optimizer == "momentum":
            assert g.bytes_synced < 0.6 * p.bytes_synced
    assert store.list("runs/gradients/sync/") == []


def adam_on_averaged_gradients(store, run_id: str):
    """The reference: one process, one model from the run's initial checkpoint and one
    `torch.optim.Adam`, stepping each step on the mean of the two replicas' gradients (each
    replica's batch from the same sampler as the engine's); its weights and optimizer state."""
    model = build_model("digits_mlp", 0).double()
    opt = build_optimizer("adam", model, LR)
    load_checkpoint(store, f"runs/{run_id}/ckpt/init", model, opt)
    assert isinstance(opt, torch.optim.Adam)
    batches = replica_rows(store, run_id, 2, BATCH, seed=1)
    assert len(batches[0]) == STEPS
    for parts in zip(*batches):
        grads = []
        for x, y in parts:
            model.zero_grad(set_to_none=True)
            F.cross_entropy(model(x.double()), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, *gs in zip(model.parameters(), *grads):
            p.grad = torch.stack(gs).mean(0)
        opt.step()
    return model.state_dict(), optimizer_state_tensors(model, opt)


def test_adam_takes_the_moments_of_the_averaged_gradient(tmp_path):
    """DDP's semantics: the checkpoint holds what `torch.optim.Adam` in one process reaches,
    stepping on the mean of the two replicas' gradients (weights, both moments and the step
    count); averaging parameters instead keeps the mean of the replicas' moments, which differs."""
    store = DirectoryStore(tmp_path)
    for mode in ("gradients", "parameters"):
        stage(store, mode, "adam")
        run_threads(store, specs(store, mode, "adam", dataclasses.replace(SMALL_BUCKETS, every_step=mode)))
    grads, params = final_state(store, "gradients", "adam"), final_state(store, "parameters", "adam")
    reference = adam_on_averaged_gradients(store, "gradients")
    assert {k.rpartition(".")[2] for k in reference[1]} == {"step", "exp_avg", "exp_avg_sq"}
    steps = {k: v for k, v in grads[1].items() if k.endswith(".step")}
    assert steps.keys() == {k for k in reference[1] if k.endswith(".step")}
    assert all(v.item() == STEPS == reference[1][k].item() for k, v in steps.items())
    tensors = {k: v for k, v in grads[1].items() if k not in steps}
    assert_same_state((grads[0], tensors), (reference[0], {k: reference[1][k] for k in tensors}), 1e-12)
    moments = [k for k in grads[1] if k.endswith("exp_avg_sq")]
    assert moments and not all(torch.allclose(grads[1][k], params[1][k], rtol=1e-9) for k in moments)


class Recorder:
    """A bucket collective that records when each bucket's call begins and ends."""

    def __init__(self, inner):
        self.inner, self.started, self.done = inner, [], threading.Event()

    def start(self, round_, bucket, tensors, stats, last=False):
        self.started.append(bucket)
        pending = Once(self.inner.start(round_, bucket, tensors, stats, last=last))
        if bucket == 0:
            # Waited on in a thread of its own: the bucket completes while backward is held.
            threading.Thread(target=lambda: (pending.wait(), self.done.set()), daemon=True).start()
        return pending


class Once:
    """The result of a call whose wait another thread may have done first."""

    def __init__(self, pending):
        self.pending, self.lock, self.result = pending, threading.Lock(), None

    def wait(self):
        with self.lock:
            if self.result is None:
                self.result = self.pending.wait()
            return self.result


@pytest.mark.parametrize("collective", ["store", "ring"])
def test_the_first_bucket_is_averaged_before_backward_reaches_the_first_layer(collective):
    """Ordered by events: a hook on the gradient of the first layer's weight (the last one
    backward computes), which runs before that gradient is accumulated, waits until bucket
    0's allreduce has completed, so the call ran while backward was still going; then
    `finish` gives each replica the mean of both gradients."""
    store, world = MemoryStore(), 2
    grads: dict[int, dict[str, torch.Tensor]] = {}

    def replica(rank):
        torch.manual_seed(0)
        model = build_model("digits_mlp", 0).double()
        ring = open_ring(store, "runs/t/sync/e0", rank, world, 30) if collective == "ring" else None
        inner = RingBuckets(ring) if ring else StoreBuckets(allreduce_mean, store, "runs/t/sync/e0", rank, world, 30)
        recorder = Recorder(inner)
        buckets = GradientBuckets(dict(model.named_parameters()), recorder, stats=TransferStats(), bucket_bytes=1000)
        seen_at_last_grad = []

        def last_grad(_):
            seen_at_last_grad.append((list(recorder.started), recorder.done.wait(30), model[0].weight.grad is None))

        model[0].weight.register_hook(last_grad)
        buckets.arm(0)
        g = torch.Generator().manual_seed(rank)
        F.cross_entropy(model(torch.rand(8, 64, generator=g, dtype=torch.float64)),
                        torch.randint(10, (8,), generator=g)).backward()
        grads[rank] = {n: p.grad.clone() for n, p in model.named_parameters()}
        buckets.finish()
        buckets.remove()
        if ring:
            ring.close()
        return {n: p.grad for n, p in model.named_parameters()}, seen_at_last_grad, buckets.buckets

    with ThreadPoolExecutor(world) as pool:
        outs = list(pool.map(replica, range(world)))
    for averaged, seen, plan in outs:
        assert plan == [["2.bias"], ["2.weight"], ["0.bias"], ["0.weight"]]
        # Buckets 0-2 had started, and bucket 0 had come back, before the last gradient was accumulated.
        assert seen == [([0, 1, 2], True, True)]
        for name, g in averaged.items():
            torch.testing.assert_close(g, (grads[0][name] + grads[1][name]) / 2, rtol=1e-15, atol=1e-15)


@pytest.mark.parametrize("cadence, resumes_at", [("every round", 3), ("never by the clock", 0),
                                                 ("every 2 rounds by the bytes kept", 2)])
def test_a_replica_that_dies_inside_a_bucketed_round_is_relaunched_and_ends_equal(tmp_path, monkeypatch,
                                                                                   cadence, resumes_at):
    """Rank 1 dies as it posts its reduced slice of bucket 1 in round 3 (other buckets of that
    round may be done); its relaunch resumes from the last sync checkpoint and replays every
    round since, bucket by bucket, with the survivor still waiting inside round 3. The
    checkpoints: every round (`checkpoint_s` 0), or by the clock (which here never reaches
    `checkpoint_s`: only the last round's, so the relaunch starts from the epoch's start), or
    when the rounds kept for replay reach `REPLAY_KEPT_BYTES` (here two rounds' worth)."""
    sync = dataclasses.replace(SMALL_BUCKETS, repost_s=0.5, checkpoint_s=0.0 if cadence == "every round" else 1.0)
    monkeypatch.setattr(local_sgd_epoch, "checkpoint_clock", lambda: 0.0)  # no second ever passes
    if cadence.startswith("every 2 rounds"):
        round_bytes = sum(p.numel() * 8 for p in build_model("digits_mlp", 0).parameters())
        monkeypatch.setattr(local_sgd_epoch, "REPLAY_KEPT_BYTES", 2 * round_bytes)
    reference = DirectoryStore(tmp_path / "ref")
    stage(reference, "g", "momentum")
    run_threads(reference, specs(reference, "g", "momentum", SMALL_BUCKETS))

    store = MemoryStore()
    stage(store, "g", "momentum")
    rank_1_dies_and_is_relaunched(store, specs(store, "g", "momentum", sync),
                                  lambda key: key.endswith("/sync/e0/r3/b1/mean-1"))
    assert_same_state(final_state(store, "g", "momentum"), final_state(reference, "g", "momentum"), 1e-12)
    relaunch = next(h for h in read_epoch_history(store, "g", 0) if h["attempt"] == 1)
    assert (relaunch["start_step"], relaunch["start_round"], relaunch["end_round"]) == (resumes_at, resumes_at, STEPS)
    assert store.list("runs/g/sync/") == []


def rank_1_dies_and_is_relaunched(store, worker_specs, dies_at) -> None:
    """Run a 2-replica epoch whose rank 1 dies as it puts the first key `dies_at(key)` names
    (a killed process does nothing more) and is relaunched at once (attempt 1)."""
    dead = threading.Event()

    def when(op, key):
        if op == "put" and dies_at(key):
            dead.set()
        return dead.is_set()

    def rank(r):
        if r == 0:
            return run_local_sgd_epoch(worker_specs[0], store)
        with pytest.raises(Died):
            run_local_sgd_epoch(worker_specs[1], DyingStore(store, when))
        return run_local_sgd_epoch(dataclasses.replace(worker_specs[1], attempt=1), store)

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(rank, range(2)))


class FailBeforeStep(Chaos):
    """Rank 1 of attempt 0 raises before step 4, as a worker crashing mid-epoch."""

    def before_step(self, step: int) -> None:
        if (self.spec.rank, self.spec.attempt, step) == (1, 0, 4):
            raise Died("rank 1 crashed")


def test_a_ring_epoch_that_fails_reruns_every_rank_from_the_sync_checkpoint(tmp_path, monkeypatch):
    reference = DirectoryStore(tmp_path / "ref")
    stage(reference, "g", "momentum")
    # a sync checkpoint every round, so the rerun resumes from the step before the failure
    ring = dataclasses.replace(SMALL_BUCKETS, collective="ring", ring_timeout_s=20.0, checkpoint_s=0.0)
    run_threads(reference, specs(reference, "g", "momentum", ring))

    store = DirectoryStore(tmp_path / "store")
    stage(store, "g", "momentum")
    monkeypatch.setattr(local_sgd_epoch, "chaos_for", lambda spec, s: FailBeforeStep(spec, s, []))
    worker_specs = specs(store, "g", "momentum", ring)
    with ThreadPoolExecutor(2) as pool:
        failures = list(pool.map(lambda s: _error_of(run_local_sgd_epoch, s, store), worker_specs))
    assert isinstance(failures[1], Died) and isinstance(failures[0], RingError)
    store.delete_prefix(sync_prefix("g", 0) + "/")  # the coordinator, before the rerun
    run_threads(store, [dataclasses.replace(s, attempt=1) for s in worker_specs])
    assert_same_state(final_state(store, "g", "momentum"), final_state(reference, "g", "momentum"), 1e-12)
    reruns = [h for h in read_epoch_history(store, "g", 0) if h["attempt"] == 1]
    assert [(h["start_step"], h["from_sync_checkpoint"]) for h in reruns] == [(4, True), (4, True)]


def _error_of(fn, *args):
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - the test looks at which one
        return exc
    return None


def test_a_hybrid_stage_arms_its_buckets_before_its_last_backward_only():
    """Earlier micro-batches' backwards only accumulate; the last one's gradients are the
    iteration's, so a hybrid stage starts its buckets during that backward."""
    base = WorkerSpec(run_id="p", epoch=0, rank=0, world=2, store_url="memory://", model="digits_mlp",
                      dataset="digits", steps=1, batch_size=8, lr=LR, sync_period=1)
    for spec in pipeline_worker_specs(base, cuts=[1], microbatches=4, replicas=2,
                                      schedule="1f1b")[:2]:
        actions = iteration_schedule(spec.stage)
        store = MemoryStore()
        worker = StageWorker(spec, store, actions, ShardSource(store, ""))  # reads no data here
        try:
            backwards = [i for i, a in enumerate(actions) if a.kind is Kind.B]
            assert len(backwards) == 4 and worker.arm_at == {backwards[-1]: spec.stage.index}
        finally:
            worker.close()


def test_batch_norm_statistics_ride_in_the_first_bucket_and_match_parameter_averaging():
    """Running statistics are not gradients: each step they travel in bucket 0 and are replaced
    by their mean, as averaging parameters does, so every replica holds the same ones."""
    torch.manual_seed(0)
    start = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 10)).double()
    states = {}
    for gradients in (True, False):
        store = MemoryStore()

        def replica(rank):
            model = copy.deepcopy(start)  # replicas start equal
            opt = build_optimizer("momentum", model, LR)
            averaging = LocalSGD(model, opt, store, "runs/bn/sync/e0", rank, 2, period=1, timeout=30,
                                 average_gradients=gradients, bucket_bytes=1000)
            g = torch.Generator().manual_seed(rank)
            for _ in range(3):
                opt.zero_grad()
                F.cross_entropy(model(torch.rand(8, 64, generator=g, dtype=torch.float64)),
                                torch.randint(10, (8,), generator=g)).backward()
                opt.step()
                averaging.after_step()
            averaging.finish()
            return model.state_dict()

        with ThreadPoolExecutor(2) as pool:
            states[gradients] = list(pool.map(replica, range(2)))
        assert store.list("runs/") == []
    reference = states[True][0]
    for state in states[True][1], states[False][0]:  # the other replica; parameter averaging
        assert state.keys() == reference.keys()
        for name, want in reference.items():
            torch.testing.assert_close(state[name], want, rtol=1e-12, atol=1e-12)
    assert not torch.equal(states[True][0]["1.running_mean"], torch.zeros(32, dtype=torch.float64))
