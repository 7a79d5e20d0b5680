"""Progress you can watch: the coordinator's line per epoch (in the flow's log, so the UI and
`prefect deployment run --watch` show it), worker logs that say what they measured, worker
flow runs tagged with what they ran."""
from __future__ import annotations

import logging
import re

import pytest

from coordinator.run.job import TrainJob

# --- formatting, pure -----------------------------------------------------------------------


def test_the_epoch_line_names_epoch_workers_loss_accuracy_time_and_cost_against_predictions():
    from coordinator.report.progress import epoch_line
    from core.epoch_summary import EpochSummary

    line = epoch_line(EpochSummary(epoch=1, workers=2, train_loss=0.5, val_loss=0.41234, val_accuracy=0.873,
                                   seconds=1.23, predicted_epoch_s=1.1, predicted_cost_so_far_usd=0.000201),
                      5, 0.000215, 0.000592)
    assert line == ("epoch 2/5: 2 worker(s), loss 0.4123, accuracy 87.3%, 1.23 s (predicted 1.10 s), "
                    "cost so far $0.000215 (predicted $0.000201 by now; $0.000592 for the run)")


def test_the_plan_predicts_the_bill_at_each_epochs_end():
    """Cumulative: what is billed before the plan, then the workers and the coordinator up to
    each epoch's end; the last epoch's bill is the run's less teardown and the workers' stop."""
    from core.plan import Plan
    from planners.run_prediction import RunTerms, predict_run

    plan = Plan(strategy="local_sgd", data_parallel=2, stages=1, predicted_compute_epoch_s=2.0,
                price_per_worker_s=0.01)
    terms = RunTerms(startup_s=3.0, epoch_overhead_s=1.0, gap_s=0.5, provision_s=1.0, teardown_s=2.0,
                     stop_s=1.0, warmup_s=0.0)
    warm = predict_run(plan, terms, epochs=3, warm=True, workers_launched_s=None, billed_usd=0.1,
                       coordinator_price_per_s=0.001)
    # warm: first epoch 3 s + 2 s exposed start-up; ends at 1 + 5, + 3.5, + 3.5 s from the plan
    ends = [6.0, 9.5, 13.0]
    assert warm.cost_by_epoch_usd == pytest.approx([0.1 + 2 * t * 0.01 + t * 0.001 for t in ends])
    assert warm.cost_usd == pytest.approx(0.1 + 2 * (13.0 + 1.0) * 0.01 + 15.0 * 0.001)
    cold = predict_run(plan, terms, epochs=2, warm=False, workers_launched_s=None, coordinator_price_per_s=0.0)
    assert cold.cost_by_epoch_usd == pytest.approx([2 * 6.0 * 0.01, 2 * 12.0 * 0.01])


def test_a_stopped_command_line_says_three_lines_at_most():
    from coordinator.report.progress import interrupted_lines

    lines = interrupted_lines("SIGTERM", "zabc", {"workers": 2}, 0.00012, "/s/runs/zabc/cost.json",
                              "--param workers=2 ")
    assert len(lines) == 3
    assert "2 worker(s)" in lines[0] and "$0.000120" in lines[1]
    assert lines[2] == "resume with: python -m flows.train --param workers=2 --param resume=zabc"
    assert len(interrupted_lines("SIGINT", None, None, None, None, "")) == 1  # stopped before the run began


# --- worker logs and tags -------------------------------------------------------------------


def test_a_worker_measures_its_start_up_from_its_process_start():
    import core.process_start as start

    started, since = start.process_started_at()
    assert since == "process start"
    assert started < start._IMPORTED_AT  # the interpreter and the imports before this module count


def test_a_forked_worker_measures_its_start_up_from_its_fork(monkeypatch):
    """A fork server marks the process it forks with the fork's time (a clock tick of /proc is
    about as long as a forked worker's start); a mark for another pid does not count."""
    import os

    from core.process_start import STARTED_AT_VAR, mark_forked, process_started_at

    monkeypatch.setenv(STARTED_AT_VAR, "")
    mark_forked(1234.5)
    assert process_started_at() == (1234.5, "process start")
    monkeypatch.setenv(STARTED_AT_VAR, f"{os.getpid() + 1}:1234.5")  # the forked process's own child
    assert process_started_at()[0] > 1234.5


