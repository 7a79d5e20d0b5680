"""Whether a pipeline schedule (`core.schedules`) can run: `validate` checks it by
simulating its dependencies and, on failure, raises `ScheduleError` whose message prints the
grid with the offending step in brackets.

The dependency rules (`_data_deps`: a RECV waits for its SEND, an unlowered step for the
neighbouring stage's step, a SYNC for its stage's backwards) are also what
`core.schedule_costs.simulate` replays with durations.
"""
from __future__ import annotations

from typing import Iterable, Mapping

from core.schedules import (TRANSFER, Action, Kind, Layout, Schedule, ScheduleError, _row_label, _transfers_needed,
                            format_grid, layout)


def validate(schedule: Schedule) -> None:
    """Raise `ScheduleError` (grid with the bad step marked) unless `schedule` can run.

    Checks: actions sit on their own worker's row (`worker_of`); each model stage runs the
    same micro-batches, each forward once and (unless forward-only) each backward once
    after its forward; in a lowered schedule every transfer between workers has its partner
    on the neighbouring stage, on the right side of its compute step (and stages sharing a
    worker have none), and a stage's SYNC follows its backwards; finally the schedule is run
    by dependency resolution (a RECV waits for its SEND, an unlowered step for the
    neighbouring stage's step) and a state where no worker can move is reported as deadlock.
    """
    if not schedule or not all(schedule):
        raise ScheduleError("needs at least one stage and one action per stage")
    index = _index_actions(schedule)
    _check_structure(schedule, index)
    _check_progress(schedule, index)


def _fail(schedule: Schedule, marks: Iterable[tuple[int, int]], problem: str):
    raise ScheduleError(f"{problem}\n{format_grid(schedule, marks)}")


def _index_actions(schedule: Schedule) -> dict[Action, tuple[int, int]]:
    lay = layout(schedule)
    index: dict[Action, tuple[int, int]] = {}
    for w, row in enumerate(schedule):
        for i, a in enumerate(row):
            if lay.worker_of(a.stage) != w:
                where = (f"stage {w}" if lay.chunks == 1 else
                         f"worker {w} (stage {a.stage} runs on worker {lay.worker_of(a.stage)})")
                _fail(schedule, [(w, i)], f"action {a} is on the row of {where}")
            if a in index:
                _fail(schedule, [index[a], (w, i)], f"action {a} appears twice")
            index[a] = (w, i)
    return index


def _check_structure(schedule: Schedule, index: dict[Action, tuple[int, int]]) -> None:
    lay = layout(schedule)
    forwards = {a.microbatch for a in schedule[0] if a.stage == 0 and a.kind is Kind.F}
    backwards = forwards if any(a.kind is Kind.B for row in schedule for a in row) else set()
    lowered = any(a.kind in TRANSFER for row in schedule for a in row)
    for s in range(lay.stages):
        w = lay.worker_of(s)
        row = schedule[w]
        for kind, wanted in ((Kind.F, forwards), (Kind.B, backwards)):
            have = {a.microbatch for a in row if a.stage == s and a.kind is kind}
            if have != wanted:
                odd = sorted(have ^ wanted)[0]
                pos = index.get(Action(s, kind, odd), (w, len(row) - 1))
                _fail(schedule, [pos], f"stage {s} runs {kind.value} for micro-batches "
                      f"{sorted(have)}, stage 0 for {sorted(wanted)} (micro-batch {odd})")
    for w, row in enumerate(schedule):
        for i, a in enumerate(row):
            if a.kind is Kind.B and index[Action(a.stage, Kind.F, a.microbatch)][1] > i:
                _fail(schedule, [(w, i)], f"{a} comes before its forward")
            if a.kind is Kind.SYNC and any(
                    b.kind is Kind.B and b.stage == a.stage and j > i for j, b in enumerate(row)):
                _fail(schedule, [(w, i)], f"{a} comes before a backward of stage {a.stage}")
            if a.kind in TRANSFER:
                _check_transfer(schedule, index, a, (w, i), lay)
        if lowered:
            for i, a in enumerate(row):
                for need in _transfers_needed(a, lay):
                    if need not in index:
                        _fail(schedule, [(w, i)], f"{a} lacks its transfer {need}")


