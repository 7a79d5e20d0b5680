"""Issue 24, item 3: an impossible job is refused before anything is paid for.

The model is checked against the dataset on the coordinator without computing (built on
`meta`, one row on the CPU); a profiling worker that fails for a reason no retry fixes is not
replaced; a dry run says what it will rent and what that costs, and with `rent=false` rents
nothing and plans from a cached profile or, with none, from the catalog's figures."""
from __future__ import annotations

import json
import sys

import pytest
import torch
from torch import nn

from coordinator.run.job import TrainJob
from core.errors import ZooidValueError

# --- models given by import path in these tests ----------------------------------------------


def needs_real_weights() -> nn.Module:
    """Reads a weight while it is built: cannot be built on the `meta` device."""
    net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    assert float(net[0].weight.detach().abs().sum()) > 0
    return net


def scores_three() -> nn.Module:
    """Takes digits, but scores only 3 classes."""
    return nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 3))


BATCH_OF_ONE = '''
from torch import nn


class BatchOfOne(nn.Module):
    """Folds every row into one: takes a single row (what validation gives it), fails on a batch."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        return self.head(x.reshape(1, -1))


def net():
    return BatchOfOne()
'''


def _sample(dataset: str) -> tuple[torch.Tensor, int]:
    from engine.datasets import load_dataset

    data = load_dataset(dataset)
    return data.train_x[:1], int(max(data.train_y.max(), data.val_y.max())) + 1


# --- the shape check, unit ------------------------------------------------------------------


@pytest.mark.parametrize("model,dataset", [("digits_mlp", "digits"), ("digits_cnn", "digits"),
                                           ("resnet18", "synthetic:3x32x32:10:8:4"),
                                           ("vgg11", "synthetic:3x32x32:10:8:4"),
                                           ("resnet18", "synthetic:3x64x64:10:8:4"),
                                           ("tests.user_models:tiny_mlp", "digits"),
                                           ("tests.test_refuse_before_paying:needs_real_weights", "digits")])
def test_registry_and_factory_models_fit_their_datasets(model, dataset):
    from engine.models import model_fit

    sample, classes = _sample(dataset)
    problem, expected = model_fit(model, sample, classes)
    assert problem is None
    assert expected in ("64", "3xHxW")


@pytest.mark.parametrize("model,dataset,says", [
    ("digits_mlp", "synthetic:3x32:10:8:4", "shapes cannot be multiplied"),
    ("digits_cnn", "synthetic:3x32x32:10:8:4", "unflatten"),
    ("resnet18", "digits", "conv2d"),
    ("vgg11", "synthetic:3x64x64:10:8:4", "shapes cannot be multiplied"),  # its head is sized for 32x32
    ("digits_mlp", "synthetic:64:20:8:4", "scores 10 classes, the dataset has 20"),
    ("tests.user_models:tiny_mlp", "synthetic:3x32x32:10:8:4", "shapes cannot be multiplied"),
    ("tests.test_refuse_before_paying:scores_three", "digits", "scores 3 classes, the dataset has 10"),
    ("tests.test_refuse_before_paying:needs_real_weights", "synthetic:32:10:8:4", "shapes cannot be multiplied"),
])
def test_a_model_that_does_not_take_the_data_is_found_without_training(model, dataset, says):
    from engine.models import model_fit

    sample, classes = _sample(dataset)
    problem, _ = model_fit(model, sample, classes)
    assert problem is not None and says in problem and "\n" not in problem


def test_the_registry_models_that_fit_are_named():
    from engine.models import models_that_fit

    assert models_that_fit(*_sample("digits")) == ["digits_mlp", "digits_cnn"]
    assert models_that_fit(*_sample("synthetic:3x32x32:10:8:4")) == ["resnet18", "vgg11"]
    assert models_that_fit(*_sample("synthetic:3x32:10:8:4")) == []


def test_a_large_sample_is_checked_on_meta_without_arithmetic():
    from engine.models import META_ABOVE_ELEMENTS, model_fit

    sample, classes = _sample("synthetic:3x224x224:10:2:2")
    assert sample[0].numel() > META_ABOVE_ELEMENTS
    assert model_fit("resnet18", sample, classes)[0] is None
    assert "same reduction dim" in model_fit("vgg11", sample, classes)[0]  # its head wants 32x32 images


