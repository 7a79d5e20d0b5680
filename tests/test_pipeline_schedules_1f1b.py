"""Schedules beyond GPipe: 1F1B and Megatron's interleaved 1F1B as data; in-flight memory
and bubble closed forms against walking and simulating the generated schedules."""
from __future__ import annotations

import pytest

from core.errors import ZooidValueError
from core.schedule_costs import ideal_bubble, ideal_peak_in_flight, peak_in_flight, simulate, worker_peak_in_flight
from core.schedule_validation import validate
from core.schedules import (Action, Kind, Layout, ScheduleError, build_schedule, format_grid, format_schedule,
                            forward_only, gpipe, interleaved, layout, lower, one_f_one_b, parse_schedule,
                            stage_actions, worker_actions, worker_of)

EQUAL = {"F": 1.0, "B": 1.0}
DOUBLE_B = {"F": 1.0, "B": 2.0}
INTERLEAVED = [(p, v, m) for p in range(1, 5) for v in range(2, 5) for m in range(p, 17, p)]


# --- golden schedules -----------------------------------------------------------------

def test_1f1b_warms_up_then_alternates_then_cools_down():
    assert format_schedule(one_f_one_b(3, 4)) == [
        "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3",   # warm-up 2, steady 2 pairs, cool-down 2
        "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3",   # warm-up 1
        "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3",   # the last stage: no warm-up
    ]


def test_1f1b_with_fewer_microbatches_than_warm_up_is_gpipe():
    assert one_f_one_b(4, 2)[0] == gpipe(4, 2)[0]


def test_interleaved_follows_megatrons_virtual_microbatch_order():
    # p = 2 workers, v = 2 chunks (model stages 0..3, worker 0 holds 0 and 2), M = 4.
    # Worker 0 warms up with 2 (p - 1) + (v - 1) p = 4 forwards, worker 1 with 2.
    assert format_schedule(interleaved(2, 2, 4)) == [
        "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3",
        "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3",
    ]


def test_interleaved_rows_hold_the_workers_chunks():
    schedule = interleaved(3, 2, 6)
    assert layout(schedule).stages == 6 and layout(schedule).chunks == 2
    for w, row in enumerate(schedule):
        assert {a.stage for a in row} == {w, w + 3}
        assert all(worker_of(a.stage, 3) == w for a in row)


def test_lowering_an_interleaved_schedule_crosses_workers_and_syncs_each_stage():
    assert format_schedule(lower(interleaved(2, 2, 2))) == [
        "0F0 0SEND_F0 0F1 0SEND_F1 2RECV_F0 2F0 2SEND_F0 2RECV_F1 2F1 2SEND_F1 "
        "2RECV_B0 2B0 2SEND_B0 2RECV_B1 2B1 2SEND_B1 0RECV_B0 0B0 0RECV_B1 0B1 2SYNC 0SYNC",
        "1RECV_F0 1F0 1SEND_F0 1RECV_F1 1F1 1SEND_F1 3RECV_F0 3F0 3B0 3SEND_B0 "
        "3RECV_F1 3F1 3B1 3SEND_B1 1RECV_B0 1B0 1SEND_B0 1RECV_B1 1B1 1SEND_B1 3SYNC 1SYNC",
    ]


def test_chunks_on_one_worker_hand_over_in_memory():
    lowered = lower(interleaved(1, 2, 2))
    assert format_schedule(lowered) == ["0F0 1F0 1B0 0F1 0B0 1F1 1B1 0B1 1SYNC 0SYNC"]
    validate(lowered)
    with pytest.raises(ScheduleError, match="0SEND_F0 is not a transfer: stages 0 and 1 share worker 0"):
        validate(parse_schedule(["0F0 0SEND_F0 1RECV_F0 1F0 1B0 0B0"]))


def test_forward_only_with_chunks_runs_each_workers_stages_in_turn():
    """Validation through an interleaved pipeline: worker w forwards every micro-batch
    through its first chunk, then its next; with one chunk it is the one-stage-per-row form."""
    assert format_schedule(forward_only(2, 2, chunks=2)) == ["0F0 0F1 2F0 2F1", "1F0 1F1 3F0 3F1"]
    assert forward_only(3, 2, chunks=1) == forward_only(3, 2) == [[Action(s, Kind.F, m) for m in range(2)]
                                                                   for s in range(3)]
    for p, v, m in [(2, 2, 3), (3, 2, 1), (1, 3, 2), (4, 2, 5)]:
        validate(lower(forward_only(p, m, chunks=v), sync=False))
    assert Layout(2, 6).stages_of(1) == [1, 3, 5] and Layout(3, 3).stages_of(2) == [2]


# --- the data model with several stages per row ---------------------------------------

