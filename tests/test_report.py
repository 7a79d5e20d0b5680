"""The report a person reads (`coordinator.report.report`): golden files for three real runs, a
Local-SGD run, a pipeline run with a relaunched stage and a cancelled run, in text and markdown;
and the rules every rendering keeps: no Python reprs, text lines of at most 120 characters,
money and times in one format, alternatives each once with one chosen, and a cost curve over
the whole ledger that ends at its total.

The runs' `summary.json` and `cost.json` (`tests/golden/<name>.summary.json`, `.cost.json`) are
recorded by `python tests/golden/record.py`, which reruns them. A plan that compared schedules
and the co-optimiser's worker sizes (`pipeline_plan_run`) is hand-made: the local targets offer
one worker size.

`ZOOID_UPDATE_GOLDEN=1 pytest tests/test_report.py` rewrites the golden files from the
current renderings (read the diff before committing it)."""
from __future__ import annotations

import itertools
import json
import os
import re
from pathlib import Path

import pytest

from coordinator.report.report import (
    MAX_WIDTH,
    alternatives,
    alternatives_table,
    cost_curve,
    duration,
    markdown_report,
    money,
    plot_cost,
    plot_curves,
    text_report,
)
from coordinator.run.job import EpochSummary, RunSummary
from core.plan import Plan

GOLDEN = Path(__file__).parent / "golden"
T0 = 1_700_000_000.0
PRICE = 1.2e-5  # $ per worker-second (about an ACI container of 1 vCPU, 2 GB)
TERMS = {"startup_s": 4.5, "epoch_overhead_s": 0.31, "gap_s": 0.12, "provision_s": 1.0, "teardown_s": 2.0,
         "stop_s": 1.0, "warmup_s": 0.4, "exposed_s": None,
         "measured": {"startup_s": True, "epoch_overhead_s": True, "gap_s": False, "provision_s": False,
                      "teardown_s": False, "stop_s": False, "warmup_s": False}}


def row(resource, kind, start, stop, *, status="completed", epoch=None, price=PRICE, offer="aci-cpu"):
    """One ledger row as `CostRecord.to_dict` writes it."""
    return {"run_id": "r", "resource": resource, "kind": kind, "offer": offer, "start": T0 + start,
            "stop": T0 + stop, "unit_price_per_s": price, "status": status, "epoch": epoch, "rank": None,
            "attempt": None, "worker": "", "seconds": round(stop - start, 6), "usd": (stop - start) * price}


def ledger(rows):
    return {"run_id": "r", "total_usd": sum(r["usd"] for r in rows), "rows": rows}


def epoch(i, workers, loss, acc, seconds, cost, **kw):
    return EpochSummary(epoch=i, workers=workers, train_loss=loss, val_loss=loss * 1.1, val_accuracy=acc,
                        seconds=seconds, samples_per_s=1437 / seconds, cost_usd=cost, predicted_epoch_s=1.1,
                        predicted_iteration_s=0.021, measured_iteration_s=0.024, **kw)


