"""Pipeline schedules as data: per stage worker, a list of actions that round-trips through text.

An action is `<stage><kind><micro-batch>`:

- `0F3` / `0B3`: stage 0 runs the forward / backward pass of micro-batch 3;
- `0SEND_F3` / `1RECV_F3`: stage 0 uploads the activation of micro-batch 3, stage 1 downloads it;
- `1SEND_B3` / `0RECV_B3`: stage 1 uploads the gradient of its input, stage 0 downloads it;
- `0SYNC`: stage 0 averages its gradients with the other replicas of stage 0 (no micro-batch).

`gpipe` builds the compute-only schedule (FuncPipe Sec. 3.2, Fig. 3: every forward, then every
backward); `lower` is a pure pass that adds the transfers and the per-stage sync; `validate`
checks a schedule by simulating its dependencies and, on failure, raises `ScheduleError` whose
message prints the grid with the offending step in brackets; `simulate` replays a schedule
with per-action durations on three resources per stage (compute, upload link, download link,
as the executor's three threads) and reports timelines, makespan and bubble shares.
"""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

from training.errors import ZooidValueError


class Kind(str, enum.Enum):
    """What an action does."""

    F = "F"
    B = "B"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    SYNC = "SYNC"


COMPUTE = (Kind.F, Kind.B)
TRANSFER = (Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B)
_ACTION = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|SYNC|F|B)(\d*)$")


@dataclass(frozen=True, slots=True)
class Action:
    """One step of one stage worker's schedule."""

    stage: int
    kind: Kind
    microbatch: int | None = None
    """Micro-batch index; None only for SYNC."""

    def __str__(self) -> str:
        mb = "" if self.microbatch is None else str(self.microbatch)
        return f"{self.stage}{self.kind.value}{mb}"

    @classmethod
    def parse(cls, text: str) -> "Action":
        """The action `str(action)` printed; raises `ScheduleError` for anything else."""
        match = _ACTION.match(text.strip())
        if not match:
            raise ScheduleError(f"cannot parse action {text!r} (expected e.g. 0F3, 1RECV_B2, 0SYNC)")
        stage, kind, mb = int(match[1]), Kind(match[2]), match[3]
        if (kind is Kind.SYNC) != (mb == ""):
            raise ScheduleError(f"action {text!r}: SYNC takes no micro-batch, every other kind needs one")
        return cls(stage, kind, int(mb) if mb else None)


Schedule = list[list[Action]]
"""Index = stage; each stage worker runs its list in order."""


class ScheduleError(ZooidValueError):
    """A schedule that cannot run; the message shows the grid with the bad step marked."""

    def __init__(self, message: str):
        super().__init__("schedule", message)


def parse_schedule(rows: Iterable[str]) -> Schedule:
    """Parse one whitespace-separated line of actions per stage."""
    return [[Action.parse(tok) for tok in row.split()] for row in rows]


def format_schedule(schedule: Schedule) -> list[str]:
    """One whitespace-separated line per stage; the inverse of `parse_schedule`."""
    return [" ".join(str(a) for a in row) for row in schedule]


def gpipe(stages: int, microbatches: int) -> Schedule:
    """GPipe order per stage: forwards of every micro-batch, then their backwards."""
    _check_positive(stages=stages, microbatches=microbatches)
    return [[Action(s, Kind.F, m) for m in range(microbatches)]
            + [Action(s, Kind.B, m) for m in range(microbatches)] for s in range(stages)]


def forward_only(stages: int, microbatches: int) -> Schedule:
    """Forwards only (validation through the pipeline)."""
    _check_positive(stages=stages, microbatches=microbatches)
    return [[Action(s, Kind.F, m) for m in range(microbatches)] for s in range(stages)]


def lower(schedule: Schedule, sync: bool = True) -> Schedule:
    """Add the transfers a compute schedule implies, and a SYNC after each stage's last
    backward when `sync` (and the schedule has backwards). Pure: returns a new schedule."""
    last = len(schedule) - 1
    lowered: Schedule = []
    for s, row in enumerate(schedule):
        out: list[Action] = []
        for a in row:
            if a.kind is Kind.F and s > 0:
                out.append(Action(s, Kind.RECV_F, a.microbatch))
            if a.kind is Kind.B and s < last:
                out.append(Action(s, Kind.RECV_B, a.microbatch))
            out.append(a)
            if a.kind is Kind.F and s < last:
                out.append(Action(s, Kind.SEND_F, a.microbatch))
            if a.kind is Kind.B and s > 0:
                out.append(Action(s, Kind.SEND_B, a.microbatch))
        if sync and any(a.kind is Kind.B for a in row):
            out.append(Action(s, Kind.SYNC))
        lowered.append(out)
    return lowered