_PARTNER = {  # kind -> (partner kind, partner stage offset, own compute kind, compute after?)
    Kind.SEND_F: (Kind.RECV_F, +1, Kind.F, False),
    Kind.RECV_F: (Kind.SEND_F, -1, Kind.F, True),
    Kind.SEND_B: (Kind.RECV_B, -1, Kind.B, False),
    Kind.RECV_B: (Kind.SEND_B, +1, Kind.B, True),
}


def _check_transfer(schedule, index, a: Action, pos, lay: Layout) -> None:
    partner_kind, offset, compute_kind, compute_after = _PARTNER[a.kind]
    peer = a.stage + offset
    if not 0 <= peer <= lay.last:
        _fail(schedule, [pos], f"{a} has no stage {peer} to talk to")
    if not lay.remote(a.stage, peer):
        _fail(schedule, [pos], f"{a} is not a transfer: stages {a.stage} and {peer} share "
              f"worker {lay.worker_of(peer)}, which hands the tensor over in memory")
    partner = Action(peer, partner_kind, a.microbatch)
    if partner not in index:
        _fail(schedule, [pos], f"{a} has no matching {partner}")
    compute = index.get(Action(a.stage, compute_kind, a.microbatch))
    if compute is None or (compute[1] < pos[1]) == compute_after:
        side = "before" if compute_after else "after"
        _fail(schedule, [pos], f"{a} must come {side} {a.stage}{compute_kind.value}{a.microbatch}")


def _data_deps(a: Action, index: Mapping[Action, tuple[int, int]], lay: Layout) -> list[Action]:
    """Actions on other resources that must finish before `a` can start."""
    s, m = a.stage, a.microbatch
    needed = _transfers_needed(a, lay)
    lowered_here = any(t in index for t in needed)
    if a.kind is Kind.RECV_F:
        return [Action(s - 1, Kind.SEND_F, m)]
    if a.kind is Kind.RECV_B:
        return [Action(s + 1, Kind.SEND_B, m)]
    if a.kind is Kind.SEND_F:
        return [Action(s, Kind.F, m)]
    if a.kind is Kind.SEND_B:
        return [Action(s, Kind.B, m)]
    if a.kind is Kind.F and s > 0:
        recv = Action(s, Kind.RECV_F, m)
        return [recv if lowered_here and recv in needed else Action(s - 1, Kind.F, m)]
    if a.kind is Kind.B:
        deps = [Action(s, Kind.F, m)]
        if s < lay.last:
            recv = Action(s, Kind.RECV_B, m)
            deps.append(recv if lowered_here and recv in needed else Action(s + 1, Kind.B, m))
        return deps
    if a.kind is Kind.SYNC:
        return [b for b in index if b.stage == s and b.kind is Kind.B]
    return []


def _check_progress(schedule: Schedule, index: dict[Action, tuple[int, int]]) -> None:
    """Run every worker in order; a SEND never blocks, anything else waits for its deps."""
    lay = layout(schedule)
    done: set[Action] = set()
    pcs = [0] * len(schedule)
    moved = True
    while moved:
        moved = False
        for w, row in enumerate(schedule):
            while pcs[w] < len(row) and all(d in done for d in _data_deps(row[pcs[w]], index, lay)):
                done.add(row[pcs[w]])
                pcs[w] += 1
                moved = True
    stuck = [(w, pc) for w, pc in enumerate(pcs) if pc < len(schedule[w])]
    if stuck:
        names = ", ".join(str(schedule[w][pc]) for w, pc in stuck)
        _fail(schedule, stuck, f"deadlock: no {_row_label(schedule)} can proceed ({names} wait forever)")
