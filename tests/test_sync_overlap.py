"""Overlapped Local-SGD rounds (`sync.overlap_steps`, `engine.overlapped_round`): a round's
collective runs behind the next round's first steps and its result is applied after them.
Against a one-process reference written here from the mathematics, through a real directory
store; the replicas end every epoch on the same tensors; the steps run while a round's
collective waits; a notice ends the wait; the train flow, the plan, the report and the job's
checks."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F

from comm.collectives import allreduce_mean
from comm.compression import Compressor
from comm.store_dir import DirectoryStore
from core.errors import ZooidValueError
from core.specs import SyncSpec
from engine.local_sgd import LocalSGD
from engine.models import build_model
from engine.optimizers import build_optimizer, optimizer_state_tensors
from engine.outer import OuterStep
from tests.epoch_data import replica_rows
from tests.test_outer_sync import (BATCH, LR, MODEL, OPT, PERIOD, SEED, WORLD, assert_states_close, load, run_engine,
                                   stage)
from coordinator.run.job import TrainJob


def delayed_reference(store, run_id, worlds, period, tau, outer="average", outer_lr=1.0, mu=0.0):
    """W replicas in one process, each round's result applied `tau` steps late (at the next sync
    at the latest): at the join, R = the outer step of θ_g by the mean of what the replicas
    posted (K-AVG: the mean; DiLoCo: Δ = θ_g − mean, m = μ m + Δ, R = θ_g − η (Δ + μ m)), and each
    replica becomes R + (its tensors − what it posted), the inner optimizer's state likewise with
    the plain mean. The epoch's last round is joined at once."""
    world = worlds[0]
    models = [build_model(MODEL, 0).double() for _ in range(world)]
    opts = [build_optimizer(OPT, m, LR) for m in models]
    from engine.checkpoint import load_checkpoint  # the reference reads the same initial checkpoint
    for m, o in zip(models, opts):
        load_checkpoint(store, f"runs/{run_id}/ckpt/init", m, o)
    theta = {n: p.detach().clone() for n, p in models[0].named_parameters()}
    momentum: dict = {}
    posted: list | None = None
    posted_at = 0

    def tensors(i):
        return {**{f"p/{n}": p.data for n, p in models[i].named_parameters()},
                **{f"s/{n}": t for n, t in optimizer_state_tensors(models[i], opts[i]).items()
                   if t.is_floating_point() and t.dim() > 0}}

    def join():
        live = [tensors(i) for i in range(world)]
        with torch.no_grad():
            for name in live[0]:
                mean = torch.stack([p[name] for p in posted]).mean(0)
                if name.startswith("p/"):
                    n = name[2:]
                    if outer == "nesterov":
                        delta = theta[n] - mean
                        momentum[n] = mu * momentum[n] + delta if n in momentum else delta.clone()
                        mean = theta[n] - outer_lr * (delta + mu * momentum[n])
                    theta[n] = mean.clone()
                for i in range(world):
                    live[i][name].copy_(mean + (live[i][name] - posted[i][name]))

    for epoch in range(len(worlds)):
        batches = replica_rows(store, run_id, world, BATCH, seed=SEED, epoch=epoch)
        steps = len(batches[0])
        for step, parts in enumerate(zip(*batches), start=1):
            for (x, y), m, o in zip(parts, models, opts):
                loss = F.cross_entropy(m(x.double()), y)
                o.zero_grad(set_to_none=True)
                loss.backward()
                o.step()
            if posted is not None and step - posted_at >= tau:
                join()
                posted = None
            if step % period == 0 or step == steps:
                if posted is not None:  # still in flight at the next sync: joined before posting
                    join()
                posted, posted_at = [{n: t.clone() for n, t in tensors(i).items()} for i in range(world)], step
                if step == steps:
                    join()
                    posted = None
    return models[0].state_dict(), optimizer_state_tensors(models[0], opts[0]), momentum


@pytest.mark.parametrize("outer, outer_lr, mu, tau", [("average", 1.0, 0.0, 1), ("nesterov", 0.7, 0.9, 1),
                                                      ("nesterov", 0.7, 0.9, 2), ("average", 1.0, 0.0, 5)])