def pipeline_plan_run():
    """Hand-made: a 2-stage pipeline the co-optimiser chose (1/4 GB stages) over a uniform
    Local-SGD plan; the schedule comparison repeats the chosen gpipe row (the planner's own
    list holds it too)."""
    common = {"data_parallel": 1, "stages": 2, "workers": 2, "cuts": [2], "microbatches": 4, "chunks": 1}
    alts = ({**common, "strategy": "pipeline", "pipeline_schedule": "gpipe", "predicted_iteration_s": 0.0312,
             "predicted_epoch_s": 0.71, "predicted_cost_per_epoch_usd": 1.7e-5, "predicted_run_s": 12.1,
             "predicted_run_cost_usd": 0.00043, "chosen": True},
            {"strategy": "local_sgd", "data_parallel": 4, "stages": 1, "workers": 4, "cuts": [], "microbatches": 4,
             "pipeline_schedule": None, "chunks": 1, "predicted_iteration_s": 0.0229, "predicted_epoch_s": 0.55,
             "predicted_cost_per_epoch_usd": 2.64e-5, "predicted_run_s": 11.0, "predicted_run_cost_usd": 0.00061,
             "chosen": False},
            {**common, "strategy": "pipeline", "pipeline_schedule": "1f1b", "compared": "schedule", "fits": True,
             "predicted_iteration_s": 0.0321, "predicted_epoch_s": 0.73, "predicted_cost_per_epoch_usd": 1.75e-5,
             "predicted_run_s": 12.3, "predicted_run_cost_usd": 0.000441, "chosen": False},
            {**common, "strategy": "pipeline", "pipeline_schedule": "interleaved", "chunks": 2,
             "compared": "schedule", "fits": False, "predicted_iteration_s": 0.0298, "predicted_epoch_s": 0.69,
             "predicted_cost_per_epoch_usd": 1.66e-5, "predicted_run_s": 11.9, "predicted_run_cost_usd": 0.000425,
             "chosen": False},
            {**common, "strategy": "pipeline", "pipeline_schedule": "gpipe", "compared": "co-optimiser",
             "stage_memory_gb": [1.0, 4.0], "predicted_iteration_s": 0.0303, "predicted_epoch_s": 0.303,
             "predicted_cost_per_epoch_usd": 1.51e-5, "predicted_run_s": 9.8, "predicted_run_cost_usd": 0.000392,
             "chosen": True},
            {**common, "strategy": "pipeline", "pipeline_schedule": "gpipe", "compared": "schedule", "fits": True,
             "predicted_iteration_s": 0.0312, "predicted_epoch_s": 0.71, "predicted_cost_per_epoch_usd": 1.7e-5,
             "predicted_run_s": 12.1, "predicted_run_cost_usd": 0.00043, "chosen": True})
    co = {"used": True, "sizes_gb": [1.0, 2.0, 4.0, 8.0], "solver": "exact",
          "rule": "the fastest, and within 5% of it the cheapest",
          "assumption": "CPU in proportion to memory (function offer)",
          "reason": "4 worker sizes: the fastest, and within 5% of it the cheapest",
          "uniform": {"strategy": "local_sgd", "data_parallel": 4, "stages": 1, "cuts": [], "worker_memory_gb": 2.0,
                      "stage_memory_gb": [], "predicted_epoch_s": 0.542, "predicted_cost_per_epoch_usd": 2.97e-5},
          "co_optimised": {"strategy": "pipeline", "data_parallel": 1, "stages": 2, "cuts": [2], "worker_memory_gb": 4.0,
                           "stage_memory_gb": [1.0, 4.0], "predicted_epoch_s": 0.303,
                           "predicted_cost_per_epoch_usd": 1.51e-5, "t_iter_s": 0.0281, "c_iter_usd": 1.3e-7,
                           "epoch_s": 0.281, "cost_per_epoch_usd": 1.3e-5},
          "uniform_by_size": [{"memory_gb": 1.0, "fits": False}]}
    plan = Plan(strategy="pipeline", data_parallel=1, stages=2, cuts=(2,), microbatches=4, pipeline_schedule="gpipe",
                steps_per_epoch=90, batch_size=16, worker_memory_gb=4.0, stage_memory_gb=(1.0, 4.0),
                offer="lambda-1gb", price_per_worker_s=1.7e-5, predicted_iteration_s=0.0303, predicted_epoch_s=0.303,
                predicted_cost_per_epoch_usd=1.51e-5, predicted_first_epoch_s=4.1, predicted_run_s=9.8,
                predicted_run_cost_usd=0.000392, run_terms=TERMS, alternatives=alts, co_optimizer=co).to_dict()
    rows = [row("coordinator", "coordinator", 0, 11.0, price=1.7e-5, offer="lambda-1gb")]
    for r in (0, 1):
        rows += [row(f"worker e0 r{r} a0", "worker", 1.2, 6.0 + r, status="completed", epoch=0, price=1.7e-5,
                     offer="lambda-1gb"),
                 row(f"worker e1 r{r} a0", "worker", 6.1, 7.0 + r, status="completed", epoch=1, price=1.7e-5,
                     offer="lambda-1gb")]
    rows.append(row("worker e1 r1 a1", "failed_attempt", 6.0, 6.4, status="failed:oom", epoch=1, price=1.7e-5,
                    offer="lambda-1gb"))
    summary = RunSummary(run_id="run-pipeline-02", status="target_reached", final_loss=0.35, final_accuracy=0.905,
                         total_cost_usd=sum(r["usd"] for r in rows), plan=plan, store_url="s3://zooid/runs",
                         epochs=[epoch(0, 2, 0.9, 0.81, 4.8, 0.000166, stages=2),
                                 epoch(1, 2, 0.33, 0.905, 0.98, 5.6e-5, stages=2,
                                       relaunches=[{"rank": 1, "kind": "oom"}])],
                         worker_seconds={"cold": 13.6, "failed": 0.4})
    return summary, ledger(rows)


def recorded(name: str) -> tuple[RunSummary, dict]:
    """(summary, ledger) of the real run `name` recorded by tests/golden/record.py."""
    summary = RunSummary.model_validate_json((GOLDEN / f"{name}.summary.json").read_text())
    return summary, json.loads((GOLDEN / f"{name}.cost.json").read_text())


