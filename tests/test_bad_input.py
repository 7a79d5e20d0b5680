"""Bad input is refused before anything is provisioned: one line naming the field, exit 2,
no run directory and no cost."""
from __future__ import annotations

import pytest

from flows.train import main

pytestmark = pytest.mark.usefixtures("prefect_api")

CASES = [
    (["workers=0"], "workers"),
    (["workers=-3"], "workers"),
    (["epochs=0"], "epochs"),
    (["batch_size=0"], "batch_size"),
    (["lr=0"], "lr"),
    (["lr=-0.1"], "lr"),
    (["lr=nan"], "lr"),
    (["model=no_such_model"], "model"),
    (["dataset=no_such_data"], "dataset"),
    (["strategy=telepathy"], "strategy"),
    (["target=mars"], "target"),
    (["batch_size=100000"], "batch_size"),
    (["store=redis://127.0.0.1:1"], "store"),
    (["model=os:system"], "model"),
    (["model=json:dumps"], "model"),
    (["workers=two"], "workers"),
    (["optimizer=lbfgs"], "optimizer"),
    (["colour=blue"], "colour"),
    (["dataset=synthetic:3x32:10"], "model"),  # the model does not take the data: refused before renting
    (["model=resnet18"], "model"),
    (["dataset=synthetic:64:20"], "model"),  # 20 classes, the model scores 10
]


@pytest.mark.parametrize("params,field", CASES, ids=[c[0][0] for c in CASES])
def test_refused_with_field_named(params, field, tmp_path, capsys):
    store = tmp_path / "store"
    argv = [a for p in params for a in ("--param", p)]
    if not any(p.startswith("store=") for p in params):
        argv += ["--param", f"store=file://{store}"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"error: {field}:"), err[0]
    assert not (store / "runs").exists()


def test_user_model_factory_by_import_path_is_accepted():
    from coordinator.run.job import TrainJob
    from coordinator.run.validate import validate_job

    resolved = validate_job(TrainJob(model="tests.user_models:tiny_mlp"))
    assert resolved.n_train == 1437


def test_plan_that_does_not_fit_memory_is_refused_with_the_numbers(tmp_path, capsys):
    store = tmp_path / "store"
    assert main(["--param", f"store=file://{store}", "--param", "worker_memory_gb=0.05",
                 "--param", "epochs=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: memory: no plan fits the workers: local_sgd D=4 M=1: stage 0")
    assert "worker has 51.2 MB" in err and "nor do pipeline D=1 M=2" in err
    runs = list((store / "runs").glob("*")) if (store / "runs").exists() else []
    assert all(not (r / "ckpt").exists() and not (r / "data").exists() for r in runs)


def test_a_model_that_does_not_fit_the_data_names_both_and_what_fits(tmp_path, capsys):
    store = tmp_path / "store"
    assert main(["--param", f"store=file://{store}", "--param", "model=resnet18"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: model: resnet18 does not fit dataset digits"), err
    assert "a sample is 64" in err[0] and "registry models that fit digits: digits_mlp, digits_cnn" in err[0]
    assert not (store / "runs").exists()
