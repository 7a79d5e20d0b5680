"""Synchronisation time models and the worker scaling policies."""
from __future__ import annotations

import random

import pytest

from core.errors import PlannerInputError
from planners.worker_count import parse_provision, plan_provision
from planners.scaling import EpochRecord, ScalingSettings, decide
from planners.sync_time import parameter_server, pipelined_scatter_reduce, ring_allreduce, scatter_reduce, sync_time

# --- sync-time -----------------------------------------------------------------------------

def test_sync_time_command_matches_the_contract_formulas():
    rng = random.Random(17)
    for _ in range(200):
        doc = {"algorithm": rng.choice(["scatter_reduce", "pipelined_scatter_reduce"]),
               "bytes": rng.uniform(1, 1e9), "workers": rng.randint(1, 64),
               "bandwidth_bytes_per_s": rng.uniform(1e6, 1e9), "latency_s": rng.uniform(0, 0.1)}
        s, n, w, lat = doc["bytes"], doc["workers"], doc["bandwidth_bytes_per_s"], doc["latency_s"]
        if n == 1:
            expected = 0.0
        elif doc["algorithm"] == "scatter_reduce":
            expected = 3 * s / w - 2 * s / (n * w) + 4 * lat
        else:
            expected = 2 * s / w + (2 + n) * lat
        assert sync_time(doc)["time_s"] == pytest.approx(expected, rel=1e-12)


def test_sync_models_by_hand():
    # 4 workers, 100 MB at 10 MB/s, 50 ms latency
    assert scatter_reduce(1e8, 4, 1e7, 0.05) == pytest.approx(30 - 5 + 0.2)
    assert pipelined_scatter_reduce(1e8, 4, 1e7, 0.05) == pytest.approx(20 + 0.3)
    assert ring_allreduce(1e8, 4, 1e7, 0.0, 0.01) == pytest.approx(6 * (2.5 + 0.01))
    assert parameter_server(1e8, 4, 2, 1e7, "BSP") == pytest.approx(2 * 1e8 * 4 / 2e7)
    assert parameter_server(1e8, 4, 2, 1e7, "ASP") == pytest.approx(2 * 1e8 / 2e7)
    for model in (scatter_reduce, pipelined_scatter_reduce):
        assert model(1e8, 1, 1e7, 0.05) == 0.0
    with pytest.raises(ValueError, match="mode"):
        parameter_server(1, 2, 1, 1.0, "SSP")


# --- scaling policies ------------------------------------------------------------------------

def record(epoch: int, workers: int, samples_per_s: float, **kw) -> EpochRecord:
    return EpochRecord(epoch=epoch, workers=workers, seconds=kw.pop("seconds", 100.0),
                       samples_per_s=samples_per_s, val_loss=1.0, val_accuracy=0.5,
                       cost_usd=kw.pop("cost_usd", 1.0), **kw)


def test_static_keeps_the_initial_count():
    settings = ScalingSettings(initial_workers=3, max_workers=8, lr=0.05)
    history = [record(e, 3, 10.0 * e) for e in range(5)]
    decision = decide("static", history, settings)
    assert (decision.workers, decision.lr) == (3, 0.05)


def test_adabatch_doubles_every_e_epochs_and_decays_lr():
    settings = ScalingSettings(initial_workers=1, max_workers=16, lr=1e-3, double_every_epochs=5)
    seen = []
    for epochs_done in range(0, 31):
        d = decide("adabatch", [record(e, 1, 1.0) for e in range(epochs_done)], settings)
        seen.append((d.workers, d.lr))
    assert [w for w, _ in seen[:5]] == [1] * 5
    assert seen[5] == (2, pytest.approx(0.75e-3))
    assert seen[10] == (4, pytest.approx(0.75 ** 2 * 1e-3))
    assert seen[20] == (16, pytest.approx(0.75 ** 4 * 1e-3))
    assert seen[30] == seen[20]  # capped at the maximum: no more doublings, no more decay
    capped = ScalingSettings(initial_workers=3, max_workers=8, double_every_epochs=1, lr=1.0)
    d = decide("adabatch", [record(e, 3, 1.0) for e in range(4)], capped)
    assert (d.workers, d.lr) == (8, pytest.approx(0.75 ** 2))  # 3 -> 6 -> 8


