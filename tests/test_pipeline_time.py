"""The executor-faithful pipeline time model against hand-computed timelines."""
from __future__ import annotations

import pytest

from core.errors import PlannerInputError
from planners.pipeline_time import TransferCosts, pipeline_iteration, stage_times

FREE = TransferCosts(0.0, 1e30, 0.0, 1e30, 0.0)


def _stages(n: int, forward: float, backward: float, out_bytes: float = 0.0) -> list[dict]:
    return [{"forward_s": forward, "backward_s": backward, "out_bytes": out_bytes, "param_bytes": 1.0}
            for _ in range(n)]


def test_equal_stages_with_free_transfers_follow_the_gpipe_formula():
    # (M + S - 1)(F + B) + optimizer step: 6 x 3 + 0.5
    t = pipeline_iteration(_stages(3, 1.0, 2.0), 4, FREE, optimizer_s=[0.5] * 3)
    assert t.period_s == pytest.approx(18.5)
    assert t.makespan_s == pytest.approx(18.0)
    assert t.bubble[0] == pytest.approx(1 - 12 / 18.5)


def test_transfer_bound_pipeline_matches_the_hand_timeline():
    # puts take 3 s, gets 2 s, F = B = 1 s, two stages, two micro-batches:
    # stage 0 sends F0 [1,4], F1 [4,7]; stage 1 gets [4,6], [7,9], computes F1 [9,10],
    # B0 [10,11], B1 [11,12], sends [11,14], [14,17]; stage 0 gets [14,16], [17,19], B1 ends at 20
    costs = TransferCosts(0.0, 1.0, 0.0, 1.5, 0.0)
    t = pipeline_iteration(_stages(2, 1.0, 1.0, out_bytes=3.0), 2, costs)
    assert t.period_s == pytest.approx(20.0)
    # stage 1: first forward at 6, last upload ends at 17, plus the 2 s get of its next input
    assert t.stage_period_s[1] == pytest.approx(13.0)


def test_a_waiting_reader_pays_the_handoff_and_a_late_one_does_not():
    # as above with a 5 s hand-off: stage 1's first get waits [4, 11], its second finds the
    # key there [11, 13]; stage 0's first backward get waits [18, 25], its second [25, 27]
    costs = TransferCosts(0.0, 1.0, 0.0, 1.5, 5.0)
    t = pipeline_iteration(_stages(2, 1.0, 1.0, out_bytes=3.0), 2, costs)
    assert t.period_s == pytest.approx(28.0)
    recv = [(i.start, i.end) for row in t.simulation.timelines for i in row if i.resource == "download"]
    assert recv == [(18.0, 25.0), (25.0, 27.0), (4.0, 11.0), (11.0, 13.0)]


def test_a_long_handoff_is_paid_in_fill_and_drain_not_per_microbatch():
    hop, stages = 1.0, 3
    costs = TransferCosts(1e-4, 1e12, 1e-4, 1e12, hop)
    periods = {m: pipeline_iteration(_stages(stages, 1e-3, 1e-3), m, costs).period_s for m in (2, 8, 32)}
    for m, period in periods.items():
        assert 2 * (stages - 1) * hop < period < 2 * (stages - 1) * hop + 0.1
    assert periods[32] - periods[2] < 0.1 * hop  # (M - 1) x hop would be 30 s more


def test_put_time_occupies_the_upload_thread_once_per_tensor():
    # F = B = 0, 1 s per put: four activations leave stage 0 at 1..4 s, four gradients
    # leave stage 1 at 5..8 s
    costs = TransferCosts(1.0, 1e30, 0.0, 1e30, 0.0)
    assert pipeline_iteration(_stages(2, 0.0, 0.0), 4, costs).period_s == pytest.approx(8.0)


def test_sync_and_optimizer_step_end_each_stage_cycle():
    # stage 1: F [1,2], B [2,3], SYNC [3,3.5], +2 s optimizer -> 4.5 from its first forward;
    # stage 0: F [0,1], B [3,4], SYNC [4,7], +1 s optimizer -> 8
    t = pipeline_iteration(_stages(2, 1.0, 1.0), 1, FREE, sync_s=[3.0, 0.5], optimizer_s=[1.0, 2.0])
    assert t.stage_period_s == pytest.approx((8.0, 2.5 + 2.0))
    assert t.period_s == pytest.approx(8.0)
    syncs = [(i.start, i.end) for row in t.simulation.timelines for i in row if i.resource == "sync"]
    assert syncs == [(4.0, 7.0), (3.0, 3.5)]


def test_stage_times_scale_affinely_and_sum_per_stage():
    layers = [{"forward_s": 10.0, "backward_s": 6.0, "output_bytes": 800.0, "param_bytes": 5.0,
               "forward_fixed_s": 2.0},
              {"forward_s": 4.0, "backward_s": 8.0, "output_bytes": 400.0, "param_bytes": 0.0,
               "forward_fixed_s": 4.0, "backward_fixed_s": 4.0},
              {"forward_s": 1.0, "backward_s": 2.0, "output_bytes": 80.0, "param_bytes": 7.0}]
    # micro-batch 2 of a profile at 8 rows: t(2) = fixed + (t - fixed) / 4
    stages = stage_times(layers, [1], 2, 8)
    assert stages[0] == {"forward_s": (2.0 + 2.0) + 4.0, "backward_s": 1.5 + (4.0 + 1.0),
                         "out_bytes": 100.0, "param_bytes": 5.0}
    assert stages[1] == {"forward_s": 0.25, "backward_s": 0.5, "out_bytes": 20.0, "param_bytes": 7.0}
    # at the profile's own batch the measured times come back unchanged
    assert stage_times(layers, [], 8, 8)[0]["forward_s"] == 15.0


def test_contract_costs_and_bad_inputs():
    c = TransferCosts.from_contract(1e6, 0.01)
    assert (c.put_s(2e6), c.get_s(0.0), c.handoff_s) == (2.01, 0.01, 0.0)
    with pytest.raises(PlannerInputError, match="put_bandwidth"):
        TransferCosts(0.0, 0.0, 0.0, 1.0)
    with pytest.raises(PlannerInputError, match="sync_s"):
        pipeline_iteration(_stages(2, 1.0, 1.0), 2, FREE, sync_s=[1.0])
    with pytest.raises(PlannerInputError, match="microbatches"):
        pipeline_iteration(_stages(2, 1.0, 1.0), 0, FREE)
    layer = {"forward_s": 1.0, "backward_s": 1.0, "output_bytes": 1.0, "param_bytes": 1.0}
    with pytest.raises(PlannerInputError, match="cuts"):
        stage_times([layer, layer], [1], 1, 1)