def format_grid(schedule: Schedule, marks: Iterable[tuple[int, int]] = ()) -> str:
    """The schedule as a table (stage rows, step columns); `(stage, step)` cells in
    `marks` are shown in brackets."""
    marks = set(marks)
    width = max([len(str(a)) for row in schedule for a in row] + [4]) + 2
    steps = max([len(row) for row in schedule] + [0])
    lines = ["step    " + "".join(str(i).center(width) for i in range(steps))]
    for s, row in enumerate(schedule):
        cells = [(f"[{a}]" if (s, i) in marks else f" {a} ").center(width)
                 for i, a in enumerate(row)]
        lines.append(f"stage {s:<2}" + "".join(cells))
    return "\n".join(lines)


def validate(schedule: Schedule) -> None:
    """Raise `ScheduleError` (grid with the bad step marked) unless `schedule` can run.

    Checks: actions sit on their own stage's row; each stage runs the same micro-batches,
    each forward once and (unless forward-only) each backward once after its forward; in a
    lowered schedule every transfer has its partner on the neighbouring stage, on the right
    side of its compute step, and SYNC follows every backward; finally the schedule is run
    by dependency resolution (a RECV waits for its SEND, an unlowered step for the
    neighbouring stage's step) and a state where no stage can move is reported as deadlock.
    """
    if not schedule or not all(schedule):
        raise ScheduleError("needs at least one stage and one action per stage")
    index = _index_actions(schedule)
    _check_structure(schedule, index)
    _check_progress(schedule, index)


def _fail(schedule: Schedule, marks: Iterable[tuple[int, int]], problem: str):
    raise ScheduleError(f"{problem}\n{format_grid(schedule, marks)}")


def _index_actions(schedule: Schedule) -> dict[Action, tuple[int, int]]:
    index: dict[Action, tuple[int, int]] = {}
    for s, row in enumerate(schedule):
        for i, a in enumerate(row):
            if a.stage != s:
                _fail(schedule, [(s, i)], f"action {a} is on the row of stage {s}")
            if a in index:
                _fail(schedule, [index[a], (s, i)], f"action {a} appears twice")
            index[a] = (s, i)
    return index


def _check_structure(schedule: Schedule, index: dict[Action, tuple[int, int]]) -> None:
    last = len(schedule) - 1
    forwards = {a.microbatch for a in schedule[0] if a.kind is Kind.F}
    backwards = forwards if any(a.kind is Kind.B for row in schedule for a in row) else set()
    lowered = any(a.kind in TRANSFER for row in schedule for a in row)
    for s, row in enumerate(schedule):
        for kind, wanted in ((Kind.F, forwards), (Kind.B, backwards)):
            have = {a.microbatch for a in row if a.kind is kind}
            if have != wanted:
                odd = sorted(have ^ wanted)[0]
                pos = index.get(Action(s, kind, odd), (s, len(row) - 1))
                _fail(schedule, [pos], f"stage {s} runs {kind.value} for micro-batches "
                      f"{sorted(have)}, stage 0 for {sorted(wanted)} (micro-batch {odd})")
        for i, a in enumerate(row):
            if a.kind is Kind.B and index[Action(s, Kind.F, a.microbatch)][1] > i:
                _fail(schedule, [(s, i)], f"{a} comes before its forward")
            if a.kind is Kind.SYNC and any(
                    b.kind is Kind.B and j > i for j, b in enumerate(row)):
                _fail(schedule, [(s, i)], f"{a} comes before a backward of stage {s}")
            if a.kind in TRANSFER:
                _check_transfer(schedule, index, a, (s, i), last)
        if lowered:
            for i, a in enumerate(row):
                for need in _transfers_needed(a, last):
                    if need not in index:
                        _fail(schedule, [(s, i)], f"{a} lacks its transfer {need}")