def test_the_profile_line_says_what_each_part_measured():
    from runtime.warm import _profiled

    assert _profiled("digits_mlp", {"model_s": 1.2, "store_s": 0.7}, 2.0) == \
        "profiled digits_mlp in 1.20 s and probed the store in 0.70 s (2.00 s in all)"
    assert _profiled("digits_mlp", {"store_s": 1.63}, 1.7) == "probed the store in 1.63 s (1.70 s in all)"


def test_a_warm_worker_flow_run_is_not_tagged_with_one_epoch():
    from types import SimpleNamespace

    from coordinator.workers.launchers import run_tags
    from core.specs import WarmSpec

    cold = SimpleNamespace(epoch=3, rank=1, warm=None)
    assert run_tags("z1", cold) == ["zooid-run:z1", "rank:1", "epoch:3"]
    warm = SimpleNamespace(epoch=0, rank=1, warm=WarmSpec(worker="r1-w0-c", lease_s=30.0))
    tags = run_tags("z1", warm)
    assert tags == ["zooid-run:z1", "rank:1", "warm"] and not any(t.startswith("epoch:") for t in tags)


# --- the coordinator's line per epoch, in the flow's log -------------------------------------


@pytest.mark.usefixtures("prefect_api")
def test_the_coordinator_logs_one_line_per_epoch_through_the_flow_logger(tmp_path, request):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags, LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort
    from prefect.logging.handlers import APILogWorker

    from comm.store import open_store
    from comm.store_dir import zooid_home
    from coordinator.bill.cost import read_ledger
    from coordinator.report.progress import money
    from flows.train import train

    flow_logger = logging.getLogger("prefect.flow_runs")  # the suite logs warnings only
    request.addfinalizer(lambda level=flow_logger.level: flow_logger.setLevel(level))
    flow_logger.setLevel(logging.INFO)  # setLevel, not .level: it clears the loggers' cached answers
    url = f"file://{tmp_path}/store"
    state = train(TrainJob(workers=2, epochs=2, store=url, batch_size=32), return_state=True)
    summary = state.result()
    # a first run on a fresh store: its plan's epoch overhead comes from the profile's round trips
    assert summary.plan["run_terms"]["measured"]["epoch_overhead_s"] == "profile"
    APILogWorker.drain_all(timeout=10)
    with get_client(sync_client=True) as client:
        flow_run_id = state.state_details.flow_run_id
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])),
                                sort=LogSort.TIMESTAMP_ASC)
        workers = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            tags=FlowRunFilterTags(all_=[f"zooid-run:{summary.run_id}"])))
    lines = [log.message for log in logs if re.match(r"epoch \d+/2: ", log.message)]
    assert [line.split(":")[0] for line in lines] == ["epoch 1/2", "epoch 2/2"]
    for line, epoch in zip(lines, summary.epochs):
        assert f"{epoch.workers} worker(s)" in line and f"accuracy {100 * epoch.val_accuracy:.1f}%" in line
        assert re.search(r"cost so far \$0\.\d+ \(predicted \$0\.\d+ by now; \$0\.\d+ for the run\)", line), line
    # the bill so far never exceeds the final one
    total = read_ledger(open_store(url), summary.run_id)["total_usd"]
    so_far = [float(re.search(r"cost so far \$([0-9.]+)", line).group(1)) for line in lines]
    assert so_far == sorted(so_far) and so_far[-1] <= float(money(total)[1:]) * 1.01
    # warm workers (inline target: processes, no flow runs) log their real start-up
    ready = [m for p in (zooid_home() / "logs" / summary.run_id).glob("*.log")
             for m in re.findall(r"ready ([0-9.]+) s after its process start", p.read_text())]
    assert len(ready) == 2 and all(float(s) > 0.0 for s in ready)
    assert workers == []
