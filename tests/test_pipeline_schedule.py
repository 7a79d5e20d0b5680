"""Schedules as data: golden strings, validation errors that print the grid, simulation."""
from __future__ import annotations

import pytest
from torch import nn

from core.errors import ZooidValueError
from core.schedule_costs import gpipe_bubble, simulate
from core.schedule_validation import validate
from core.schedules import (Action, Kind, ScheduleError, format_grid, format_schedule, forward_only, gpipe, lower,
                            parse_schedule)
from engine.stages import assemble_full_state, slice_full_state, split_stages, stage_state_dicts

# --- actions and golden schedules -------------------------------------------------------

@pytest.mark.parametrize("text, action", [
    ("0F3", Action(0, Kind.F, 3)), ("12B0", Action(12, Kind.B, 0)),
    ("0SEND_F3", Action(0, Kind.SEND_F, 3)), ("1RECV_F3", Action(1, Kind.RECV_F, 3)),
    ("1SEND_B3", Action(1, Kind.SEND_B, 3)), ("0RECV_B3", Action(0, Kind.RECV_B, 3)),
    ("2SYNC", Action(2, Kind.SYNC)),
])
def test_actions_round_trip_through_strings(text, action):
    assert Action.parse(text) == action
    assert str(action) == text


@pytest.mark.parametrize("text", ["F3", "0X3", "0F", "0SYNC3", "0F-1", ""])
def test_malformed_actions_are_refused(text):
    with pytest.raises(ScheduleError, match="schedule"):
        Action.parse(text)


def test_gpipe_runs_every_forward_then_every_backward():
    assert format_schedule(gpipe(2, 4)) == [
        "0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3",
        "1F0 1F1 1F2 1F3 1B0 1B1 1B2 1B3",
    ]


def test_lowering_adds_transfers_around_compute_and_a_sync_per_stage():
    compute = gpipe(3, 2)
    before = format_schedule(compute)
    assert format_schedule(lower(compute)) == [
        "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 0SYNC",
        "1RECV_F0 1F0 1SEND_F0 1RECV_F1 1F1 1SEND_F1 1RECV_B0 1B0 1SEND_B0 1RECV_B1 1B1 1SEND_B1 1SYNC",
        "2RECV_F0 2F0 2RECV_F1 2F1 2B0 2SEND_B0 2B1 2SEND_B1 2SYNC",
    ]
    assert format_schedule(compute) == before  # lowering is pure


def test_forward_only_lowering_has_no_backward_and_no_sync():
    assert format_schedule(lower(forward_only(2, 3))) == [
        "0F0 0SEND_F0 0F1 0SEND_F1 0F2 0SEND_F2",
        "1RECV_F0 1F0 1RECV_F1 1F1 1RECV_F2 1F2",
    ]


def test_parse_and_format_are_inverse():
    rows = format_schedule(lower(gpipe(4, 3)))
    assert format_schedule(parse_schedule(rows)) == rows


@pytest.mark.parametrize("stages, microbatches", [(0, 2), (2, 0), (2, 1.5)])
def test_gpipe_sizes_must_be_positive_integers(stages, microbatches):
    with pytest.raises(ZooidValueError):
        gpipe(stages, microbatches)


# --- validation -------------------------------------------------------------------------

def test_generated_schedules_validate():
    for s, m in [(1, 1), (2, 4), (4, 8)]:
        validate(gpipe(s, m))
        validate(lower(gpipe(s, m)))
        validate(lower(forward_only(s, m)))


def test_deadlock_prints_the_grid_with_the_stuck_steps_marked():
    bad = parse_schedule(["0F0 0B0 0F1 0B1", "1F1 1F0 1B0 1B1"])
    with pytest.raises(ScheduleError) as info:
        validate(bad)
    assert str(info.value) == (
        "schedule: deadlock: no stage can proceed (0B0, 1F1 wait forever)\n"
        "step      0     1     2     3   \n"
        "stage 0  0F0  [0B0]  0F1   0B1  \n"
        "stage 1 [1F1]  1F0   1B0   1B1  ")


@pytest.mark.parametrize("rows, problem, marked", [
    (["0F0 0SEND_F0 0RECV_B0 0B0", "1F0 1B0 1SEND_B0"], "0SEND_F0 has no matching 1RECV_F0", "[0SEND_F0]"),
    (["0F0 0SEND_F0 0B0 0RECV_B0", "1RECV_F0 1F0 1B0 1SEND_B0"], "0RECV_B0 must come before 0B0", "[0RECV_B0]"),
    (["0B0 0F0", "1F0 1B0"], "0B0 comes before its forward", "[0B0]"),
    (["0F0 0SYNC 0B0", "1F0 1B0"], "0SYNC comes before a backward", "[0SYNC]"),
    (["0F0 0B0", "0F0 1B0"], "action 0F0 is on the row of stage 1", "[0F0]"),
    (["0F0 0F0 0B0", "1F0 1B0"], "action 0F0 appears twice", "[0F0]"),
    (["0F0 0F1 0B0 0B1", "1F0 1B0"], "stage 1 runs F for micro-batches [0]", "1B0"),
    (["0F0 0SEND_F0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"], "0B0 lacks its transfer 0RECV_B0", "[0B0]"),
    (["0F0 0RECV_F0 0B0", "1F0 1B0"], "0RECV_F0 has no stage -1", "[0RECV_F0]"),
])
def test_invalid_schedules_say_why_and_mark_the_step(rows, problem, marked):
    with pytest.raises(ScheduleError) as info:
        validate(parse_schedule(rows))
    first, *grid = str(info.value).splitlines()
    assert problem in first
    assert grid[0].startswith("step") and len(grid) == 1 + len(rows)
    assert marked in "\n".join(grid)


