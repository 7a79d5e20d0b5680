"""Overlapped Local-SGD rounds (`sync.overlap`, `engine.overlapped_round`): a round's collective
runs behind the next round's steps and its result is applied one round late. Against a
one-process reference written here from the mathematics, through a real directory store; the
replicas end every epoch on the same tensors; the steps run while a round's collective waits."""
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


def delayed_reference(store, run_id, worlds, period, outer="average", outer_lr=1.0, mu=0.0):
    """W replicas in one process, each round's result applied one round late: at a sync, the
    round posted before is joined, R = the outer step of θ_g by the mean of what the replicas
    posted (K-AVG: the mean; DiLoCo: Δ = θ_g − mean, m = μ m + Δ, R = θ_g − η (Δ + μ m)), and each
    replica becomes R + (its tensors − what it posted), the inner optimizer's state likewise with
    the plain mean; then this round is posted. The epoch's last round is joined at once."""
    world = worlds[0]
    models = [build_model(MODEL, 0).double() for _ in range(world)]
    opts = [build_optimizer(OPT, m, LR) for m in models]
    from engine.checkpoint import load_checkpoint  # the reference reads the same initial checkpoint
    for m, o in zip(models, opts):
        load_checkpoint(store, f"runs/{run_id}/ckpt/init", m, o)
    theta = {n: p.detach().clone() for n, p in models[0].named_parameters()}
    momentum: dict = {}
    posted: list | None = None

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
            if step % period == 0 or step == steps:
                if posted is not None:
                    join()
                posted = [{n: t.clone() for n, t in tensors(i).items()} for i in range(world)]
                if step == steps:
                    join()
                    posted = None
    return models[0].state_dict(), optimizer_state_tensors(models[0], opts[0]), momentum


@pytest.mark.parametrize("outer, outer_lr, mu", [("average", 1.0, 0.0), ("nesterov", 0.7, 0.9)])
def test_overlapped_rounds_are_the_outer_step_applied_one_round_late(tmp_path, outer, outer_lr, mu):
    store = DirectoryStore(tmp_path)
    worlds = stage(store, "o", WORLD, 2)
    run_engine(store, "o", worlds, PERIOD, SyncSpec(outer_optimizer=outer, outer_lr=outer_lr, outer_momentum=mu,
                                                    overlap=True, checkpoint_every=0))
    weights, state, extra, _ = load(store, "runs/o/ckpt/e1")
    ref_w, ref_s, ref_m = delayed_reference(store, "o", worlds, PERIOD, outer, outer_lr, mu)
    assert_states_close(weights, ref_w, 1e-9)
    assert_states_close(state, ref_s, 1e-9)
    assert_states_close({k.removeprefix("outer/momentum/param/"): v for k, v in extra.items()}, ref_m, 1e-9)
    assert not store.exists("runs/o/ckpt/sync-e1.safetensors")  # no point mid-epoch to checkpoint
    # and it is not the synchronous run: the delay changes the trajectory
    sync_store = DirectoryStore(tmp_path / "sync")
    stage(sync_store, "s", WORLD, 2)
    run_engine(sync_store, "s", worlds, PERIOD, SyncSpec(outer_optimizer=outer, outer_lr=outer_lr, outer_momentum=mu))
    assert not torch.allclose(load(sync_store, "runs/s/ckpt/e1")[0]["0.weight"], weights["0.weight"])


def _replicas(store, world, period, sync_dtype, allreduce=allreduce_mean):
    """`world` LocalSGD replicas of a small MLP with overlapped DiLoCo rounds on threads, each
    (through `store`); returns their models and averagers."""
    models, averagers = [], []
    for rank in range(world):
        model = build_model(MODEL, 0)
        opt = build_optimizer(OPT, model, LR)
        averagers.append(LocalSGD(model, opt, store, "g", rank, world, period, 30, allreduce=allreduce,
                                  outer=OuterStep("nesterov", 0.7, 0.3, deltas=sync_dtype != "float32"),
                                  compressor=Compressor(sync_dtype) if sync_dtype != "float32" else None,
                                  overlap=True))
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


def test_the_next_rounds_steps_run_while_a_rounds_collective_waits(tmp_path):
    """Round 0's collective is held until rank 0 has taken two more steps: without overlap the
    steps could not happen (the replica waits in the collective), with it they do, and the
    round's result still lands at the next sync."""
    held, steps_seen = threading.Event(), []

    def held_allreduce(store, prefix, rank, world, tensors, timeout, **kw):
        if prefix.endswith("/r0"):
            assert held.wait(30), "rank 0 never trained past round 0 while it was in flight"
        return allreduce_mean(store, prefix, rank, world, tensors, timeout, **kw)

    def step_done(rank, step):
        steps_seen.append((rank, step))
        if rank == 0 and step == 5:  # two steps past round 0's post at step 3
            held.set()

    models, averagers = _replicas(DirectoryStore(tmp_path), 2, 3, "float32", allreduce=held_allreduce)
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda r: _train(r, models, averagers, 9, step_done), range(2)))
    assert (0, 5) in steps_seen and averagers[0].rounds == 3
    assert_states_close(models[0][0].state_dict(), models[1][0].state_dict(), 0)


def test_overlap_refuses_gradient_averaging_and_the_ring(tmp_path):
    model = build_model(MODEL, 0)
    with pytest.raises(ZooidValueError, match="sync.overlap"):
        LocalSGD(model, build_optimizer(OPT, model, LR), DirectoryStore(tmp_path), "g", 0, 2, 1, overlap=True)
    with pytest.raises(ZooidValueError, match="sync.overlap"):
        SyncSpec(collective="ring", overlap=True)
    assert SyncSpec(overlap=True).reruns_whole_attempt and SyncSpec(collective="ring").reruns_whole_attempt
    assert not SyncSpec().reruns_whole_attempt


@pytest.mark.parametrize("fields, line", [
    ({"sync_overlap": True, "collective": "ring"}, "sync_overlap: overlapped rounds go through the store"),
    ({"sync_overlap": True, "strategy": "pipeline"}, "sync_overlap: overlaps Local-SGD rounds; strategy pipeline"),
    ({"sync_overlap": True, "sync_period": 1}, "sync_overlap: sync_period 1 with average and float32"),
])
def test_a_job_that_cannot_overlap_is_refused_naming_the_field(fields, line):
    with pytest.raises(ValueError, match=line):
        TrainJob(**fields)
    TrainJob(sync_overlap=True, sync_period=1, outer_optimizer="nesterov")  # rounds of parameters: accepted


OVERLAP_JOB = dict(workers=2, epochs=1, optimizer="momentum", lr=0.05, sync_period=4, batch_size=32,
                   strategy="local_sgd", outer_optimizer="nesterov", sync_dtype="int8", sync_overlap=True)


@pytest.mark.usefixtures("prefect_api")
def test_a_worker_lost_mid_epoch_reruns_the_attempt_and_the_run_ends_as_a_clean_one(tmp_path, monkeypatch):
    """The train flow with overlapped int8 DiLoCo rounds, a clean run and one whose rank 1 is
    killed at step 6 (round 0 in flight): the whole attempt is rerun (the replicas share no
    point mid-epoch), the dead attempt billed, and the weights end equal to the clean run's."""
    from comm.store import open_store
    from coordinator.bill.cost import read_ledger
    from flows.train import train
    from tests.test_chaos import _final_weights

    clean_url = f"file://{tmp_path}/clean"
    clean = train(TrainJob(store=clean_url, **OVERLAP_JOB))
    assert clean.status == "completed" and clean.epochs[0].bytes_synced > 0
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
