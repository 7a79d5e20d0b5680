"""The docker target end to end (`tests/docker_stack.py`'s stack): Local-SGD and a pipeline train
in containers, warm, billed on the engine's clock; a missing image or engine is one clear error
before anything is paid."""
from __future__ import annotations

import pytest

from tests.docker_stack import (
    _container_ids,
    _containers,
    _ledger,
    _run_id,
    _save_target,
    _store,
    _submit,
    _summary,
    _wait_final,
    stack_for_the_module,
)

pytestmark = [pytest.mark.slow, pytest.mark.docker]
stack = pytest.fixture(scope="module", name="stack")(stack_for_the_module)


RUNS = {"local_sgd": {"strategy": "local_sgd", "epochs": 2, "workers": 2},
        "pipeline": {"strategy": "pipeline", "epochs": 2, "workers": 1, "stages": 2, "model": "digits_mlp"}}


@pytest.fixture(scope="module")
def submitted(stack):
    """Both runs submitted at once (their containers start and train side by side): their
    flow run ids by strategy."""
    return {strategy: _submit(stack, **params) for strategy, params in RUNS.items()}


@pytest.mark.parametrize("strategy", list(RUNS))
def test_training_on_containers_completes_warm_and_is_billed_on_the_engines_clock(stack, submitted, strategy):
    fr = _wait_final(submitted[strategy])
    assert fr.state.is_completed(), fr.state.message
    run_id = _run_id(str(fr.id))
    summary = _summary(stack, run_id)
    assert summary["status"] == "completed" and len(summary["epochs"]) == 2
    assert summary["final_accuracy"] > 0.5
    rows = _ledger(stack, run_id)
    workers_rows = [r for r in rows if r["kind"] == "worker"]
    # warm: one container per worker lived through both epochs, each billed once on the engine's clock
    ids = _container_ids(rows)
    assert len(ids) == 2 and all(len(i) == 12 and int(i, 16) >= 0 for i in ids)
    assert len({r["worker"] for r in workers_rows}) == 2
    assert all(r["stop"] >= r["start"] and r["usd"] == pytest.approx((r["stop"] - r["start"]) * r["unit_price_per_s"])
               for r in workers_rows)
    # the report names each worker's container: the text report's line and the UI artifact's bill
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from coordinator.report.report import infrastructure_ids
    from core.keys import artifact_key

    assert set(infrastructure_ids(rows)) == ids
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=[artifact_key(run_id, "report")])))
    assert artifacts and all(i in artifacts[0].data for i in ids)
    # teardown read the clock, then removed every container of the run
    assert _containers(run_id) == []


def test_a_missing_image_or_engine_is_one_clear_error_before_anything_is_paid(stack, monkeypatch):
    from blocks.compute import resolve_target
    from coordinator.run.job import TrainJob
    from coordinator.run.validate import check_target_ready, validate_job
    from core.errors import ZooidValueError

    target = _save_target("docker-no-image", image="localhost/zooid-no-such-image:0")
    flow_run_id = _submit(stack, workers=2, epochs=1, target=target)
    fr = _wait_final(flow_run_id)
    assert fr.state.is_failed()
    assert "image: 'localhost/zooid-no-such-image:0' is not on the engine" in (fr.state.message or "")
    run_id = _run_id(flow_run_id)
    assert _containers(run_id) == []
    store = _store(stack)
    try:
        assert store.list(f"runs/{run_id}/") == []  # nothing written, nothing billed
    finally:
        store.close()

    resolved = validate_job(TrainJob(target="docker", store=stack["docker"]["store"]))
    assert resolve_target("docker").kind == "docker"
    monkeypatch.setenv("DOCKER_HOST", f"unix://{stack['home']}/no-engine.sock")
    with pytest.raises(ZooidValueError, match=r"^target: no container engine answers at DOCKER_HOST="):
        check_target_ready(resolved)
