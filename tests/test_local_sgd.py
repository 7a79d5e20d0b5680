"""Local-SGD replicas through a real directory store: exact averaging, checkpoints, digits."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from comm.store_dir import DirectoryStore
from core.errors import ZooidValueError
from core.specs import ComputeSpec, WorkerResult, WorkerSpec
from engine.checkpoint import initial_checkpoint, load_checkpoint, save_checkpoint
from engine.datasets import publish_dataset
from engine.local_sgd import LocalSGD
from engine.local_sgd_epoch import run_local_sgd_epoch
from engine.models import build_model
from engine.optimizers import build_optimizer, optimizer_state_tensors
from runtime import worker_main
from tests.epoch_data import SMALL, replica_rows
from tests.epoch_data import steps as epoch_steps
from tests.memory_store import MemoryStore
from tests.test_collectives import run_ranks

REPO = Path(__file__).resolve().parents[1]


def run_epoch(store, world, **fields):
    """Run `world` replicas of one epoch as threads against one store; results by rank."""
    specs = [WorkerSpec(rank=r, world=world, store_url=store.url, subsets=(), **fields) for r in range(world)]
    with ThreadPoolExecutor(world) as pool:
        return list(pool.map(lambda s: run_local_sgd_epoch(s, store), specs))


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam"])
def test_replicas_synced_every_step_equal_one_process_on_the_concatenated_batch(tmp_path, optimizer):
    """Every step the replicas average their gradients (DDP's way), so each step is one
    process's step on the two batches together, for Adam too (its moments are those of
    the averaged gradient)."""
    store = DirectoryStore(tmp_path)
    publish_dataset(store, "eq", SMALL, subset_size=16)
    initial_checkpoint(store, "runs/eq/ckpt/init", "digits_mlp", optimizer, lr=0.2, seed=1)
    steps, batch = epoch_steps(store, "eq", 2, 8), 8
    assert steps == 6
    results = run_epoch(
        store, 2, run_id="eq", epoch=0, model="digits_mlp", dataset=SMALL,
        steps=steps, batch_size=batch, lr=0.2, optimizer=optimizer, sync_period=1, seed=1,
        init_key="runs/eq/ckpt/init", out_key="runs/eq/ckpt/e0", evaluate=False,
        compute=ComputeSpec(dtype="float64"),
    )
    # One process, same start, each step on the two replicas' batches concatenated.
    model = build_model("digits_mlp", 1).double()
    opt = build_optimizer(optimizer, model, 0.2)
    load_checkpoint(store, "runs/eq/ckpt/init", model, opt)
    for parts in zip(*replica_rows(store, "eq", 2, batch, seed=1)):
        x = torch.cat([px.double() for px, _ in parts])
        y = torch.cat([py for _, py in parts])
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    averaged = build_model("digits_mlp", 1).double()
    averaged_opt = build_optimizer(optimizer, averaged, 0.2)
    meta = load_checkpoint(store, "runs/eq/ckpt/e0", averaged, averaged_opt)
    assert meta["epoch"] == 0 and meta["global_step"] == steps
    for name, p in model.state_dict().items():
        assert averaged.state_dict()[name].dtype == torch.float64
        torch.testing.assert_close(averaged.state_dict()[name], p, rtol=1e-12, atol=1e-12)
    assert not torch.equal(model.state_dict()["0.weight"], build_model("digits_mlp", 1).double().state_dict()["0.weight"])
    mine, ref = optimizer_state_tensors(averaged, averaged_opt), optimizer_state_tensors(model, opt)
    assert mine.keys() == ref.keys() and (optimizer == "sgd") == (not ref)
    for name in ref:  # the replicas' momentum (and Adam's moments) are the one-process ones
        torch.testing.assert_close(mine[name], ref[name], rtol=1e-12, atol=1e-12)
    # Measured traffic: `steps` syncs, each rank moving one half-model up and one down.
    assert [r.bytes_synced > 0 for r in results] == [True, True]
    assert store.list("runs/eq/sync/") == []


def test_checkpoint_round_trip_with_adam(tmp_path):
    store = DirectoryStore(tmp_path)
    model = build_model("digits_cnn", 2)
    opt = build_optimizer("adam", model, 0.01)
    F.cross_entropy(model(torch.rand(4, 64)), torch.tensor([0, 1, 2, 3])).backward()
    opt.step()
    nbytes = save_checkpoint(store, "runs/c/ckpt", model, opt, {"epoch": 3, "note": "x"})
    assert nbytes == len(store.get("runs/c/ckpt"))
    other = build_model("digits_cnn", 9)
    other_opt = build_optimizer("adam", other, 0.01)
    assert load_checkpoint(store, "runs/c/ckpt", other, other_opt) == {"epoch": 3, "note": "x"}
    for k, v in model.state_dict().items():
        assert torch.equal(other.state_dict()[k], v)
    a, b = optimizer_state_tensors(model, opt), optimizer_state_tensors(other, other_opt)
    assert a.keys() == b.keys() and len(a) == 3 * len(list(model.parameters()))
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ZooidValueError, match="checkpoint"):
        load_checkpoint(store, "runs/c/ckpt", build_model("digits_mlp", 0))


def test_four_workers_learn_digits(tmp_path):
    store, world, batch = DirectoryStore(tmp_path), 4, 16
    manifest = publish_dataset(store, "d4", "digits", subset_size=32)
    initial_checkpoint(store, "runs/d4/ckpt/init", "digits_mlp", "momentum", lr=0.05, seed=0)
    steps = epoch_steps(store, "d4", world, batch)
    init, accuracies = "runs/d4/ckpt/init", []
    for epoch in range(4):
        results = run_epoch(
            store, world, run_id="d4", epoch=epoch, model="digits_mlp", dataset="digits", steps=steps,
            batch_size=batch, lr=0.05, optimizer="momentum", sync_period=None,
            init_key=init, out_key=f"runs/d4/ckpt/e{epoch}",
        )
        init = results[0].checkpoint_key
        accuracies.append(results[0].val_accuracy)
        assert all(r.val_accuracy is None for r in results[1:])
        # every sample once per epoch: 1437 = 4 replicas x 22 batches of 16, and a last step of 29 (8, 7, 7, 7)
        assert steps == 23 and manifest.n_train == 1437
        assert [r.samples for r in results] == [360, 359, 359, 359] and all(r.compute_s > 0 for r in results)
        # iteration_s is the median of the steps - 2 steady gaps (engine.iteration_clock): at least
        # half of them are that long, and all of them lie inside the worker's wall time. (The median
        # times every gap need not: four threads time-sliced on two cores make the gaps uneven.)
        half = math.ceil((steps - 2) / 2)
        assert all(0 < r.iteration_s * half < r.stopped_at - r.started_at for r in results), \
            [(r.iteration_s, r.stopped_at - r.started_at) for r in results]
    assert accuracies[-1] >= 0.9, accuracies
    assert store.list("runs/d4/sync/") == []


def test_worker_main_prints_the_result_json(tmp_path):
    store = DirectoryStore(tmp_path)
    publish_dataset(store, "wm", SMALL, subset_size=32)
    initial_checkpoint(store, "runs/wm/ckpt/init", "digits_mlp", "sgd", lr=0.1)
    spec = WorkerSpec(run_id="wm", epoch=0, rank=0, world=1, store_url=store.url, model="digits_mlp",
                      dataset=SMALL, subsets=(), steps=3, batch_size=32, lr=0.1,
                      init_key="runs/wm/ckpt/init", out_key="runs/wm/ckpt/e0")
    out = subprocess.run([sys.executable, "-m", "runtime.worker_main", "--spec-json", json.dumps(spec.to_dict())],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    result = WorkerResult.from_dict(json.loads(out.stdout.strip().splitlines()[-1]))
    assert (result.samples, result.bytes_synced, result.checkpoint_key) == (96, 0, "runs/wm/ckpt/e0")
    assert 0 < result.val_accuracy <= 1 and result.stopped_at > result.started_at



def test_worker_main_reports_bad_input_as_json(tmp_path, capsys):
    bad = {"run_id": "x", "epoch": 0, "rank": 0, "world": 1, "store_url": tmp_path.as_uri(),
           "model": "os:system", "dataset": "digits", "subsets": [0], "steps": 1, "batch_size": 1,
           "lr": 0.1, "init_key": "runs/x/i", "out_key": "runs/x/o"}
    assert worker_main.main(["--spec-json", json.dumps(bad)]) == 2
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["error"] == "ZooidValueError" and last["message"].startswith("model:")


def test_local_sgd_leaves_replicas_and_adam_moments_equal():
    store, world = MemoryStore(), 2

    def replica(rank):
        model = build_model("digits_mlp", 0)
        opt = build_optimizer("adam", model, 0.01)
        averaging = LocalSGD(model, opt, store, "runs/a/sync/e0", rank, world, period=3, timeout=10)
        g = torch.Generator().manual_seed(rank)
        for _ in range(5):  # one sync after step 3, one more at finish for steps 4-5
            opt.zero_grad()
            F.cross_entropy(model(torch.rand(8, 64, generator=g)), torch.randint(10, (8,), generator=g)).backward()
            opt.step()
            averaging.after_step()
        averaging.finish()
        return model, optimizer_state_tensors(model, opt), averaging.rounds

    (m0, s0, r0), (m1, s1, r1) = run_ranks(world, replica)
    assert (r0, r1) == (2, 2)
    assert all(torch.equal(a, b) for a, b in zip(m0.state_dict().values(), m1.state_dict().values()))
    assert s0.keys() == s1.keys() and all(torch.equal(s0[k], s1[k]) for k in s0)
    assert {float(v) for k, v in s0.items() if k.endswith(".step")} == {5.0}
    assert store.list("runs/") == []