def test_overlapped_rounds_are_the_outer_step_applied_after_the_next_rounds_first_steps(tmp_path, outer, outer_lr,
                                                                                       mu, tau):
    """7 steps an epoch in rounds of 3, joined 1 or 2 steps late, or at the next sync (5)."""
    store = DirectoryStore(tmp_path)
    worlds = stage(store, "o", WORLD, 2)
    run_engine(store, "o", worlds, PERIOD, SyncSpec(outer_optimizer=outer, outer_lr=outer_lr, outer_momentum=mu,
                                                    overlap_steps=tau, checkpoint_every=0))
    weights, state, extra, _ = load(store, "runs/o/ckpt/e1")
    ref_w, ref_s, ref_m = delayed_reference(store, "o", worlds, PERIOD, tau, outer, outer_lr, mu)
    assert_states_close(weights, ref_w, 1e-9)
    assert_states_close(state, ref_s, 1e-9)
    assert_states_close({k.removeprefix("outer/momentum/param/"): v for k, v in extra.items()}, ref_m, 1e-9)
    assert not store.exists("runs/o/ckpt/sync-e1.safetensors")  # no point mid-epoch to checkpoint
    # and it is not the synchronous run: the delay changes the trajectory
    sync_store = DirectoryStore(tmp_path / "sync")
    stage(sync_store, "s", WORLD, 2)
    run_engine(sync_store, "s", worlds, PERIOD, SyncSpec(outer_optimizer=outer, outer_lr=outer_lr, outer_momentum=mu))
    assert not torch.allclose(load(sync_store, "runs/s/ckpt/e1")[0]["0.weight"], weights["0.weight"])


def _replicas(store, world, period, sync_dtype, allreduce=allreduce_mean, overlap_steps=1):
    """`world` LocalSGD replicas of a small MLP with overlapped DiLoCo rounds on threads, each
    (through `store`); returns their models and averagers."""
    models, averagers = [], []
    for rank in range(world):
        model = build_model(MODEL, 0)
        opt = build_optimizer(OPT, model, LR)
        averagers.append(LocalSGD(model, opt, store, "g", rank, world, period, 30, allreduce=allreduce,
                                  outer=OuterStep("nesterov", 0.7, 0.3, deltas=sync_dtype != "float32"),
                                  compressor=Compressor(sync_dtype) if sync_dtype != "float32" else None,
                                  overlap_steps=overlap_steps))
        models.append((model, opt))
    return models, averagers


def _train(rank, models, averagers, steps, step_done=None):
    model, opt = models[rank]
    gen = torch.Generator().manual_seed(rank)
    for step in range(steps):
        x, y = torch.randn(8, 64, generator=gen), torch.randint(0, 10, (8,), generator=gen)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        averagers[rank].after_step()
        if step_done is not None:
            step_done(rank, step + 1)
    averagers[rank].finish()


@pytest.mark.parametrize("sync_dtype", ["float32", "int8"])
def test_the_replicas_end_on_the_same_tensors_and_count_what_they_moved(tmp_path, sync_dtype):
    models, averagers = _replicas(DirectoryStore(tmp_path), 2, 3, sync_dtype)
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda r: _train(r, models, averagers, 10), range(2)))
    for (a, oa), (b, ob) in [(models[0], models[1])]:
        assert_states_close(a.state_dict(), b.state_dict(), 0)
        assert_states_close(optimizer_state_tensors(a, oa), optimizer_state_tensors(b, ob), 0)
    for averager in averagers:
        assert averager.rounds == 4  # steps 3, 6, 9 and the last
        assert averager.stats.calls >= 4 and averager.stats.bytes_total > 0