def test_grid_marks_only_the_given_cells():
    assert format_grid(parse_schedule(["0F0 0B0", "1F0 1B0"]), [(1, 0)]) == (
        "step      0     1   \n"
        "stage 0  0F0   0B0  \n"
        "stage 1 [1F0]  1B0  ")


# --- simulation -------------------------------------------------------------------------

@pytest.mark.parametrize("stages, microbatches", [(1, 4), (2, 4), (3, 5), (4, 8), (8, 2)])
@pytest.mark.parametrize("lowered", [False, True])
def test_equal_durations_give_the_gpipe_bubble(stages, microbatches, lowered):
    schedule = gpipe(stages, microbatches)
    schedule = lower(schedule) if lowered else schedule
    sim = simulate(schedule, {"F": 1.0, "B": 2.0})
    assert sim.makespan == pytest.approx(3.0 * (microbatches + stages - 1))
    ideal = (stages - 1) / (microbatches + stages - 1)
    assert gpipe_bubble(stages, microbatches) == pytest.approx(ideal)
    assert sim.bubble == pytest.approx([ideal] * stages)
    assert sim.mean_bubble == pytest.approx(ideal)


def test_transfers_overlap_compute_and_sync_starts_after_own_backward():
    """Hand-checked timeline: S = 2, M = 2, compute 1 s, each transfer 0.5 s, sync 2 s."""
    sim = simulate(lower(gpipe(2, 2)), {"F": 1, "B": 1, "SEND_F": .5, "RECV_F": .5,
                                        "SEND_B": .5, "RECV_B": .5, "SYNC": 2})
    got = [[(str(i.action), i.resource, i.start, i.end) for i in row] for row in sim.timelines]
    assert got == [
        [("0F0", "compute", 0, 1), ("0SEND_F0", "upload", 1, 1.5), ("0F1", "compute", 1, 2),
         ("0SEND_F1", "upload", 2, 2.5), ("0RECV_B0", "download", 5.5, 6), ("0B0", "compute", 6, 7),
         ("0RECV_B1", "download", 6.5, 7), ("0B1", "compute", 7, 8), ("0SYNC", "sync", 8, 10)],
        [("1RECV_F0", "download", 1.5, 2), ("1F0", "compute", 2, 3), ("1RECV_F1", "download", 2.5, 3),
         ("1F1", "compute", 3, 4), ("1B0", "compute", 4, 5), ("1SEND_B0", "upload", 5, 5.5),
         ("1B1", "compute", 5, 6), ("1SEND_B1", "upload", 6, 6.5), ("1SYNC", "sync", 6.5, 8.5)],
    ]
    assert sim.makespan == 10 and sim.bubble == pytest.approx([0.6, 0.6])


def test_per_stage_durations_override_per_kind_ones():
    sim = simulate(gpipe(2, 3), {"F": 1, "B": 1, "1F": 3, "1B": 3})
    # Stage 1 is the bottleneck: its 6 s x 3 micro-batches plus stage 0's first forward
    # and last backward.
    assert sim.makespan == pytest.approx(1 + 18 + 1)
    assert sim.bubble[1] == pytest.approx(2 / 20)


def test_simulate_refuses_an_invalid_schedule():
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(parse_schedule(["0F0 0B0 0F1 0B1", "1F1 1F0 1B0 1B1"]), {"F": 1})


# --- stages -----------------------------------------------------------------------------

class Chain(nn.Module):
    """Children run in order: splittable."""

    def __init__(self):
        super().__init__()
        self.embed, self.act, self.head = nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.act(self.embed(x)))


class Residual(Chain):
    """A skip connection: not a chain of its children."""

    def forward(self, x):
        h = self.embed(x)
        return self.head(self.act(h) + h)


def test_split_keeps_the_unsplit_models_keys_and_assembles_back():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    stages = split_stages(model, [2, 4])
    assert [list(s.state_dict()) for s in stages] == [
        ["0.weight", "0.bias"], ["2.weight", "2.bias"], ["4.weight", "4.bias"]]
    full = assemble_full_state(stage_state_dicts(stages))
    assert list(full) == list(model.state_dict())
    assert slice_full_state(model.state_dict(), stages[1]).keys() == {"2.weight", "2.bias"}


def test_split_of_an_ordered_custom_module_and_refusal_of_a_residual_one():
    assert [list(dict(s.named_children())) for s in split_stages(Chain(), [1])] == [
        ["embed"], ["act", "head"]]
    with pytest.raises(ZooidValueError, match="model: Residual.forward does not call its children"):
        split_stages(Residual(), [1])


@pytest.mark.parametrize("cuts", [[0], [5], [3, 2], [2, 2], ["2"]])
def test_bad_cuts_are_named(cuts):
    model = nn.Sequential(*[nn.ReLU() for _ in range(5)])
    with pytest.raises(ZooidValueError, match="^cuts: "):
        split_stages(model, cuts)


def test_assembling_overlapping_stages_is_refused():
    with pytest.raises(ZooidValueError, match="stage_states: stage 1 repeats"):
        assemble_full_state([{"a": 1}, {"a": 2}])