@pytest.mark.parametrize("params,names", [
    ({"dataset": "synthetic:3x32:10"}, ("digits_mlp", "3x32", "takes 64", "models that fit synthetic:3x32:10: none")),
    ({"model": "resnet18"}, ("resnet18", "dataset digits", "a sample is 64", "takes 3xHxW",
                             "models that fit digits: digits_mlp, digits_cnn")),
    ({"model": "digits_cnn", "dataset": "synthetic:64:20"}, ("scores 10 classes, the dataset has 20",
                                                              "models that fit synthetic:64:20: none")),
    ({"model": "tests.user_models:tiny_mlp", "dataset": "synthetic:3x32x32:10"},
     ("a sample is 3x32x32", "models that fit synthetic:3x32x32:10: resnet18, vgg11")),
])
def test_validation_refuses_the_pair_in_one_line_naming_both(params, names, tmp_path):
    from coordinator.run.validate import validate_job

    with pytest.raises(ZooidValueError) as err:
        validate_job(TrainJob(store=f"file://{tmp_path}/store", **params))
    message = str(err.value)
    assert message.startswith("model: ") and "dataset" in message and "\n" not in message
    for name in names:
        assert name in message, message
    assert not (tmp_path / "store").exists() or not (tmp_path / "store" / "runs").exists()


def test_the_check_reads_one_row_and_trains_nothing_on_digits(monkeypatch):
    """What keeps the check cheap, asserted instead of timed: every module call it makes sees
    one row (on the CPU or on `meta`), and nothing computes a gradient or steps an optimiser."""
    import torch

    from engine.datasets import load_dataset
    from engine.fit import fit_model

    def refuse(*args, **kwargs):
        raise AssertionError("the fit check trained")

    monkeypatch.setattr(torch.Tensor, "backward", refuse)
    monkeypatch.setattr(torch.autograd, "backward", refuse)
    monkeypatch.setattr(torch.optim.Optimizer, "step", refuse)
    rows = []

    def record(module, args):
        for a in args:
            if isinstance(a, torch.Tensor):
                rows.append((a.shape[0] if a.dim() else 1, a.device.type, torch.is_grad_enabled()))

    data = load_dataset("digits")
    hook = torch.nn.modules.module.register_module_forward_pre_hook(record)
    try:
        for model in ("digits_mlp", "resnet18"):  # a fit, and a mismatch (every registry model tried)
            try:
                fit_model(model, "digits", data, 10)
            except ZooidValueError:
                pass
    finally:
        hook.remove()
    assert rows  # the models were run
    assert {(n, grad) for n, _, grad in rows} == {(1, False)}, set(rows)
    assert {device for _, device, _ in rows} <= {"cpu", "meta"}


# --- through the real flows: nothing rented ---------------------------------------------------


def _worker_flow_runs() -> int:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    with get_client(sync_client=True) as client:
        return len(client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["worker"]))))


@pytest.mark.usefixtures("prefect_api")
@pytest.mark.parametrize("params", [["dataset=synthetic:3x32:10"], ["model=resnet18"]])
def test_an_impossible_pair_rents_nothing_through_the_train_flow(params, tmp_path, capsys, monkeypatch):
    from coordinator.workers import warm_pool
    from flows import train as train_flow

    started = []
    monkeypatch.setattr(warm_pool.WarmPool, "_start", lambda self, *a, **k: started.append(a) or 1 / 0)
    store = tmp_path / "store"
    flow_runs = _worker_flow_runs()
    argv = [a for p in params + [f"store=file://{store}", "epochs=1"] for a in ("--param", p)]
    assert train_flow.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: model: ") and " dataset " in err[0], err
    assert not (store / "runs").exists() and not (store / "cache").exists()  # no run directory, no ledger
    # the flow itself (a deployment run, no CLI before it) refuses before it makes a run
    job = TrainJob(**dict(p.split("=", 1) for p in params), store=f"file://{store}", epochs=1)
    state = train_flow.train(job, return_state=True)
    assert state.is_failed()
    with pytest.raises(ZooidValueError, match="^model: .* does not fit dataset"):
        state.result()
    assert started == [] and _worker_flow_runs() == flow_runs and not (store / "cache").exists()
    # (the flow's failure hook bills the coordinator's second: nothing else is in the run's directory)
    for run in (store / "runs").glob("*") if (store / "runs").exists() else ():
        assert {p.name for p in run.iterdir()} <= {"cost.json", "summary.json"}
        assert {r["kind"] for r in json.loads((run / "cost.json").read_text())["rows"]} <= {"coordinator"}


@pytest.mark.usefixtures("prefect_api")
def test_an_impossible_pair_rents_nothing_through_the_dry_run(tmp_path, monkeypatch):
    from coordinator.workers import warm_pool
    from flows.dry_run import plan

    monkeypatch.setattr(warm_pool.WarmPool, "_start", lambda self, *a, **k: 1 / 0)
    state = plan(TrainJob(model="resnet18", store=f"file://{tmp_path}/store"), return_state=True)
    with pytest.raises(ZooidValueError, match="^model: resnet18 does not fit dataset digits"):
        state.result()
    assert not (tmp_path / "store" / "runs").exists()