RUNS = ("cancelled", "local_sgd", "pipeline")


def renderings(name: str) -> dict[str, str]:
    summary, led = recorded(name)
    return {f"{name}.txt": text_report(summary, led) + "\n",
            f"{name}.md": markdown_report(summary, led["rows"], None, cost_plot=False) + "\n"}


def check_golden(filename: str, actual: str) -> None:
    """Compare with tests/golden/<filename>; with ZOOID_UPDATE_GOLDEN=1, rewrite it instead."""
    path = GOLDEN / filename
    if os.environ.get("ZOOID_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(exist_ok=True)
        path.write_text(actual)
    assert path.exists(), f"{path} missing: run with ZOOID_UPDATE_GOLDEN=1 to write it"
    assert actual == path.read_text(), f"{filename} differs from its golden file (ZOOID_UPDATE_GOLDEN=1 rewrites it)"


@pytest.mark.parametrize("name", RUNS)
def test_reports_match_their_golden_files(name):
    for filename, actual in renderings(name).items():
        check_golden(filename, actual)


@pytest.mark.parametrize("name", RUNS)
def test_no_python_reprs_and_text_fits_the_pane(name):
    for filename, out in renderings(name).items():
        for repr_ in ("None", "()", "[]", "{}", "True", "False", "nan"):
            assert repr_ not in out, f"{filename}: {repr_!r} in\n{out}"
        assert not re.search(r"\de[-+]?\d", out), f"{filename}: a number in scientific notation"
        if filename.endswith(".txt"):
            assert all(len(line) <= MAX_WIDTH for line in out.splitlines()), \
                max(out.splitlines(), key=len)
        else:  # a markdown table's row: its cells and separators no wider than the pane
            rows = [line for line in out.splitlines() if line.startswith("| ") and "data:image" not in line]
            assert all(len(line) <= MAX_WIDTH for line in rows), max(rows, key=len)


@pytest.mark.parametrize("name", RUNS)
def test_the_headline_comes_first_and_the_title_says_the_status(name):
    summary, led = recorded(name)
    txt, md = text_report(summary, led).splitlines(), markdown_report(summary, led["rows"], None, cost_plot=False)
    assert txt[0] == f"Zooid run {summary.run_id}: {summary.status}"
    assert txt[1].startswith(summary.status + ": ")
    assert "predicted" in txt[2] and money(summary.total_cost_usd) in txt[2] and "wall time" in txt[2]
    assert md.splitlines()[0] == f"# Zooid run `{summary.run_id}`: {summary.status}"
    assert "workers ran on" not in "\n".join(txt)  # no cloud clock rows here


def test_a_cancelled_run_is_titled_cancelled_and_its_wall_time_comes_from_the_coordinator():
    summary, led = recorded("cancelled")
    out = text_report(summary, led).splitlines()
    assert out[0].endswith(": cancelled") and "failed" not in out[0]
    [coordinator] = [r for r in led["rows"] if r["kind"] == "coordinator"]
    assert out[2].startswith(f"wall time {duration(coordinator['stop'] - coordinator['start'])}, of which ")


@pytest.mark.parametrize("usd, shown", [(0.000592, "$0.000592"), (1.234, "$1.23"), (0.0, "$0"), (None, "-"),
                                        (4.682360755e-08, "$0.0000000468"), (12.345, "$12.3"), (0.0009996, "$0.00100"),
                                        (1234.5, "$1,230"), (-0.5, "-$0.500")])
def test_money_is_dollars_to_three_significant_digits(usd, shown):
    assert money(usd) == shown


@pytest.mark.parametrize("seconds, shown", [(0.000592, "0.592 ms"), (0.5421, "542 ms"), (0.9996, "1.00 s"),
                                            (54.23, "54.2 s"), (120.0, "120 s"), (150.0, "2.50 min"),
                                            (7300.0, "2.03 h"), (0, "0 s"), (None, "-")])
def test_times_carry_their_unit(seconds, shown):
    assert duration(seconds) == shown


def test_alternatives_are_each_shown_once_and_exactly_one_is_chosen():
    summary, _ = pipeline_plan_run()
    rows = alternatives(summary.plan)
    keys = [(a["strategy"], a.get("pipeline_schedule"), a.get("chunks"), a["data_parallel"], a["stages"],
             tuple(a.get("stage_memory_gb") or ())) for a in rows]
    assert len(keys) == len(set(keys)) == 5  # the repeated gpipe row once
    assert [a.get("stage_memory_gb") for a in rows if a["chosen"]] == [[1.0, 4.0]]
    gpipe = [a for a in rows if a.get("pipeline_schedule") == "gpipe" and not a.get("stage_memory_gb")]
    assert len(gpipe) == 1 and gpipe[0]["chosen"] is False
    assert all(s in text_report(summary) for s in ("gpipe", "1f1b", "interleaved x2 (does not fit)"))
    table = alternatives_table(summary.plan, markdown=True)
    tables = sum(1 for line in table if line.startswith("|  | strategy |"))  # a wide table splits in two
    assert tables >= 1 and sum(1 for line in table if line.startswith("| chosen |")) == tables


def test_a_plan_missing_from_its_alternatives_is_added_as_the_chosen_row():
    summary, _ = recorded("local_sgd")  # its planner's list: the plan alone; here another plan only
    other = {**summary.plan["alternatives"][0], "strategy": "pipeline", "data_parallel": 1, "stages": 2,
             "cuts": [1], "chosen": False}
    plan = {**summary.plan, "alternatives": [other]}
    rows = alternatives(plan)
    assert [a["strategy"] for a in rows if a["chosen"]] == ["local_sgd"] and len(rows) == 2


def test_the_co_optimiser_verdict_follows_from_its_numbers():
    summary, _ = pipeline_plan_run()
    out = " ".join(text_report(summary).split())  # lines wrapped at 120 characters joined
    assert "Verdict: the co-optimised plan is 44% faster and 49% cheaper per epoch than the uniform one" in out
    assert "so the run used the co-optimised plan." in out
    co = {**summary.plan["co_optimizer"], "used": False}
    out = " ".join(text_report(summary.model_copy(update={"plan": {**summary.plan, "co_optimizer": co}})).split())
    assert "by the rule the co-optimised plan wins, yet the run used the uniform plan" in out


@pytest.mark.parametrize("name", RUNS)
def test_the_cost_curve_covers_the_whole_ledger_from_zero_to_its_total(name):
    summary, led = recorded(name)
    points = cost_curve(led["rows"])
    assert points[0] == (0.0, 0.0)
    assert points[-1][1] == pytest.approx(led["total_usd"], rel=1e-12)
    assert points[-1][0] == pytest.approx(max(r["stop"] for r in led["rows"]) - min(r["start"] for r in led["rows"]))
    assert all(b[0] >= a[0] and b[1] >= a[1] for a, b in itertools.pairwise(points))  # time and bill only grow
    # the coordinator alone is more than the epochs' cost: the curve is not the epochs' sum
    assert points[-1][1] > sum(e.cost_usd for e in summary.epochs)


def test_the_plots_are_pngs():
    summary, led = recorded("local_sgd")
    epochs = summary.epochs
    for png in (plot_curves(epochs), plot_curves(epochs, led["rows"]), plot_cost(led["rows"])):
        assert png[:8] == b"\x89PNG\r\n\x1a\n"
    md = markdown_report(summary, led["rows"], plot_curves(epochs))
    assert len(re.findall(r"!\[[^]]*\]\(data:image/png;base64,", md)) == 2


def test_the_readme_documents_every_job_field():
    from coordinator.run.job import TrainJob

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    table = readme.split("| parameter | default | meaning |", 1)[1].split("\n\n", 1)[0]
    documented = {name for line in table.splitlines()[2:] for name in re.findall(r"`(\w+)`", line.split(" | ")[0])}
    assert documented == set(TrainJob.model_fields)
    assert "package.module:function" not in readme and "package.module:factory" in table


def test_a_run_that_failed_before_its_plan_still_reads_cleanly():
    summary = RunSummary(run_id="run-failed-04", status="failed", error="profile: mat1 and mat2 shapes cannot be "
                         "multiplied (16x192 and 64x128) " + "x" * 150)
    led = ledger([row("coordinator", "coordinator", 0, 3.2), row("worker r0 a0", "failed_attempt", 0.5, 2.5,
                                                                 status="failed:profile")])
    summary = summary.model_copy(update={"total_cost_usd": led["total_usd"]})
    out = text_report(summary, led)
    md = markdown_report(summary, led["rows"], None, cost_plot=False)
    assert out.splitlines()[:3] == ["Zooid run run-failed-04: failed", "failed: no epoch completed",
                                    "wall time 3.20 s (predicted -); total cost $0.0000624 (predicted -)"]
    assert "No plan was made." in out and "No plan was made." in md
    for rendering in (out, md):
        assert not any(r in rendering for r in ("None", "()", "[]", "True", "False"))
    assert all(len(line) <= MAX_WIDTH for line in out.splitlines())
