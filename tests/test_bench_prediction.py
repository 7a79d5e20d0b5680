"""The prediction benchmark's judgments (benchmarks/bench_prediction.py): a run's baselines come
only from other jobs' runs on its target that ended before it began; a goal is met only where
the prediction is within it and better than the baseline; the held-out set runs after the fit set
and names no model of it."""
from __future__ import annotations

import pytest

from benchmarks.bench_prediction import (
    HELD_OUT,
    IN_SAMPLE,
    Judgment,
    add_baselines,
    configurations,
    jobs_line,
    judge,
    kinds,
    noise_floor,
    run_record,
)


def _record(job: str, target: str, began: float, ended: float, billed: float, flow_s: float, kind: str = "first"):
    return {"job": job, "target": target, "began": began, "ended": ended, "billed": billed, "flow_s": flow_s,
            "kind": kind, "group": IN_SAMPLE, "cost_baseline": None, "run_s_baseline": None, "wall_s": 1.0}


def test_a_runs_baseline_is_the_median_of_other_jobs_earlier_runs_on_its_target():
    runs = [_record("a", "local", 0, 10, 1.0, 10.0), _record("b", "local", 11, 20, 3.0, 30.0),
            _record("c", "docker", 0, 5, 100.0, 99.0),  # another target: never a baseline here
            _record("a", "local", 21, 30, 1.2, 12.0),  # the same job again: its own runs are not its baseline
            _record("d", "local", 25, 40, 2.0, 20.0),  # began before the last "a" ended: only a and b count
            _record("e", "local", 41, 50, 4.0, 40.0)]
    add_baselines(runs)
    a1, b, c, a2, d, e = runs
    assert a1["cost_baseline"] is None and c["cost_baseline"] is None  # nothing of another job before them
    assert b["cost_baseline"] == pytest.approx(1.0 / 3.0 - 1)  # a's bill predicts b's
    assert a2["cost_baseline"] == pytest.approx(3.0 / 1.2 - 1) and a2["baseline_runs"] == 1  # b alone
    assert d["cost_baseline"] == pytest.approx(2.0 / 2.0 - 1) and d["baseline_runs"] == 2  # median(1.0, 3.0)
    assert e["baseline_runs"] == 4 and e["cost_baseline"] == pytest.approx(1.6 / 4.0 - 1)  # median(1, 3, 1.2, 2)
    assert e["run_s_baseline"] == pytest.approx(16.0 / 40.0 - 1)


def test_a_goal_is_met_only_within_it_and_better_than_the_baseline():
    assert Judgment("x", 3, 0.10, 0.20, 0.15).verdict == "**met**"
    assert "no better than the baseline" in Judgment("x", 3, 0.10, 0.08, 0.15).verdict
    assert "above 15 %" in Judgment("x", 3, 0.18, 0.30, 0.15).verdict
    assert Judgment("x", 3, 0.10, None, 0.15).verdict == "**met**"  # no earlier run of another job: the goal alone
    assert Judgment("x", 3, 0.10, 0.5, None).verdict == "no goal"


def test_judge_compares_prediction_and_baseline_on_the_same_runs():
    runs = [{"cost_error": 0.05, "cost_baseline": None}, {"cost_error": -0.30, "cost_baseline": 0.9},
            {"cost_error": 0.10, "cost_baseline": -0.5}]
    j = judge(runs, "bill", "cost_error", 0.2)
    assert (j.runs, j.predicted, j.baseline, j.within) == (2, pytest.approx(0.2), pytest.approx(0.7), 1)


def _summary(seconds, predicted, bill=1.0, predicted_bill=1.1):
    return {"run_id": "z1", "total_cost_usd": bill, "submitted_at": 0.0, "seen_final_at": 1.0, "flow_end_at": 30.0,
            "plan": {"strategy": "local_sgd", "data_parallel": 2, "stages": 1, "predicted_run_cost_usd": predicted_bill,
                     "planned_at": 10.0, "predicted_run_s": 22.0},
            "epochs": [{"epoch": i, "seconds": s, "predicted_epoch_s": p} for i, (s, p) in enumerate(zip(seconds, predicted))]}


def test_epoch_1_is_judged_apart_from_the_steady_epochs():
    cfg = configurations(5, docker=False)[0]
    r = run_record(cfg, "first", _summary([9.0, 1.0, 1.1, 1.0, 1.2], [9.5, 1.2, 1.0, 1.0, 1.0]))
    assert r["epoch1_baseline"] == pytest.approx(8.0) and r["epoch1_error"] == pytest.approx(0.2)
    # epochs 2..4: baseline |1.0/1.1-1|, |1.1/1.0-1|, |1.0/1.2-1|; prediction |1.0/1.1-1|, 0, |1.0/1.2-1|
    assert r["epoch_baseline"] == pytest.approx(0.1) and r["epoch_error"] == pytest.approx(1 - 1.0 / 1.1)
    assert r["cost_error"] == pytest.approx(0.1)
    assert r["flow_s"] == 20.0 and r["run_s_error"] == pytest.approx(0.1)  # from the plan to the flow run's end


def test_the_held_out_set_follows_the_fit_set_and_shares_no_model_with_it_but_a_new_worker_count():
    cfgs = configurations(5, docker=True)
    groups = [c.group for c in cfgs]
    assert groups == sorted(groups, key=[IN_SAMPLE, HELD_OUT].index)  # every fit run before any held-out one
    fit = {(c.model, c.plan) for c in cfgs if c.group == IN_SAMPLE}
    for c in cfgs:
        if c.group == HELD_OUT:
            assert (c.model, c.plan) not in fit
            assert ":" in c.model or c.model not in {m for m, _ in fit} or c.plan.startswith("adabatch")
    assert {c.target for c in cfgs if c.group == HELD_OUT} == {"local", "docker"}
    assert kinds(cfgs[0], 2) == ["fresh", "first", "repeat", "repeat"]
    assert kinds([c for c in cfgs if c.target == "docker"][0], 1) == ["first", "repeat"]


def test_the_results_file_describes_the_jobs_that_ran():
    gpu = jobs_line(configurations(5, docker=False, models=[], gpu=True), 5, 2)
    assert "`resnet18`, `vgg11` on synthetic:3x32x32:10:4096, batch 64 per replica" in gpu
    assert "digits" not in gpu and "docker" not in gpu and "In sample" not in gpu
    assert "on the process pool." in gpu and "2 x `repeat`" in gpu
    cpu = jobs_line(configurations(4, docker=True), 4, 1)
    assert "on digits, batch 16 per replica;" in cpu and "4 epochs, on the process pool and docker." in cpu
    assert "synthetic" not in cpu and "In sample: the fit set" in cpu
    assert "the docker target's second job, run after the fit set." in cpu
    assert "`fresh`" not in jobs_line([c for c in configurations(5, docker=True) if c.target == "docker"], 5, 1)


def test_the_noise_floor_pairs_runs_of_one_job_on_the_shared_store():
    runs = [dict(_record("a", "local", 0, 1, 1.0, 1.0, kind="fresh"), wall_s=5.0),
            dict(_record("a", "local", 2, 3, 1.0, 1.0), wall_s=1.0),
            dict(_record("a", "local", 4, 5, 1.5, 1.0, kind="repeat"), wall_s=1.2)]
    (n,) = noise_floor(runs)
    assert n["pairs"] == 1 and n["wall"] == pytest.approx(0.2 / 1.1) and n["bill"] == pytest.approx(0.5 / 1.25)