def test_reactive_grows_while_throughput_improves_then_backs_off_and_holds():
    settings = ScalingSettings(initial_workers=2, max_workers=10, drop_threshold=0.2)
    assert decide("reactive", [], settings).workers == 2
    h = [record(0, 2, 100.0)]
    assert decide("reactive", h, settings).workers == 3
    h.append(record(1, 3, 140.0))
    assert decide("reactive", h, settings).workers == 4
    h.append(record(2, 4, 139.0))  # the fourth worker did not help: back to 3
    assert decide("reactive", h, settings).workers == 3
    h.append(record(3, 3, 141.0))  # and hold there
    assert decide("reactive", h, settings).workers == 3
    h.append(record(4, 3, 100.0))  # a drop of more than 20 %: remove one
    d = decide("reactive", h, settings)
    assert d.workers == 2 and "fell" in d.reason
    h2 = [record(0, 2, 100.0), record(1, 3, 85.0)]  # fell 15 %: within the threshold
    assert decide("reactive", h2, settings).workers == 2


def test_bounds_apply_to_every_policy():
    settings = ScalingSettings(min_workers=2, max_workers=3, initial_workers=1)
    history = [record(0, 3, 10.0), record(1, 3, 11.0)]
    for policy in ("static", "adabatch", "reactive"):
        d = decide(policy, history, settings)
        assert 2 <= d.workers <= 3
    assert decide("static", [], settings).workers == 2
    assert "bounded" in decide("reactive", history, settings).reason


PROVISION = {"mode": "ASP", "w_iter_flops": 4e9, "g_param_bytes": 1e6, "c_prof_flops": 1e8,
             "b_prof_bytes_per_s": 1e6, "c_base_flops": 4e9,
             "loss_model": {"beta0": 100.0, "beta1": 0.0}, "target_loss": 0.1,
             "instance_types": [{"name": "m", "cpu_flops": 4e9, "bandwidth_bytes_per_s": 1e8,
                                 "price_per_hour": 0.36}]}


def test_deadline_reprovisions_with_what_remains():
    # ASP: a worker's step takes 1.02 s and the steps needed fall as 1 / sqrt(n), so cost
    # grows with n and the cheapest plan is the fewest workers that meet the deadline
    settings = ScalingSettings(max_workers=32, deadline_s=3000.0, budget_usd=100.0,
                               provision=PROVISION)
    fresh = decide("deadline", [], settings)
    assert fresh.workers == 1  # 1000 steps in 1020 s
    history = [record(0, 1, 50.0, seconds=1400.0, iterations=50),
               record(1, 1, 50.0, seconds=1400.0, iterations=50)]
    d = decide("deadline", history, settings)
    # the same as provisioning the remaining 200 s with the 100 steps done taken off
    doc = dict(PROVISION, deadline_s=200.0, max_workers=32,
               loss_model={"beta0": 100.0, "beta1": 100.0})
    plan = plan_provision(parse_provision(doc))
    assert d.workers == plan.workers > fresh.workers
    assert f"{plan.workers} workers" in d.reason and "over the remaining budget" not in d.reason
    broke = ScalingSettings(max_workers=32, deadline_s=3000.0, budget_usd=2.0,
                            provision=PROVISION)
    assert "over the remaining budget" in decide("deadline", history, broke).reason
    late = decide("deadline", [record(0, 4, 50.0, seconds=3000.0)], settings)
    assert late.workers == 32 and "passed" in late.reason
    tight = ScalingSettings(max_workers=2, deadline_s=10.0, provision=PROVISION)
    assert "no plan" in decide("deadline", [], tight).reason


def test_invalid_policy_and_settings_name_the_field():
    with pytest.raises(ValueError) as err:
        decide("elastic", [], ScalingSettings())
    assert str(err.value).startswith("scaling:")
    for kwargs, field in [({"min_workers": 0}, "min_workers"),
                          ({"min_workers": 5, "max_workers": 4}, "min_workers"),
                          ({"lr": -1.0}, "lr"), ({"drop_threshold": 1.5}, "drop_threshold"),
                          ({"deadline_s": 0.0}, "deadline_s")]:
        with pytest.raises(PlannerInputError) as err:
            ScalingSettings(**kwargs)
        assert err.value.field == field
    with pytest.raises(PlannerInputError) as err:
        decide("deadline", [], ScalingSettings())
    assert err.value.field == "deadline_s"