# --- a profiling failure no retry fixes: one worker ------------------------------------------


def _batch_of_one(tmp_path, monkeypatch) -> str:
    (tmp_path / "batchone.py").write_text(BATCH_OF_ONE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + ":" + ":".join(p for p in sys.path if p))
    return "batchone:net"


@pytest.mark.usefixtures("prefect_api")
def test_a_profile_that_no_retry_can_fix_launches_exactly_one_worker(tmp_path, monkeypatch):
    from coordinator.run.context import RunContext
    from coordinator.run.validate import validate_job
    from coordinator.workers import warm_pool
    from coordinator.workers.sweep import tagged_pids
    from tasks.profile import profile

    model = _batch_of_one(tmp_path, monkeypatch)
    started, real_start = [], warm_pool.WarmPool._start
    monkeypatch.setattr(warm_pool.WarmPool, "_start",
                        lambda self, *a, **k: started.append(a[0]) or real_start(self, *a, **k))
    job = TrainJob(model=model, workers=1, store=f"file://{tmp_path}/store", warm=False)
    ctx = RunContext(run_id="zrefuse1", job=job, resolved=validate_job(job))  # one row fits: validation passes
    with pytest.raises(ZooidValueError) as err:
        profile(ctx)
    message = str(err.value)
    assert message.startswith(f"model: {model} failed on the profiling worker with dataset digits")
    assert "not retried" in message and "no second worker rented" in message
    assert "shapes cannot be multiplied" in message and "\n" not in message
    assert started == [0]  # one worker started, no second
    assert len({r.resource for r in ctx.state.ledger}) == 1 and ctx.state.ledger  # that one is billed
    assert tagged_pids(ctx.run_id) == []


@pytest.mark.usefixtures("prefect_api")
def test_a_worker_that_died_is_still_replaced_once(tmp_path, monkeypatch):
    from coordinator.plan import target_profile
    from coordinator.run.context import RunContext
    from coordinator.run.validate import validate_job
    from tasks import profile as profile_mod

    job = TrainJob(workers=1, store=f"file://{tmp_path}/store", warm=False)
    ctx = RunContext(run_id="zrefuse2", job=job, resolved=validate_job(job))
    calls = []

    def flaky(ctx_):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("worker w0 exited while profiling: crashed")
        return {"device": "cpu", "device_name": "x", "threads": 1, "torch": torch.__version__,
                "profile_sources": {}, "profile_s": 0.0}

    monkeypatch.setattr(target_profile, "_profile", flaky)
    monkeypatch.setattr(profile_mod, "show_profile", lambda prof: prof)
    assert profile_mod.profile(ctx)["device"] == "cpu" and len(calls) == 2


@pytest.mark.parametrize("message,unfixable", [
    ("profiling on worker w failed: RuntimeError: mat1 and mat2 shapes cannot be multiplied (1x2048 and 64x10)", True),
    ("profiling on worker w failed: RuntimeError: Given groups=1, weight of size [64, 3, 3, 3], expected input", True),
    ("profiling on worker w failed: ZooidValueError: model: 'x' failed when called: boom", True),
    ("profiling on worker w failed: ModuleNotFoundError: No module named 'batchone'", True),
    ("profiling on worker w failed: RuntimeError: CUDA error: an illegal memory access", False),
    ("profiling on worker w failed: StoreTimeout: key did not appear", False),
    ("worker w exited while profiling: crashed", False),
    ("worker w gave no profile within 600 s", False),
])
def test_which_profiling_failures_are_not_retried(message, unfixable):
    from coordinator.plan.target_profile import unfixable_reason

    assert (unfixable_reason(RuntimeError(message)) is not None) == unfixable