def test_grid_labels_worker_rows_and_marks_cells():
    assert format_grid(interleaved(2, 2, 2), [(1, 2)]) == (
        "step       0     1     2     3     4     5     6     7   \n"
        "worker 0  0F0   0F1   2F0   2F1   2B0   2B1   0B0   0B1  \n"
        "worker 1  1F0   1F1  [3F0]  3B0   3F1   3B1   1B0   1B1  ")


@pytest.mark.parametrize("rows, problem, marked", [
    (["0F0 3F0 0B0 3B0", "1F0 2F0 1B0 2B0"],
     "action 3F0 is on the row of worker 0 (stage 3 runs on worker 1)", "[3F0]"),
    (["0F0 2F0 0B0 2B0", "1F0 3F0 1B0 3B0"], "deadlock: no worker can proceed (0B0, 1B0", "[1B0]"),
    (["0F0 2F0 2B0 0B0", "1F0 3F0 3B0"], "stage 1 runs B for micro-batches []", "3B0"),
    (["0F0 2F0 2B0 0B0 0SYNC 2SYNC", "1F0 3F0 3B0 1B0"], "", ""),
    (["0F0 2F0 0SYNC 2B0 0B0", "1F0 3F0 3B0 1B0"], "0SYNC comes before a backward of stage 0", "[0SYNC]"),
])
def test_interleaved_rows_are_checked_per_model_stage(rows, problem, marked):
    if not problem:
        validate(parse_schedule(rows))  # a SYNC need only follow its own stage's backwards
        return
    with pytest.raises(ScheduleError) as info:
        validate(parse_schedule(rows))
    first, *grid = str(info.value).splitlines()
    assert problem in first
    assert grid[0].startswith("step") and grid[1].startswith("worker 0")
    assert marked in "\n".join(grid)


def test_stage_and_worker_actions():
    schedule = interleaved(2, 2, 2)
    assert [str(a) for a in stage_actions(schedule, 3)] == ["3F0", "3B0", "3F1", "3B1"]
    assert worker_actions(schedule, 1) == schedule[1]
    assert stage_actions(gpipe(2, 2), 1) == gpipe(2, 2)[1]
    with pytest.raises(ZooidValueError, match="^stage: must be in 0..3"):
        stage_actions(schedule, 4)
    with pytest.raises(ZooidValueError, match="^worker: must be in 0..1"):
        worker_actions(schedule, 2)


# --- every generated schedule runs ------------------------------------------------------

def test_1f1b_validates_lowered_and_unlowered_up_to_8_stages_16_microbatches():
    for k in range(1, 9):
        for m in range(1, 17):
            schedule = one_f_one_b(k, m)
            validate(schedule)
            validate(lower(schedule))


def test_interleaved_validates_lowered_and_unlowered_up_to_4_workers_4_chunks():
    for p, v, m in INTERLEAVED:
        schedule = interleaved(p, v, m)
        validate(schedule)
        validate(lower(schedule))


# --- activations in flight --------------------------------------------------------------

def test_peak_in_flight_gpipe_holds_every_microbatch():
    for k, m in [(1, 1), (3, 5), (8, 16)]:
        schedule = gpipe(k, m)
        assert [peak_in_flight(schedule, s) for s in range(k)] == [m] * k
        assert ideal_peak_in_flight("gpipe", k, m, 0) == m


def test_peak_in_flight_1f1b_is_k_minus_s_capped_by_m():
    for k in range(1, 9):
        for m in range(1, 17):
            schedule = one_f_one_b(k, m)
            for s in range(k):
                assert peak_in_flight(schedule, s) == min(k - s, m)
                assert worker_peak_in_flight(schedule, s) == min(k - s, m)
                assert ideal_peak_in_flight("1f1b", k, m, s) == min(k - s, m)