def _transfers_needed(a: Action, last: int) -> list[Action]:
    """The transfers a compute step of a lowered schedule must have on its own stage."""
    s, m = a.stage, a.microbatch
    need = []
    if a.kind is Kind.F:
        need += [Action(s, Kind.RECV_F, m)] if s > 0 else []
        need += [Action(s, Kind.SEND_F, m)] if s < last else []
    if a.kind is Kind.B:
        need += [Action(s, Kind.RECV_B, m)] if s < last else []
        need += [Action(s, Kind.SEND_B, m)] if s > 0 else []
    return need


_PARTNER = {  # kind -> (partner kind, partner stage offset, own compute kind, compute after?)
    Kind.SEND_F: (Kind.RECV_F, +1, Kind.F, False),
    Kind.RECV_F: (Kind.SEND_F, -1, Kind.F, True),
    Kind.SEND_B: (Kind.RECV_B, -1, Kind.B, False),
    Kind.RECV_B: (Kind.SEND_B, +1, Kind.B, True),
}


def _check_transfer(schedule, index, a: Action, pos, last: int) -> None:
    partner_kind, offset, compute_kind, compute_after = _PARTNER[a.kind]
    peer = a.stage + offset
    if not 0 <= peer <= last:
        _fail(schedule, [pos], f"{a} has no stage {peer} to talk to")
    partner = Action(peer, partner_kind, a.microbatch)
    if partner not in index:
        _fail(schedule, [pos], f"{a} has no matching {partner}")
    compute = index.get(Action(a.stage, compute_kind, a.microbatch))
    if compute is None or (compute[1] < pos[1]) == compute_after:
        side = "before" if compute_after else "after"
        _fail(schedule, [pos], f"{a} must come {side} {a.stage}{compute_kind.value}{a.microbatch}")


def _data_deps(a: Action, index: Mapping[Action, tuple[int, int]], last: int) -> list[Action]:
    """Actions on other resources that must finish before `a` can start."""
    s, m = a.stage, a.microbatch
    lowered_here = any(t in index for t in _transfers_needed(a, last))
    if a.kind is Kind.RECV_F:
        return [Action(s - 1, Kind.SEND_F, m)]
    if a.kind is Kind.RECV_B:
        return [Action(s + 1, Kind.SEND_B, m)]
    if a.kind is Kind.SEND_F:
        return [Action(s, Kind.F, m)]
    if a.kind is Kind.SEND_B:
        return [Action(s, Kind.B, m)]
    if a.kind is Kind.F and s > 0:
        return [Action(s, Kind.RECV_F, m) if lowered_here else Action(s - 1, Kind.F, m)]
    if a.kind is Kind.B:
        deps = [Action(s, Kind.F, m)]
        if s < last:
            deps.append(Action(s, Kind.RECV_B, m) if lowered_here else Action(s + 1, Kind.B, m))
        return deps
    if a.kind is Kind.SYNC:
        return [b for b in index if b.stage == s and b.kind is Kind.B]
    return []


def _check_progress(schedule: Schedule, index: dict[Action, tuple[int, int]]) -> None:
    """Run every stage in order; a SEND never blocks, anything else waits for its deps."""
    last = len(schedule) - 1
    done: set[Action] = set()
    pcs = [0] * len(schedule)
    moved = True
    while moved:
        moved = False
        for s, row in enumerate(schedule):
            while pcs[s] < len(row) and all(d in done for d in _data_deps(row[pcs[s]], index, last)):
                done.add(row[pcs[s]])
                pcs[s] += 1
                moved = True
    stuck = [(s, pc) for s, pc in enumerate(pcs) if pc < len(schedule[s])]
    if stuck:
        names = ", ".join(str(schedule[s][pc]) for s, pc in stuck)
        _fail(schedule, stuck, f"deadlock: no stage can proceed ({names} wait forever)")


@dataclass(frozen=True, slots=True)
class Interval:
    """One action's place on a simulated timeline."""

    action: Action
    resource: str
    """`compute`, `upload`, `download` or `sync`."""
    start: float
    end: float


@dataclass(frozen=True, slots=True)
class Simulation:
    """What `simulate` predicts for one iteration."""

    timelines: list[list[Interval]]
    """Per stage, its actions in schedule order."""
    makespan: float
    """Time from the first start to the last end."""
    bubble: list[float]
    """Per stage, the share of the makespan its compute thread is idle."""

    @property
    def mean_bubble(self) -> float:
        """Bubble share averaged over stages."""
        return sum(self.bubble) / len(self.bubble)


