"""The `train` flow end to end against a real Prefect API, inline target, directory store."""
from __future__ import annotations

import json

import pytest

from coordinator.run.job import TrainJob
from core.epoch_summary import EpochSummary

pytestmark = pytest.mark.usefixtures("prefect_api")


def _store_root() -> str:
    from comm.store_dir import default_store_url, path_from_url

    return str(path_from_url(default_store_url()))


@pytest.mark.parametrize("warm", [True, False])
def test_train_flow_trains_bills_and_cleans_up(tmp_path, warm, monkeypatch):
    from comm.store import open_store
    from coordinator.bill.cost import read_ledger
    from coordinator.workers.sweep import alive, tagged_pids
    from coordinator.workers.worker_forks import WorkerForks
    from flows.train import train

    servers, started = set(), WorkerForks._server

    def fork_server(self):  # the run's fork servers, by pid
        server = started(self)
        servers.add(server.pid)
        return server

    monkeypatch.setattr(WorkerForks, "_server", fork_server)
    store_url = f"file://{tmp_path}/store"
    summary = train(TrainJob(workers=2, epochs=2, store=store_url, batch_size=16, warm=warm))
    assert summary.status == "completed"
    assert [e.epoch for e in summary.epochs] == [0, 1]
    assert all(e.workers == 2 for e in summary.epochs)
    assert summary.epochs[-1].val_accuracy > 0.5
    assert summary.total_cost_usd > 0
    store = open_store(store_url)
    run = f"runs/{summary.run_id}"
    # the summary, the ledger, the checkpoints and the plot are kept
    saved = json.loads(store.get(f"{run}/summary.json"))
    assert saved["status"] == "completed" and len(saved["epochs"]) == 2
    # every field of each epoch's record reaches summary.json and history.json as the flow held it,
    # including those set after the epoch ran (prediction in force, overhead, rescale, re-plan, plan)
    history = json.loads(store.get(f"{run}/history.json"))
    for held, written, kept in zip(summary.epochs, saved["epochs"], history):
        assert written == kept == held.to_dict()
    first = summary.epochs[0]
    assert first.rescale is not None and first.rescale.workers == 2 and first.replan is not None
    assert first.replan.reason and first.plan["data_parallel"] == 2 and first.overhead_s is not None
    assert first.compute_s > 0 and first.samples > 0 and first.predicted_cost_so_far_usd is not None
    ledger = read_ledger(store, summary.run_id)
    kinds = [r["kind"] for r in ledger["rows"]]
    trained = [r for r in ledger["rows"] if r["kind"] == "worker" and r["attempt"] is not None]
    assert len(trained) == 4 and kinds.count("coordinator") == 1  # 2 workers x 2 epochs
    assert ledger["total_usd"] == pytest.approx(summary.total_cost_usd)
    assert all(r["seconds"] > 0 and (r["usd"] > 0 or r["kind"] == "store") for r in ledger["rows"])
    # the directory store's requests, the workers' and the coordinator's, counted and free
    stores = {r["resource"]: r for r in ledger["rows"] if r["kind"] == "store"}
    assert set(stores) == {"store file:// workers", "store file:// coordinator"}
    assert all(r["usd"] == 0 and r["store_ops"]["put"] > 0 for r in stores.values())
    # the workers' requests: their epochs', and the store probe's before the plan (a worker took the
    # profile: `tests/test_profile_on_target.py` counts the probe's alone)
    assert stores["store file:// workers"]["store_ops"]["put"] > sum(e.store_ops["file://"]["put"] for e in summary.epochs)
    assert store.exists(f"{run}/ckpt/epoch-0001.safetensors")
    assert store.get(f"{run}/report/curves.png")[:8] == b"\x89PNG\r\n\x1a\n"
    # scratch is gone and no worker outlives the run
    assert store.list(f"{run}/data/") == [] and store.list(f"{run}/sync/") == []
    assert tagged_pids(summary.run_id) == []
    # the workers of both epochs (cold: a set each) forked from one fork server, which the teardown
    # ended; a warm run's profile is taken by its workers, a cold run's by a one-off worker whose
    # fork server ended with the profile step
    assert len(servers) == (1 if warm else 2) and not any(alive(pid) for pid in servers)


