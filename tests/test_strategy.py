"""Strategy choice from measured numbers: same worker budget, same global batch."""
from __future__ import annotations

import pytest

from planners.strategy import StrategyInputs, candidates, choose


def _inputs(**kw) -> StrategyInputs:
    base = dict(layers=tuple({"forward_s": 0.01, "backward_s": 0.02, "output_bytes": 4096.0,
                              "param_bytes": 4e6} for _ in range(4)),
                profile_batch=32, step_s=0.12, param_bytes=16e6, optimizer_copies=0, n_train=4096,
                batch_size=32, workers=4, stages=None, microbatches=4, sync_period=1,
                bandwidth=1e9, latency=1e-3, offer="aci-cpu", price_per_worker_s=1e-5)
    base.update(kw)
    return StrategyInputs(**base)


def test_auto_keeps_the_worker_budget_and_the_global_batch():
    x = _inputs()
    for p in candidates(x, "auto"):
        assert p.workers <= x.workers
        assert p.data_parallel * p.batch_size == x.workers * x.batch_size
        assert p.stages == 1 or p.batch_size == p.microbatches * (x.batch_size // 4)


def test_cheap_sync_picks_local_sgd_and_slow_links_pick_a_pipeline():
    fast = choose(_inputs(bandwidth=1e12, latency=1e-6), "auto")
    assert fast.strategy == "local_sgd" and fast.data_parallel == 4
    slow = choose(_inputs(bandwidth=2e6), "auto")  # 16 MB every step through a 2 MB/s store
    assert slow.strategy in ("pipeline", "hybrid") and slow.stages >= 2
    chosen = [a for a in slow.alternatives if a["chosen"]]
    assert len(chosen) == 1 and chosen[0]["strategy"] == slow.strategy
    assert min(a["predicted_iteration_s"] / (a["data_parallel"] * 1) for a in slow.alternatives) > 0


def test_forced_strategies_and_infeasible_ones():
    assert choose(_inputs(), "local_sgd").strategy == "local_sgd"
    pipe = choose(_inputs(stages=2), "pipeline")
    assert (pipe.strategy, pipe.data_parallel, pipe.stages, pipe.microbatches) == ("pipeline", 1, 2, 4)
    hyb = choose(_inputs(stages=2), "hybrid")
    assert (hyb.data_parallel, hyb.stages, hyb.batch_size) == (4, 2, 32)
    with pytest.raises(ValueError, match="strategy"):
        choose(_inputs(layers=()), "pipeline")


def test_parameter_free_layers_never_make_a_stage_of_their_own():
    from planners.strategy import merge_parameter_free

    layer = lambda p: {"forward_s": 1.0, "backward_s": 2.0, "output_bytes": 10.0 + p, "param_bytes": p}
    merged, last = merge_parameter_free([layer(0), layer(5), layer(0), layer(3), layer(0)])
    assert last == [1, 4]
    assert [m["param_bytes"] for m in merged] == [5, 3]
    assert [m["forward_s"] for m in merged] == [2.0, 3.0]
    assert merged[0]["output_bytes"] == 15.0 and merged[1]["output_bytes"] == 10.0
    x = _inputs(layers=(layer(0), layer(4e6), layer(0), layer(4e6)), bandwidth=2e6)
    for p in candidates(x, "pipeline"):
        assert all(c in (1, 3) for c in p.cuts)
