"""DiLoCo's outer settings follow the sync period (`core.outer_defaults`): the rule's values,
their resolution through the job into every replica's spec, and the one-line warning when
explicit settings exceed what the period bears (they are kept as given)."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from coordinator.run.job import TrainJob
from coordinator.run.outer_step import job_outer_settings, log_outer_settings
from coordinator.workers.worker_specs import worker_specs
from core.outer_defaults import max_outer_gain, max_outer_momentum, outer_gain, outer_settings, round_steps
from core.plan import Plan

EXACT = 1e-12


def test_the_bound_on_the_gain_is_k_avg_s_at_every_period():
    assert outer_gain(0.7, 0.9) == pytest.approx(7.0, rel=EXACT) and outer_gain(1.0, 0.0) == 1.0
    assert {max_outer_gain(k) for k in (1, 8, 45, 128, 500, 10_000)} == {1.0}
    assert max_outer_momentum(1) == pytest.approx(0.09, rel=EXACT)  # 0.9 (1 - 0.9)
    assert max_outer_momentum(2) == pytest.approx(0.171, rel=EXACT)  # 0.9 (1 - 0.81)


@pytest.mark.parametrize("steps, momentum", [
    (1, 0.09), (2, 0.171), (3, 0.9 * (1 - 0.729)),  # the inner momentum's room binds
    (4, 0.3), (8, 0.3), (45, 0.3), (128, 0.3),      # K-AVG's gain: 0.7 / (1 - 0.3) = 1
    (500, 0.3), (2000, 0.3),                        # at DiLoCo's 500 too (its inner lr decays; Zooid's does not)
])
def test_the_defaults_keep_diloco_s_outer_lr_and_give_the_momentum_the_period_bears(steps, momentum):
    s = outer_settings(steps)
    assert s.lr == 0.7 and s.momentum == pytest.approx(momentum, rel=EXACT, abs=EXACT)
    assert s.followed == ("outer_lr", "outer_momentum") and not s.unstable
    assert s.gain <= s.max_gain * (1 + EXACT)


def test_one_setting_given_the_other_follows_the_bound():
    assert outer_settings(250, momentum=0.9).lr == pytest.approx(0.1, rel=EXACT)  # 1 x (1 - 0.9)
    assert outer_settings(250, momentum=0.0).lr == 1.0  # K-AVG
    s = outer_settings(250, lr=0.35)
    assert s.momentum == pytest.approx(0.65, rel=EXACT)  # 1 - 0.35 / 1
    assert s.followed == ("outer_momentum",) and not s.unstable
    assert outer_settings(8, lr=1.5).momentum == 0.0 and outer_settings(8, lr=1.5).unstable  # no momentum helps


def test_a_round_is_the_period_or_the_epoch():
    assert round_steps(8, 45) == 8
    assert round_steps(None, 45) == round_steps(128, 45) == 45  # once an epoch; a longer period ends with it
    assert round_steps(None, 0) == 1


def _specs(job: TrainJob, steps: int):
    ctx = SimpleNamespace(job=job, run_id="d", store_ref="file:///tmp/x", durable_ref="file:///tmp/x",
                          resolved=SimpleNamespace(target=SimpleNamespace(remote=False), model_kwargs={}),
                          state=SimpleNamespace(dataset={"n_subsets": 8, "n_train": steps * 2 * 16}, attempts={}))
    plan = Plan(strategy="local_sgd", data_parallel=2, steps_per_epoch=steps, batch_size=16)  # an epoch of `steps`
    return worker_specs(ctx, plan, 0, "init", 0.05, 0)


def test_a_job_s_null_outer_settings_follow_its_period_into_every_spec():
    fields = TrainJob.model_json_schema()["properties"]
    assert fields["outer_lr"]["default"] is None and fields["outer_momentum"]["default"] is None
    assert "follows the sync period" in fields["outer_momentum"]["description"]
    job = TrainJob(outer_optimizer="nesterov", sync_period=2, workers=2)
    assert job.outer_lr is None and job.outer_momentum is None
    assert [(s.sync.outer_lr, pytest.approx(s.sync.outer_momentum, rel=EXACT)) for s in _specs(job, 250)] \
        == [(0.7, 0.171)] * 2
    for period in (None, 1000):  # once an epoch: the round is the epoch's steps
        job = TrainJob(outer_optimizer="nesterov", sync_period=period, workers=2)
        assert [s.sync.outer_momentum for s in _specs(job, 250)] == [pytest.approx(0.3, rel=EXACT)] * 2
        assert job_outer_settings(job, 250).steps == 250
        # a rescale that changes the epoch's steps changes the once-an-epoch round, and the momentum with it
        assert _specs(job, 1)[0].sync.outer_momentum == pytest.approx(0.09, rel=EXACT)


def test_explicit_settings_are_kept_and_an_unstable_pair_is_warned_in_one_line(caplog):
    job = TrainJob(outer_optimizer="nesterov", outer_lr=0.7, outer_momentum=0.9, sync_period=8, workers=2)
    assert {(s.sync.outer_lr, s.sync.outer_momentum) for s in _specs(job, 45)} == {(0.7, 0.9)}
    with caplog.at_level(logging.INFO, logger="coordinator.run.outer_step"):
        line = log_outer_settings(job, 45)
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [(logging.WARNING, line)]
    assert "\n" not in line and line.startswith("outer_lr and outer_momentum: outer_lr 0.7, outer_momentum 0.9 on "
                                                "8-step rounds: gain 7.00x above the 1.00x")
    assert "expect oscillation" in line and "leave outer_lr and outer_momentum null" in line
    # a pair the rounds bear: said as set, no warning
    caplog.clear()
    job = TrainJob(outer_optimizer="nesterov", outer_lr=0.5, outer_momentum=0.5, sync_period=500, workers=2)
    with caplog.at_level(logging.INFO, logger="coordinator.run.outer_step"):
        line = log_outer_settings(job, 1000)
    assert [r.levelno for r in caplog.records] == [logging.INFO] and line.endswith("as set (gain 1.00x)")


def test_the_defaults_are_said_in_one_info_line_and_k_avg_says_nothing(caplog):
    with caplog.at_level(logging.INFO, logger="coordinator.run.outer_step"):
        assert log_outer_settings(TrainJob(workers=2, sync_period=8), 45) is None
        line = log_outer_settings(TrainJob(outer_optimizer="nesterov", sync_period=8, workers=2), 45)
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [(logging.INFO, line)]
    assert line == ("outer step nesterov: outer_lr 0.7, outer_momentum 0.3 on 8-step rounds; outer_lr and "
                    "outer_momentum followed the sync period (gain 1.00x, at most 1.00x: core.outer_defaults)")