def test_the_recipes_steps_are_the_flow_runs_task_runs_in_its_order(tmp_path):
    """Each step that goes through tasks/ is a task run of the flow run, in the recipe's order:
    resume, profile, plan, provision; per epoch run_epoch, checkpoint, (before a next epoch)
    rescale and replan, save_progress; then teardown, record_cost, summary."""
    import time

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterFlowRunId

    from deployments.server import drain_prefect_clients
    from flows.train import train

    state = train(TrainJob(workers=1, epochs=2, store=f"file://{tmp_path}/s", warm=False), return_state=True)
    assert state.is_completed()
    epoch = ["run_epoch", "checkpoint"]
    expected = (["resume", "profile", "plan", "provision"] + epoch + ["rescale", "replan", "save_progress"]
                + epoch + ["save_progress", "teardown", "record_cost", "summary"])
    drain_prefect_clients()
    deadline = time.monotonic() + 60  # the server records a task run from its events, after they arrive
    with get_client(sync_client=True) as client:
        while True:
            runs = client.read_task_runs(task_run_filter=TaskRunFilter(
                flow_run_id=TaskRunFilterFlowRunId(any_=[state.state_details.flow_run_id])))
            if len(runs) >= len(expected) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    runs.sort(key=lambda r: r.start_time or r.expected_start_time)
    assert [r.name.rsplit("-", 1)[0] for r in runs] == expected
    assert all(r.state.is_completed() for r in runs)


def test_an_epoch_record_survives_the_run_summary_with_every_field():
    """Every field of `EpochSummary`, set to a value that is not its default, comes back equal
    through the run summary's JSON (summary.json) and the history's (history.json)."""
    import dataclasses

    from coordinator.run.job import RunSummary
    from core.epoch_summary import Replan, Rescale

    values = {int: 3, float: 0.25, str: "k", bool: True, dict: {"a": 1}, list: [{"rank": 1}]}
    fields = {}
    for f in dataclasses.fields(EpochSummary):
        kind = {"Rescale | None": Rescale, "Replan | None": Replan}.get(f.type)
        fields[f.name] = (Rescale(workers=4, lr=0.5, reason="r") if kind is Rescale else
                          Replan(calibration={"step_scale": 2.0}, switched=True, reason="x", to={"stages": 1})
                          if kind is Replan else
                          next(v for t, v in values.items() if f.type.split(" | ")[0] == t.__name__))
    epoch = EpochSummary(**fields)
    assert all(getattr(epoch, f.name) != f.default for f in dataclasses.fields(EpochSummary)
               if f.default is not dataclasses.MISSING)
    back = RunSummary.model_validate_json(RunSummary(run_id="r", status="completed", epochs=[epoch]).model_dump_json())
    assert back.epochs[0] == epoch
    assert json.loads(RunSummary(run_id="r", status="completed", epochs=[epoch]).model_dump_json())["epochs"][0] \
        == epoch.to_dict()
    assert EpochSummary.from_dict(json.loads(json.dumps(epoch.to_dict()))) == epoch


def test_target_accuracy_stops_early(tmp_path):
    from flows.train import train

    summary = train(TrainJob(workers=2, epochs=6, target_accuracy=0.05, store=f"file://{tmp_path}/s"))
    assert summary.status == "target_reached"
    assert len(summary.epochs) == 1


def test_budget_stops_before_spending_it(tmp_path):
    from flows.train import train

    summary = train(TrainJob(workers=2, epochs=5, budget_usd=1e-9, store=f"file://{tmp_path}/s"))
    assert summary.status == "budget_exhausted"
    assert summary.epochs == []


def test_a_deadline_the_first_epoch_would_pass_stops_the_run_cleanly(tmp_path):
    from comm.store import open_store
    from coordinator.bill.cost import read_ledger
    from coordinator.workers.sweep import tagged_pids
    from flows.train import train

    url = f"file://{tmp_path}/s"
    summary = train(TrainJob(workers=2, epochs=4, deadline_s=1e-3, store=url))
    assert summary.status == "deadline_reached" and summary.epochs == []
    store = open_store(url)
    assert store.list(f"runs/{summary.run_id}/data/") == [] and tagged_pids(summary.run_id) == []
    # the workers started for the run are billed to their stop, though they trained nothing
    # (one of them took the profile)
    rows = read_ledger(store, summary.run_id)["rows"]
    assert {r["status"] for r in rows if r["kind"] == "worker"} <= {"startup", "idle", "profile"}