def test_the_next_rounds_first_steps_run_while_a_rounds_collective_waits(tmp_path):
    """Round 0 (posted at step 3) is held until rank 0 has taken step 4: without overlap that
    step could not happen (the replica waits in the collective), with 2 steps of overlap it
    does, and the round's result lands after step 5."""
    held, steps_seen = threading.Event(), []

    def held_allreduce(store, prefix, rank, world, tensors, timeout, **kw):
        if prefix.endswith("/r0"):
            assert held.wait(30), "rank 0 never trained past round 0 while it was in flight"
        return allreduce_mean(store, prefix, rank, world, tensors, timeout, **kw)

    def step_done(rank, step):
        steps_seen.append((rank, step))
        if rank == 0 and step == 4:  # a step past round 0's post at step 3
            held.set()

    models, averagers = _replicas(DirectoryStore(tmp_path), 2, 3, "float32", allreduce=held_allreduce,
                                  overlap_steps=2)
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda r: _train(r, models, averagers, 9, step_done), range(2)))
    assert (0, 4) in steps_seen and averagers[0].rounds == 3
    assert_states_close(models[0][0].state_dict(), models[1][0].state_dict(), 0)


def test_overlap_refuses_gradient_averaging_and_the_ring(tmp_path):
    model = build_model(MODEL, 0)
    with pytest.raises(ZooidValueError, match="sync.overlap_steps"):
        LocalSGD(model, build_optimizer(OPT, model, LR), DirectoryStore(tmp_path), "g", 0, 2, 1, overlap_steps=1)
    with pytest.raises(ZooidValueError, match="sync.overlap_steps"):
        SyncSpec(collective="ring", overlap_steps=1)
    with pytest.raises(ZooidValueError, match="sync.overlap_steps"):
        SyncSpec(overlap_steps=-1)
    assert SyncSpec(overlap_steps=1).reruns_whole_attempt and SyncSpec(collective="ring").reruns_whole_attempt
    assert not SyncSpec().reruns_whole_attempt


@pytest.mark.parametrize("fields, line", [
    ({"sync_overlap_steps": 1, "collective": "ring"}, "sync_overlap_steps: overlapped rounds go through the store"),
    ({"sync_overlap_steps": 1, "strategy": "pipeline"}, "sync_overlap_steps: overlaps Local-SGD rounds; strategy pipeline"),
    ({"sync_overlap_steps": 2, "sync_period": 1}, "sync_overlap_steps: sync_period 1 with average and float32"),
    ({"sync_overlap_steps": -1}, "sync_overlap_steps"),
])
def test_a_job_that_cannot_overlap_is_refused_naming_the_field(fields, line):
    with pytest.raises(ValueError, match=line):
        TrainJob(**fields)
    TrainJob(sync_overlap_steps=1, sync_period=1, outer_optimizer="nesterov")  # rounds of parameters: accepted


OVERLAP_JOB = dict(workers=2, epochs=1, optimizer="momentum", lr=0.05, sync_period=4, batch_size=32,
                   strategy="local_sgd", outer_optimizer="nesterov", sync_dtype="int8", sync_overlap_steps=1)


@pytest.mark.usefixtures("prefect_api")
def test_a_worker_lost_mid_epoch_reruns_the_attempt_and_the_run_ends_as_a_clean_one(tmp_path, monkeypatch):
    """The train flow with overlapped int8 DiLoCo rounds, a clean run and one whose rank 1 is
    killed at step 6: the whole attempt is rerun (the replicas share no
    point mid-epoch), the dead attempt billed, and the weights end equal to the clean run's."""
    from comm.store import open_store
    from coordinator.bill.cost import read_ledger
    from flows.train import train
    from tests.test_chaos import _final_weights

    clean_url = f"file://{tmp_path}/clean"
    clean = train(TrainJob(store=clean_url, **OVERLAP_JOB))
    assert clean.status == "completed" and clean.epochs[0].bytes_synced > 0
    assert clean.plan["sync_overlap_steps"] == 1 and clean.plan["sync_dtype"] == "int8"  # planned as it ran
    monkeypatch.setenv("ZOOID_CHAOS", "kill_worker:epoch=0:rank=1:step=6")
    url = f"file://{tmp_path}/store"
    summary = train(TrainJob(store=url, **OVERLAP_JOB))
    assert summary.status == "completed"
    weights, clean_weights = _final_weights(url, summary.checkpoint_key), _final_weights(clean_url, clean.checkpoint_key)
    for k, v in clean_weights.items():
        torch.testing.assert_close(weights[k], v, rtol=0, atol=0)
    rows = read_ledger(open_store(url), summary.run_id)["rows"]
    dead = [r for r in rows if r["kind"] == "failed_attempt"]
    assert any(r["rank"] == 1 and r["attempt"] == 0 and r["status"] == "crashed:injected" for r in dead), dead
    assert all(r["usd"] > 0 for r in dead)
    assert not open_store(url).exists(f"runs/{summary.run_id}/ckpt/sync-e0.safetensors")


