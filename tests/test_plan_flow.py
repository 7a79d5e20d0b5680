"""The dry run profiles and plans, reports every strategy's predicted time and cost, and
provisions nothing."""
from __future__ import annotations

import pytest

from tasks.job import TrainJob

pytestmark = pytest.mark.usefixtures("prefect_api")


def test_dry_run_reports_candidates_and_provisions_nothing(tmp_path):
    from flows.plan import plan

    store = tmp_path / "store"
    chosen = plan(TrainJob(model="digits_cnn", workers=4, store=f"file://{store}"))
    strategies = {a["strategy"] for a in chosen["alternatives"]}
    assert {"local_sgd", "pipeline", "hybrid"} <= strategies
    assert sum(a["chosen"] for a in chosen["alternatives"]) == 1
    for a in chosen["alternatives"]:
        assert a["workers"] <= 4 and a["predicted_iteration_s"] > 0 and a["predicted_cost_per_epoch_usd"] > 0
        assert a["throughput_per_dollar"] > 0
    runs = list((store / "runs").glob("*")) if (store / "runs").exists() else []
    assert all(not any(r.rglob("*.*")) for r in runs)  # no data, no checkpoint, no ledger