def test_peak_in_flight_interleaved_per_worker_and_per_chunk():
    for p, v, m in INTERLEAVED:
        schedule = interleaved(p, v, m)
        for w in range(p):
            warm_up = min(2 * (p - w - 1) + (v - 1) * p, m * v)
            assert worker_peak_in_flight(schedule, w) == min(warm_up + 1, m * v)
            assert worker_peak_in_flight(schedule, w) == ideal_peak_in_flight("interleaved", p, m, w, v)
            for c in range(v):
                window = 2 * (v - 1 - c) * p + 2 * (p - w - 1) + 1
                expected = min(m, window // (p * v) * p + min(window % (p * v), p))
                assert peak_in_flight(schedule, c * p + w) == expected
                assert ideal_peak_in_flight("interleaved", p, m, w, v, chunk=c) == expected


def test_interleaving_costs_worker_0_p_minus_1_over_v_stage_activations_more_than_1f1b():
    p, v, m = 4, 2, 16
    chunk_sets = worker_peak_in_flight(interleaved(p, v, m), 0)
    assert chunk_sets / v == p + (p - 1) / v == 5.5
    assert worker_peak_in_flight(one_f_one_b(p, m), 0) == p
    assert [peak_in_flight(interleaved(p, v, m), s) for s in range(p * v)] == [8, 8, 7, 5, 4, 4, 3, 1]


# --- bubbles: closed forms against the simulator ----------------------------------------

@pytest.mark.parametrize("durations", [EQUAL, DOUBLE_B])
def test_1f1b_bubble_equals_gpipes(durations):
    for k in range(1, 9):
        for m in (1, 2, 3, 5, 8, 16):
            sim = simulate(one_f_one_b(k, m), durations)
            ideal = ideal_bubble("1f1b", k, m)
            assert ideal == ideal_bubble("gpipe", k, m) == pytest.approx((k - 1) / (m + k - 1))
            assert sim.makespan == pytest.approx((m + k - 1) * sum(durations.values()))
            assert sim.bubble == pytest.approx([ideal] * k)


@pytest.mark.parametrize("durations", [EQUAL, DOUBLE_B])
def test_interleaved_bubble_is_p_minus_1_over_vm_plus_p_minus_1(durations):
    for p, v, m in INTERLEAVED:
        if m > 2 * p and m != 16:
            continue  # every shape, but only M = p, 2p and 16: keeps the loop fast
        sim = simulate(interleaved(p, v, m), durations)
        ideal = ideal_bubble("interleaved", p, m, chunks=v)
        assert ideal == pytest.approx((p - 1) / (v * m + p - 1))
        assert sim.makespan == pytest.approx((v * m + p - 1) * sum(durations.values()))
        assert sim.bubble == pytest.approx([ideal] * p)


@pytest.mark.parametrize("name, chunks", [("1f1b", 1), ("interleaved", 2), ("interleaved", 3)])
def test_lowered_schedules_with_free_transfers_keep_the_ideal_bubble(name, chunks):
    for k, m in [(2, 4), (4, 8), (3, 6)]:
        sim = simulate(lower(build_schedule(name, k, m, chunks)), DOUBLE_B)
        assert sim.bubble == pytest.approx([ideal_bubble(name, k, m, chunks)] * k)


def test_interleaving_divides_the_idle_time_per_compute_time_by_v():
    def idle_per_compute(share):  # bubble time / compute time = share / (1 - share)
        return share / (1 - share)

    for p, m in [(2, 4), (4, 8), (4, 16)]:
        plain = idle_per_compute(ideal_bubble("1f1b", p, m))
        assert plain == pytest.approx((p - 1) / m)
        for v in (2, 3, 4):
            assert idle_per_compute(ideal_bubble("interleaved", p, m, v)) == pytest.approx(plain / v)
    assert ideal_bubble("interleaved", 4, 8, chunks=4) == pytest.approx(3 / 35)


# --- the entry point --------------------------------------------------------------------

def test_build_schedule_by_name():
    assert build_schedule("gpipe", 3, 4) == gpipe(3, 4)
    assert build_schedule("1f1b", 3, 4) == one_f_one_b(3, 4)
    assert build_schedule("interleaved", 2, 4, chunks=2) == interleaved(2, 2, 4)


@pytest.mark.parametrize("args, field", [
    (("zero-bubble", 2, 4), "pipeline_schedule"),
    (("GPipe", 2, 4), "pipeline_schedule"),
    (("gpipe", 0, 4), "stages"),
    (("1f1b", 2, 0), "microbatches"),
    (("1f1b", 2, 2.5), "microbatches"),
    (("gpipe", 2, 4, 2), "chunks"),
    (("1f1b", 2, 4, 0), "chunks"),
    (("interleaved", 2, 4, 1), "chunks"),
    (("interleaved", 3, 4, 2), "microbatches"),
])
def test_bad_requests_name_the_parameter(args, field):
    for build in (build_schedule, ideal_bubble):
        with pytest.raises(ZooidValueError, match=f"^{field}: ") as info:
            build(*args)
        assert info.value.field == field


def test_interleaved_refuses_one_chunk_and_ragged_microbatches():
    with pytest.raises(ZooidValueError, match="^chunks: must be >= 2"):
        interleaved(2, 1, 4)
    with pytest.raises(ZooidValueError, match="^microbatches: must be a multiple of the 2 workers"):
        interleaved(2, 2, 3)


def test_ideal_peak_refuses_a_bad_worker_or_chunk():
    with pytest.raises(ZooidValueError, match="^worker: "):
        ideal_peak_in_flight("1f1b", 2, 4, 2)
    with pytest.raises(ZooidValueError, match="^chunk: "):
        ideal_peak_in_flight("interleaved", 2, 4, 0, chunks=2, chunk=2)
    with pytest.raises(ZooidValueError, match="^stage: "):
        peak_in_flight(gpipe(2, 2), 2)


def test_actions_name_model_stages_beyond_the_worker_count():
    assert Action.parse("5RECV_B3") == Action(5, Kind.RECV_B, 3)