@pytest.mark.usefixtures("prefect_api")
def test_an_unfixable_profile_failure_ends_the_train_flow_with_one_line_and_one_worker(tmp_path, monkeypatch,
                                                                                        capsys):
    from comm.store import open_store
    from coordinator.bill.cost import read_ledger
    from flows.train import main

    model = _batch_of_one(tmp_path, monkeypatch)
    store_url = f"file://{tmp_path}/store"
    assert main(["--param", f"model={model}", "--param", f"store={store_url}", "--param", "workers=1",
                 "--param", "epochs=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # (above it: Prefect's own log lines)
    assert err.startswith(f"error: model: {model} failed on the profiling worker"), err
    store = open_store(store_url)
    run_id = store.list("runs/")[0].split("/")[1]
    workers = {r["resource"] for r in read_ledger(store, run_id)["rows"] if r["kind"] == "worker"}
    assert len(workers) == 1, workers


# --- the dry run: says what it rents; rents nothing when told -----------------------------------


@pytest.fixture
def flow_log(monkeypatch):
    """What the dry run and the profile step print (in a flow, `log_prints` sends it to the run's
    logger, which tests run at WARNING), as it is said."""
    import coordinator.plan.target_profile
    import flows.dry_run

    said: list[str] = []
    for module in (flows.dry_run, coordinator.plan.target_profile):
        monkeypatch.setattr(module, "print", lambda *a, **k: said.append(" ".join(map(str, a))), raising=False)
    return said


@pytest.mark.usefixtures("prefect_api")
def test_the_dry_run_says_what_it_rents_and_with_rent_false_plans_from_the_catalog_or_the_cache(tmp_path, monkeypatch, capsys, flow_log):
    from coordinator.plan import target_profile
    from coordinator.workers import warm_pool
    from flows.dry_run import main, plan

    store = f"file://{tmp_path}/store"
    job = TrainJob(model="digits_mlp", workers=2, store=store)
    said = flow_log

    # nothing cached: told to rent nothing, it plans from the catalog's figures, says how uncertain
    # that is, starts nothing and caches nothing (a measured profile replaces the estimate)
    started = []
    real_start = warm_pool.WarmPool._start
    monkeypatch.setattr(warm_pool.WarmPool, "_start", lambda self, *a, **k: started.append(a) or real_start(self, *a, **k))
    estimated = plan(job, rent=False)
    out = "\n".join(said)
    assert "planned from the catalog's figures" in out and "Uncertain" in out and "nothing rented" in out
    assert started == [] and estimated["alternatives"]
    assert not list((tmp_path / "store").glob("cache/profiles/*.json"))
    assert main(["--param", "model=digits_mlp", "--param", f"store={store}", "--param", "rent=false"]) == 0

    # rent=true (the default): it says first that it rents one profiling worker, and its estimated cost
    said.clear()
    first = plan(job)  # (the flow logs its prints)
    out = "\n".join(said)
    notice = next(line for line in out.splitlines() if "will rent one profiling worker" in line)
    assert "target 'inline'" in notice and "estimated $" in notice and "an estimate" in notice
    assert out.index("will rent one profiling worker") < out.index("zooid profile of digits_mlp")
    assert len(started) == 1

    # rent=false now: planned from that cached profile, and nothing started at all
    def no_worker(*a, **k):
        raise AssertionError("rent=false started a worker")

    monkeypatch.setattr(warm_pool.WarmPool, "_start", no_worker)
    monkeypatch.setattr(target_profile.TargetProfiler, "measure", no_worker)
    said.clear()
    second = plan(job, rent=False)
    out = "\n".join(said)
    assert "planned from a cached profile of digits_mlp on cpu" in out and "taken 20" in out
    assert "this target's own workers" in out and "nothing rented" in out
    assert second["strategy"] == first["strategy"] and second["alternatives"]
    # a worker of another size has no profile of its own: the same device class's is used, and the
    # plan says how far to trust it
    said.clear()
    plan(job.model_copy(update={"worker_vcpu": 3.0}), rent=False)
    assert "another target's cpu workers" in "\n".join(said)
    # and the notice of a dry run that needs no worker says so
    said.clear()
    plan(job)
    assert "is cached; nothing will be rented" in "\n".join(said)
    assert main(["--param", "model=digits_mlp", "--param", "workers=2", "--param", f"store={store}",
                 "--param", "rent=false"]) == 0


def test_a_refused_command_line_leaves_no_server_behind(tmp_path):
    """`python -m flows.train` starts its temporary Prefect server before its imports (its
    start-up overlaps them and the validation); a job refused in validation stops it again: the
    command says one line, exits 2, and nothing listens on the server's port."""
    import os
    import socket
    import subprocess
    from pathlib import Path

    home = tmp_path / "zooid"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(ZOOID_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1")
    done = subprocess.run([sys.executable, "-m", "flows.train", "--param", "model=resnet18", "--param", "dataset=digits"],
                          cwd=Path(__file__).resolve().parent.parent, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert [line for line in done.stderr.splitlines() if line.strip()][-1].startswith("error: model: ")
    [log] = (home / "logs").glob("server-*.log")  # the early server was started ...
    with socket.socket() as s:  # ... and is gone
        assert s.connect_ex(("127.0.0.1", int(log.stem.split("-")[1]))) != 0