Durations = Mapping[str, float] | Callable[[Action], float]


def simulate(schedule: Schedule, durations: Durations, *, handoff_s: float = 0.0,
             sync_waits_for_uploads: bool = True) -> Simulation:
    """Replay a valid schedule and return per-stage timelines, makespan and bubble shares.

    `durations` is a function of the action, or a mapping from `"<stage><kind>"` (e.g.
    `"1F"`) or `"<kind>"` (e.g. `"F"`, `"SEND_F"`) to seconds; missing kinds take 0. Each
    stage has three resources that work in parallel, as the executor's threads do: compute
    (F, B and SYNC, in schedule order), the upload link (SENDs in order) and the download
    link (RECVs in order, prefetched as soon as the matching SEND has finished).

    `handoff_s`: a receive whose download thread was already waiting when the key was
    written pays this notice delay of a polling store on top of its duration; a reader that
    is behind finds the key there and does not. `sync_waits_for_uploads`: SYNC starts only
    after the stage's earlier uploads (when it shares their link; the executor's SYNC runs
    from the compute thread and drains the uploads afterwards, so it does not wait).
    """
    validate(schedule)
    seconds = durations if callable(durations) else _lookup(durations)
    index = _index_actions(schedule)
    last = len(schedule) - 1
    end: dict[Action, float] = {}
    start: dict[Action, float] = {}
    queues = {s: {"compute": [], "upload": [], "download": []} for s in range(len(schedule))}
    for s, row in enumerate(schedule):
        for a in row:
            queues[s][_resource(a)].append(a)
    heads = {(s, r): 0 for s in queues for r in queues[s]}
    free = {(s, r): 0.0 for s in queues for r in queues[s]}
    progress = True
    while progress:
        progress = False
        for (s, r), h in heads.items():
            queue = queues[s][r]
            while h < len(queue):
                a = queue[h]
                deps = _data_deps(a, index, last)
                if a.kind is Kind.SYNC and sync_waits_for_uploads:
                    deps = deps + [u for u in queues[s]["upload"] if index[u][1] < index[a][1]]
                if not all(d in end for d in deps):
                    break
                ready = max([end[d] for d in deps], default=0.0)
                waiting = a.kind in (Kind.RECV_F, Kind.RECV_B) and free[(s, r)] <= ready
                start[a] = max(free[(s, r)], ready)
                end[a] = start[a] + (handoff_s if waiting else 0.0) + float(seconds(a))
                free[(s, r)] = end[a]
                h += 1
                progress = True
            heads[(s, r)] = h
    makespan = max(end.values()) - min(start.values())
    timelines = [[Interval(a, "sync" if a.kind is Kind.SYNC else _resource(a), start[a], end[a])
                  for a in row] for row in schedule]
    busy = [sum(i.end - i.start for i in row if i.resource == "compute") for row in timelines]
    bubble = [1.0 - b / makespan if makespan > 0 else 0.0 for b in busy]
    return Simulation(timelines=timelines, makespan=makespan, bubble=bubble)


def _resource(a: Action) -> str:
    if a.kind in (Kind.SEND_F, Kind.SEND_B):
        return "upload"
    if a.kind in (Kind.RECV_F, Kind.RECV_B):
        return "download"
    return "compute"


def _lookup(table: Mapping[str, float]) -> Callable[[Action], float]:
    def seconds(a: Action) -> float:
        return table.get(f"{a.stage}{a.kind.value}", table.get(a.kind.value, 0.0))
    return seconds


def gpipe_bubble(stages: int, microbatches: int) -> float:
    """The GPipe ideal idle share (S-1)/(M+S-1) for equal stage times and free transfers."""
    _check_positive(stages=stages, microbatches=microbatches)
    return (stages - 1) / (microbatches + stages - 1)


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise ZooidValueError(name, f"must be a positive integer, got {value!r}")


def stage_actions(schedule: Schedule, stage: int) -> Sequence[Action]:
    """The action list of one stage worker (raises `ZooidValueError` for a bad `stage`)."""
    if not 0 <= stage < len(schedule):
        raise ZooidValueError("stage", f"must be in 0..{len(schedule) - 1}, got {stage}")
    return schedule[stage]