def test_the_plan_counts_only_what_a_round_takes_beyond_the_steps_it_runs_behind():
    """20 steps of 10 ms in 5 rounds of 4: blocking, each round's scatter-reduce adds to the
    epoch; overlapped by n steps, a round adds what it takes beyond n x 10 ms (n at most the
    round's 4), and the last round its whole."""
    from coordinator.report.sync_words import outer_sync_words
    from planners.strategy import plan_local_sgd
    from planners.sync_time import scatter_reduce

    kw = dict(workers=2, train_samples=640, batch_size=16, sync_period=4, step_s=0.01, bandwidth=1e8, latency=0.01,
              worker_vcpu=1.0, worker_memory_gb=2.0, worker_gpu=0, offer="x", price_per_worker_s=1e-5, checkpoint_s=0.0)
    for sync_bytes in (4e6, 1e5):  # a round longer than 4 steps, and one they hide
        reduce_s = scatter_reduce(sync_bytes, 2, 1e8, 0.01)
        blocking = plan_local_sgd(sync_bytes=sync_bytes, **kw)
        assert blocking.predicted_epoch_s == pytest.approx(0.2 + 5 * reduce_s) and blocking.sync_overlap_steps == 0
        for n, behind in ((1, 0.01), (4, 0.04), (9, 0.04)):
            overlapped = plan_local_sgd(sync_bytes=sync_bytes, overlap_steps=n, **kw)
            assert overlapped.predicted_epoch_s == pytest.approx(0.2 + 4 * max(0.0, reduce_s - behind) + reduce_s)
            assert overlapped.sync_overlap_steps == n
    one_round = plan_local_sgd(sync_bytes=4e6, overlap_steps=1, **{**kw, "sync_period": None})
    assert one_round.predicted_epoch_s == pytest.approx(0.2 + scatter_reduce(4e6, 2, 1e8, 0.01))  # nothing to hide behind
    plan = {"outer_optimizer": "average", "sync_dtype": "float32", "data_parallel": 2}
    assert outer_sync_words({**plan, "sync_overlap_steps": 1}) == \
        "outer optimizer average, syncs in float32, each behind the next round's first step"
    assert outer_sync_words({**plan, "sync_overlap_steps": 2}).endswith("first 2 steps")
    assert outer_sync_words(plan) == ""  # K-AVG in float32, waited for: the report's words as they were


def test_a_notice_while_the_training_thread_waits_for_a_round_leaves_from_the_wait(tmp_path):
    """Round 0's collective never ends (its peer is gone): after the next step the training thread
    waits for it, beating as a store wait does, and the wait guard it installed (a spot notice's
    `engine.preemption.stop_waiting`) ends the wait there."""
    from comm import heartbeat

    class Notice(Exception):
        pass

    released = threading.Event()

    def stuck_allreduce(store, prefix, rank, world, tensors, timeout, **kw):
        released.wait(30)
        raise RuntimeError("released")

    def guard():
        raise Notice

    models, averagers = _replicas(DirectoryStore(tmp_path), 2, 3, "float32", allreduce=stuck_allreduce)
    done = []
    heartbeat.set_wait_guard(guard)
    try:
        with pytest.raises(Notice):
            _train(0, models, averagers, 9, lambda rank, step: done.append(step))
    finally:
        heartbeat.set_wait_guard(None)
        released.set()
    assert done == [1, 2, 3]  # round 0 posted at step 3; the wait after step 4 left on the notice