class _Ctx:
    def __init__(self, started_at, spent_usd=0.0, price=0.0):
        from coordinator.run.context import RunState
        from core.cost_record import CostRecord

        self.started_at, self.price_per_coordinator_s = started_at, price  # the coordinator bills on
        self.state = RunState(ledger=[CostRecord(run_id="r", resource="w", kind="worker", offer="o", start=0.0,
                                                 stop=1.0, unit_price_per_s=spent_usd)])


def _epoch(**fields) -> EpochSummary:
    return EpochSummary(epoch=0, workers=1, train_loss=1.0, **fields)


@pytest.mark.parametrize("elapsed, predicted_s, last_s, deadline, expected", [
    (10.0, 1.0, None, 20.0, None),            # first epoch fits
    (10.0, 1.0, 12.0, 20.0, "deadline_reached"),  # the last epoch measured longer than the plan
    (19.5, 1.0, 0.2, 20.0, "deadline_reached"),   # the prediction alone passes it
    (18.0, 1.0, 1.5, 20.0, None),
])
def test_guardrail_judges_the_next_epoch_by_the_larger_of_plan_and_measure(elapsed, predicted_s, last_s,
                                                                              deadline, expected, monkeypatch):
    from types import SimpleNamespace

    import flows.train
    from flows.train import guardrail

    now = 1_000_000.0  # the flow's clock, fixed by the test: `elapsed` is exact
    monkeypatch.setattr(flows.train, "time", SimpleNamespace(time=lambda: now))
    job = TrainJob(deadline_s=deadline)
    plan = SimpleNamespace(predicted_epoch_s=predicted_s, predicted_cost_per_epoch_usd=0.0)
    history = [_epoch(seconds=last_s, cost_usd=0.0)] if last_s is not None else []
    assert guardrail(job, _Ctx(now - elapsed), plan, history) == expected


def test_guardrail_stops_before_the_budget_is_spent(monkeypatch):
    from types import SimpleNamespace

    import flows.train
    from flows.train import guardrail

    now = 1_000_000.0
    monkeypatch.setattr(flows.train, "time", SimpleNamespace(time=lambda: now))
    plan = SimpleNamespace(predicted_epoch_s=1.0, predicted_cost_per_epoch_usd=0.4)
    job = TrainJob(budget_usd=1.0)
    assert guardrail(job, _Ctx(now, spent_usd=0.5), plan, []) is None
    assert guardrail(job, _Ctx(now, spent_usd=0.7), plan, []) == "budget_exhausted"
    assert guardrail(job, _Ctx(now, spent_usd=0.5), plan, [_epoch(seconds=1.0, cost_usd=0.6)]) \
        == "budget_exhausted"
    # running workers bill by the second since the start: 0.5 + 0.4 + 100 s x $0.001 passes $1
    assert guardrail(job, _Ctx(now - 99.0, spent_usd=0.5, price=0.001), plan, []) is None
    assert guardrail(job, _Ctx(now - 101.0, spent_usd=0.5, price=0.001), plan, []) == "budget_exhausted"


def test_out_of_memory_is_not_retried_and_teardown_leaves_nothing(tmp_path, monkeypatch):
    from comm.store import open_store
    from coordinator.bill.cost import read_ledger
    from coordinator.workers.sweep import tagged_pids
    from flows.train import train

    monkeypatch.setenv("ZOOID_CHAOS", "oom_worker:epoch=0:rank=1:mode=kill")
    store_url = f"file://{tmp_path}/store"
    state = train(TrainJob(workers=2, epochs=1, store=store_url), return_state=True)
    assert state.is_failed()
    store = open_store(store_url)
    run_id = store.list("runs/")[0].split("/")[1]
    assert tagged_pids(run_id) == []
    assert store.list(f"runs/{run_id}/sync/") == [] and store.list(f"runs/{run_id}/data/") == []
    ledger = read_ledger(store, run_id)
    failed = [r for r in ledger["rows"] if r["kind"] == "failed_attempt"]
    # one attempt only: out of memory is re-planned or reported, never retried
    assert [(r["rank"], r["status"]) for r in failed if r["rank"] == 1] == [(1, "crashed:oom")]
    assert all(r["usd"] > 0 for r in failed)
    summary = json.loads(store.get(f"runs/{run_id}/summary.json"))
    assert summary["status"] == "failed" and "OutOfMemory" in summary["error"]
