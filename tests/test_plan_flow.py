"""The dry run profiles and plans, reports every strategy's predicted time and cost, and
rents nothing but its one profiling worker."""
from __future__ import annotations

import pytest

from coordinator.run.job import TrainJob

pytestmark = pytest.mark.usefixtures("prefect_api")


def test_dry_run_reports_candidates_and_rents_only_its_profiling_worker(tmp_path, monkeypatch):
    """The dry run starts one worker, to profile on the target, and stops it; it trains
    nothing: no second worker, no data, checkpoint, history or ledger under its run."""
    from coordinator.workers import warm_pool
    from coordinator.workers.sweep import tagged_pids
    from flows.dry_run import plan

    started, real_start = [], warm_pool.WarmPool._start
    monkeypatch.setattr(warm_pool.WarmPool, "_start",
                        lambda self, *a, **k: started.append(self.ctx.run_id) or real_start(self, *a, **k))
    store = tmp_path / "store"
    chosen = plan(TrainJob(model="digits_cnn", workers=4, store=f"file://{store}"))
    strategies = {a["strategy"] for a in chosen["alternatives"]}
    assert {"local_sgd", "pipeline", "hybrid"} <= strategies
    assert sum(a["chosen"] for a in chosen["alternatives"]) == 1
    for a in chosen["alternatives"]:
        assert a["workers"] <= 4 and a["predicted_iteration_s"] > 0 and a["predicted_cost_per_epoch_usd"] > 0
        assert a["throughput_per_dollar"] > 0
    assert len(started) == 1  # the profiling worker, and no other
    run_id = started[0]
    assert tagged_pids(run_id) == []  # and it was stopped
    run = store / "runs" / run_id
    for kept in ("data", "ckpt", "history", "history.json", "cost.json", "summary.json"):
        assert not (run / kept).exists(), kept
    assert not list(run.rglob("*.safetensors"))  # no checkpoint anywhere under the run
