"""Pipeline schedules as data: per stage worker, a list of actions that round-trips through text.

An action is `<stage><kind><micro-batch>`:

- `0F3` / `0B3`: stage 0 runs the forward / backward pass of micro-batch 3;
- `0SEND_F3` / `1RECV_F3`: stage 0 uploads the activation of micro-batch 3, stage 1 downloads it;
- `1SEND_B3` / `0RECV_B3`: stage 1 uploads the gradient of its input, stage 0 downloads it;
- `0SYNC`: stage 0 averages its gradients with the other replicas of stage 0 (no micro-batch).

A schedule has one row per stage worker. `stage` in an action is always the *model* stage:
with p rows and a model cut into p * v stages, model stage s runs on worker `s % p`
(`worker_of`; Megatron's placement of v non-adjacent chunks per worker). For v = 1, the
GPipe and 1F1B case, worker and stage coincide and row s holds only stage s's actions.
Two adjacent stages on one worker (only when p = 1) hand tensors over in memory: the
lowered schedule has no SEND/RECV between them.

Compute schedules: `gpipe` (FuncPipe Sec. 3.2, Fig. 3: every forward, then every backward),
`one_f_one_b` (PipeDream-Flush / Megatron 1F1B: the same bubble with at most k - s
micro-batches in flight on stage s) and `interleaved` (Megatron-LM's interleaved 1F1B, v
chunks per worker: the bubble shrinks by about 1/v); `build_schedule` picks one by name and
`ideal_bubble` / `ideal_peak_in_flight` give their closed forms, `peak_in_flight` /
`worker_peak_in_flight` measure a schedule's activation memory by walking its rows.
`lower` is a pure pass that adds the transfers and the per-stage sync; `validate` checks a
schedule by simulating its dependencies and, on failure, raises `ScheduleError` whose
message prints the grid with the offending step in brackets; `simulate` replays a schedule
with per-action durations on three resources per worker (compute, upload link, download
link, as the executor's three threads) and reports timelines, makespan and bubble shares.
"""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

from core.errors import ZooidValueError


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
    """One step of one stage worker's schedule; `stage` is the model stage (see `worker_of`)."""

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
"""Index = stage worker; each worker runs its list in order. Row w holds the actions of the
model stages w, w + p, w + 2p, ... (p = number of rows), just stage w when v = 1."""


class ScheduleError(ZooidValueError):
    """A schedule that cannot run; the message shows the grid with the bad step marked."""

    def __init__(self, message: str):
        super().__init__("schedule", message)


def parse_schedule(rows: Iterable[str]) -> Schedule:
    """Parse one whitespace-separated line of actions per stage worker."""
    return [[Action.parse(tok) for tok in row.split()] for row in rows]


def format_schedule(schedule: Schedule) -> list[str]:
    """One whitespace-separated line per stage worker; the inverse of `parse_schedule`."""
    return [" ".join(str(a) for a in row) for row in schedule]


# --- placement of model stages on workers ----------------------------------------------

def worker_of(stage: int, workers: int) -> int:
    """The worker (row) that runs model `stage` when `workers` rows share the model:
    `stage % workers`, so worker w holds stages w, w + p, w + 2p, ... (Megatron's
    interleaved placement; the identity when there are as many stages as workers)."""
    return stage % workers


@dataclass(frozen=True, slots=True)
class Layout:
    """How a schedule's model stages sit on its rows: `stages` = workers * chunks."""

    workers: int
    stages: int

    @property
    def chunks(self) -> int:
        """v, the model stages per worker."""
        return self.stages // self.workers

    @property
    def last(self) -> int:
        """The last model stage (the one with the loss)."""
        return self.stages - 1

    def worker_of(self, stage: int) -> int:
        return worker_of(stage, self.workers)

    def stages_of(self, worker: int) -> list[int]:
        """The model stages `worker` runs, in model order: worker, worker + p, ..."""
        return list(range(worker, self.stages, self.workers))

    def remote(self, stage: int, other: int) -> bool:
        """Whether a tensor between the two stages crosses workers (needs SEND/RECV)."""
        return self.worker_of(stage) != self.worker_of(other)


def layout(schedule: Schedule) -> Layout:
    """The schedule's placement: one row per worker, and model stages 0..p*v-1 where v is
    the fewest chunks per worker that covers the highest stage named (v = 1 for a schedule
    of one stage per row, as `gpipe` and `one_f_one_b` build)."""
    workers = max(len(schedule), 1)
    top = max([a.stage for row in schedule for a in row] + [0]) + 1
    return Layout(workers, workers * -(-max(top, workers) // workers))


def _row_label(schedule: Schedule) -> str:
    return "stage" if layout(schedule).chunks == 1 else "worker"


# --- compute schedules -----------------------------------------------------------------

SCHEDULES = ("gpipe", "1f1b", "interleaved")
"""Names `build_schedule` and `ideal_bubble` accept."""


def gpipe(stages: int, microbatches: int) -> Schedule:
    """GPipe order per stage: forwards of every micro-batch, then their backwards."""
    _check_positive(stages=stages, microbatches=microbatches)
    return [[Action(s, Kind.F, m) for m in range(microbatches)]
            + [Action(s, Kind.B, m) for m in range(microbatches)] for s in range(stages)]


def one_f_one_b(stages: int, microbatches: int) -> Schedule:
    """1F1B (PipeDream-Flush, Megatron's non-interleaved schedule): stage s of k runs a
    warm-up of w_s = min(k - s - 1, M) forwards, then alternates one forward and one
    backward (steady state) until every forward is issued, then the w_s backwards left
    (cool-down). Micro-batches run in order in both directions.

    Memory: a micro-batch's activations live from its forward to its backward, so stage s
    holds at most min(k - s, M) micro-batches (w_s after the warm-up, one more during each
    steady step) where GPipe holds all M. Time: for equal forward times f and backward
    times b on every stage and free transfers, the last stage starts after the fill's k - 1
    forwards, then computes its M (f + b) without a gap, and stage 0 ends k - 1 backwards
    after it: a makespan of (k - 1) f + M (f + b) + (k - 1) b = (M + k - 1)(f + b), GPipe's,
    so the bubble share stays (k - 1)/(M + k - 1) (`simulate` reproduces it exactly); 1F1B
    saves memory, not time.
    """
    _check_positive(stages=stages, microbatches=microbatches)
    return [_warm_up_then_alternate(min(stages - s - 1, microbatches), microbatches,
                                    lambda m, s=s: Action(s, Kind.F, m), lambda m, s=s: Action(s, Kind.B, m))
            for s in range(stages)]


def _warm_up_then_alternate(warm: int, total: int, forward, backward) -> list[Action]:
    """One 1F1B row: `warm` forwards, then one forward and one backward until every forward
    ran, then the backwards left; `forward(i)` / `backward(i)` give the i-th of each."""
    row = [forward(i) for i in range(warm)]
    for j in range(total - warm):
        row += [forward(warm + j), backward(j)]
    return row + [backward(j) for j in range(total - warm, total)]


def interleaved(workers: int, chunks: int, microbatches: int) -> Schedule:
    """Megatron-LM's interleaved 1F1B (Narayanan et al., SC'21, Sec. 2.2.2): the model is
    cut into p * v stages and worker w (p = `workers`, v = `chunks` >= 2) holds the v
    non-adjacent stages w, w + p, ..., w + (v - 1) p; row w of the schedule is that
    worker's list, with actions naming model stages.

    Each worker runs M * v "virtual" micro-batches (a micro-batch through one chunk),
    grouped by p: its i-th forward is for chunk c = (i // p) % v and micro-batch
    (i // (p v)) * p + i % p, so p micro-batches pass chunk 0, then the same p pass chunk 1,
    and so on; its j-th backward mirrors that with the chunks reversed (c = v - 1 -
    (j // p) % v). Worker w warms up with W_w = min(2 (p - w - 1) + (v - 1) p, M v)
    forwards, then alternates one forward and one backward (1F1B over virtual micro-batches)
    and ends with the W_w backwards left. The grouping by p needs M to be a multiple of p.

    Megatron special-cases M = p as all warm-up (every forward, then every backward); here
    the cap at M v does that only for worker 0 (p >= 2), the others keep the 1F1B order,
    which validates (no deadlock) and keeps the ideal bubble.

    Time: for equal chunk times f and b and free transfers the fill and drain are p - 1
    chunk forwards and backwards, 1/v of a 1F1B stage's, so the makespan is
    (p - 1) f + v M (f + b) + (p - 1) b = (v M + p - 1)(f + b) and the bubble share
    (p - 1)/(v M + p - 1) (`ideal_bubble`; `simulate` reproduces it exactly, also for
    b = 2f and M = p). Memory: worker w holds at most
    min(W_w + 1, M v) chunk activations (`ideal_peak_in_flight`); a chunk is 1/v of a
    1F1B stage, so worker 0 holds p + (p - 1)/v stage-sized micro-batches where 1F1B's
    stage 0 holds p.
    """
    _check_positive(workers=workers, chunks=chunks, microbatches=microbatches)
    if chunks < 2:
        raise ZooidValueError("chunks", f"must be >= 2 for the interleaved schedule (1 chunk "
                              f"per worker is 1f1b), got {chunks}")
    if microbatches % workers:
        raise ZooidValueError("microbatches", f"must be a multiple of the {workers} workers for "
                              f"the interleaved schedule, got {microbatches}")
    p, v, total = workers, chunks, microbatches * chunks

    def action(w: int, kind: Kind, i: int) -> Action:
        chunk = (i // p) % v
        chunk = v - 1 - chunk if kind is Kind.B else chunk
        return Action(chunk * p + w, kind, (i // (p * v)) * p + i % p)

    return [_warm_up_then_alternate(_interleaved_warmup(p, v, microbatches, w), total,
                                    lambda i, w=w: action(w, Kind.F, i), lambda i, w=w: action(w, Kind.B, i))
            for w in range(p)]


def _interleaved_warmup(workers: int, chunks: int, microbatches: int, worker: int) -> int:
    return min(2 * (workers - worker - 1) + (chunks - 1) * workers, microbatches * chunks)


def build_schedule(name: str, stages: int, microbatches: int, chunks: int = 1) -> Schedule:
    """The compute schedule `name` (`gpipe`, `1f1b` or `interleaved`) for `stages` stage
    workers and `microbatches` micro-batches; `chunks` is v for `interleaved` (>= 2, the
    model then has stages * chunks stages) and must be 1 otherwise. Bad values raise
    `ZooidValueError` naming `pipeline_schedule`, `stages`, `microbatches` or `chunks`."""
    _check_request(name, stages, microbatches, chunks)
    if name == "gpipe":
        return gpipe(stages, microbatches)
    if name == "1f1b":
        return one_f_one_b(stages, microbatches)
    return interleaved(stages, chunks, microbatches)


def _check_request(name: str, stages: int, microbatches: int, chunks: int) -> None:
    if name not in SCHEDULES:
        raise ZooidValueError("pipeline_schedule", f"must be one of {', '.join(SCHEDULES)}, got {name!r}")
    _check_positive(stages=stages, microbatches=microbatches, chunks=chunks)
    if name == "interleaved":
        if chunks < 2:
            raise ZooidValueError("chunks", f"must be >= 2 for the interleaved schedule, got {chunks}")
        if microbatches % stages:
            raise ZooidValueError("microbatches", f"must be a multiple of the {stages} stage "
                                  f"workers for the interleaved schedule, got {microbatches}")
    elif chunks != 1:
        raise ZooidValueError("chunks", f"must be 1 for the {name} schedule (only interleaved "
                              f"puts several chunks on a worker), got {chunks}")


def forward_only(stages: int, microbatches: int, chunks: int = 1) -> Schedule:
    """Forwards only (validation through the pipeline), one row per stage worker. With
    `chunks` = v the model has stages * v stages placed as `interleaved` places them, and
    row w runs its model stages w, w + p, ... one after the other, each over every
    micro-batch (every forward a later stage needs was issued before it, so no deadlock)."""
    _check_positive(stages=stages, microbatches=microbatches, chunks=chunks)
    lay = Layout(stages, stages * chunks)
    return [[Action(s, Kind.F, m) for s in lay.stages_of(w) for m in range(microbatches)]
            for w in range(stages)]


def lower(schedule: Schedule, sync: bool = True) -> Schedule:
    """Add the transfers a compute schedule implies, and when `sync` a SYNC per model stage
    that has backwards, at the end of its worker's row in the order the stages finish their
    backwards (one SYNC after the last backward when v = 1). Pure: returns a new schedule.

    A SYNC runs on the compute thread, so the SYNCs of an interleaved worker wait for all
    its backwards rather than stalling the backwards other workers wait for. Neighbouring
    stages on one worker (p = 1) get no transfer: the tensor stays in memory."""
    lay = layout(schedule)
    lowered: Schedule = []
    for row in schedule:
        out: list[Action] = []
        finished: dict[int, int] = {}
        for i, a in enumerate(row):
            needed = _transfers_needed(a, lay)
            out += [t for t in needed if t.kind in (Kind.RECV_F, Kind.RECV_B)]
            out.append(a)
            out += [t for t in needed if t.kind in (Kind.SEND_F, Kind.SEND_B)]
            if a.kind is Kind.B:
                finished[a.stage] = i
        if sync:
            out += [Action(s, Kind.SYNC) for s in sorted(finished, key=finished.__getitem__)]
        lowered.append(out)
    return lowered


def format_grid(schedule: Schedule, marks: Iterable[tuple[int, int]] = ()) -> str:
    """The schedule as a table (rows per stage worker, step columns); `(row, step)` cells in
    `marks` are shown in brackets. Rows are labelled `stage` when each holds one stage,
    `worker` when they hold several (interleaved)."""
    marks = set(marks)
    label = _row_label(schedule)
    width = max([len(str(a)) for row in schedule for a in row] + [4]) + 2
    steps = max([len(row) for row in schedule] + [0])
    lines = ["step".ljust(len(label) + 3) + "".join(str(i).center(width) for i in range(steps))]
    for s, row in enumerate(schedule):
        cells = [(f"[{a}]" if (s, i) in marks else f" {a} ").center(width)
                 for i, a in enumerate(row)]
        lines.append(f"{label} {s:<2}" + "".join(cells))
    return "\n".join(lines)


# --- validation ------------------------------------------------------------------------

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


def _transfers_needed(a: Action, lay: Layout) -> list[Action]:
    """The transfers a compute step of a lowered schedule must have on its own stage, in
    the order `lower` places them (RECV before the step, SEND after); none towards a
    neighbouring stage on the same worker."""
    s, m = a.stage, a.microbatch
    down, up = s > 0 and lay.remote(s, s - 1), s < lay.last and lay.remote(s, s + 1)
    need = []
    if a.kind is Kind.F:
        need += [Action(s, Kind.RECV_F, m)] if down else []
        need += [Action(s, Kind.SEND_F, m)] if up else []
    if a.kind is Kind.B:
        need += [Action(s, Kind.RECV_B, m)] if up else []
        need += [Action(s, Kind.SEND_B, m)] if down else []
    return need


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


# --- activation memory -----------------------------------------------------------------

def peak_in_flight(schedule: Schedule, stage: int) -> int:
    """The most micro-batches model `stage` holds activations for at once: walking its
    worker's row, a forward of the stage adds one, a backward removes it.

    GPipe: M. 1F1B: min(k - s, M). Interleaved, stage s = c p + w (chunk c of worker w):
    the first chunks hold the most, see `ideal_peak_in_flight` for the closed forms."""
    lay = layout(schedule)
    if not (isinstance(stage, int) and 0 <= stage < lay.stages):
        raise ZooidValueError("stage", f"must be in 0..{lay.stages - 1}, got {stage!r}")
    return _peak(a for a in schedule[lay.worker_of(stage)] if a.stage == stage)


def worker_peak_in_flight(schedule: Schedule, worker: int) -> int:
    """The most (stage, micro-batch) activation sets `worker` holds at once, over all its
    chunks; `peak_in_flight` of its stage when it holds one stage."""
    if not (isinstance(worker, int) and 0 <= worker < len(schedule)):
        raise ZooidValueError("worker", f"must be in 0..{len(schedule) - 1}, got {worker!r}")
    return _peak(schedule[worker])


def _peak(actions: Iterable[Action]) -> int:
    held = peak = 0
    for a in actions:
        held += (a.kind is Kind.F) - (a.kind is Kind.B)
        peak = max(peak, held)
    return peak


def ideal_peak_in_flight(schedule_name: str, stages: int, microbatches: int, worker: int,
                         chunks: int = 1, chunk: int | None = None) -> int:
    """The closed form of `worker_peak_in_flight` (or, given `chunk`, of `peak_in_flight`
    of model stage chunk * p + worker) for `build_schedule`'s schedules, counted in
    activation sets of one micro-batch through one chunk (one stage when chunks = 1).

    - `gpipe`: M, every forward runs before the first backward;
    - `1f1b`: min(k - w, M): the warm-up's k - w - 1 forwards plus the steady state's one;
    - `interleaved`, whole worker: min(W_w + 1, M v) with the warm-up W_w = min(2 (p - w -
      1) + (v - 1) p, M v): each steady step adds a forward before it retires a backward
      and the cool-down only retires. A chunk being 1/v of a stage, that is (W_w + 1) / v
      stage-sized sets, p + (p - 1)/v on worker 0 against 1F1B's p.
    - `interleaved`, chunk c: min(M, (L // (p v)) p + min(L % (p v), p)) with
      L = 2 (v - 1 - c) p + 2 (p - w - 1) + 1. Steady step t runs the worker's forward
      W_w + t, then its backward t. The forward with virtual index i = (g v + c) p + e
      (micro-batch g p + e through chunk c) has its backward at index (g v + v - 1 - c) p
      + e, (v - 1 - 2c) p later, so right after a step's forward chunk c holds the
      micro-batches whose forward indices fall in a window of L = W_w + 1 + (v - 1 - 2c) p
      consecutive indices; chunk c owns runs of p indices every p v, at most
      (L // (p v)) p + min(L % (p v), p) of any such window, and M in all. The last chunk
      (backwards first) holds min(2 (p - w - 1) + 1, p, M), the first up to 2p.
    """
    _check_request(schedule_name, stages, microbatches, chunks)
    if not (isinstance(worker, int) and 0 <= worker < stages):
        raise ZooidValueError("worker", f"must be in 0..{stages - 1}, got {worker!r}")
    if chunk is not None and not (isinstance(chunk, int) and 0 <= chunk < chunks):
        raise ZooidValueError("chunk", f"must be in 0..{chunks - 1}, got {chunk!r}")
    if schedule_name == "gpipe":
        return microbatches
    if schedule_name == "1f1b":
        return min(stages - worker, microbatches)
    p, v = stages, chunks
    if chunk is None:
        return min(_interleaved_warmup(p, v, microbatches, worker) + 1, microbatches * v)
    window = 2 * (v - 1 - chunk) * p + 2 * (p - worker - 1) + 1
    return min(microbatches, (window // (p * v)) * p + min(window % (p * v), p))


# --- simulation ------------------------------------------------------------------------

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
    """Per stage worker (row), its actions in schedule order."""
    makespan: float
    """Time from the first start to the last end."""
    bubble: list[float]
    """Per stage worker, the share of the makespan its compute thread is idle."""

    @property
    def mean_bubble(self) -> float:
        """Bubble share averaged over stage workers."""
        return sum(self.bubble) / len(self.bubble)


Durations = Mapping[str, float] | Callable[[Action], float]


def simulate(schedule: Schedule, durations: Durations, *, handoff_s: float = 0.0,
             sync_waits_for_uploads: bool = True) -> Simulation:
    """Replay a valid schedule and return per-worker timelines, makespan and bubble shares.

    `durations` is a function of the action, or a mapping from `"<stage><kind>"` (e.g.
    `"1F"`, model stage) or `"<kind>"` (e.g. `"F"`, `"SEND_F"`) to seconds; missing kinds
    take 0. Each stage worker has three resources that work in parallel, as the executor's
    threads do: compute (F, B and SYNC of all its stages, in schedule order), the upload
    link (SENDs in order) and the download link (RECVs in order, prefetched as soon as the
    matching SEND has finished).

    `handoff_s`: a receive whose download thread was already waiting when the key was
    written pays this notice delay of a polling store on top of its duration; a reader that
    is behind finds the key there and does not. `sync_waits_for_uploads`: SYNC starts only
    after the worker's earlier uploads (when it shares their link; the executor's SYNC runs
    from the compute thread and drains the uploads afterwards, so it does not wait).
    """
    validate(schedule)
    seconds = durations if callable(durations) else _lookup(durations)
    index = _index_actions(schedule)
    lay = layout(schedule)
    end: dict[Action, float] = {}
    start: dict[Action, float] = {}
    queues = {w: {"compute": [], "upload": [], "download": []} for w in range(len(schedule))}
    for w, row in enumerate(schedule):
        for a in row:
            queues[w][_resource(a)].append(a)
    heads = {(w, r): 0 for w in queues for r in queues[w]}
    free = {(w, r): 0.0 for w in queues for r in queues[w]}
    progress = True
    while progress:
        progress = False
        for (w, r), h in heads.items():
            queue = queues[w][r]
            while h < len(queue):
                a = queue[h]
                deps = _data_deps(a, index, lay)
                if a.kind is Kind.SYNC and sync_waits_for_uploads:
                    deps = deps + [u for u in queues[w]["upload"] if index[u][1] < index[a][1]]
                if not all(d in end for d in deps):
                    break
                ready = max([end[d] for d in deps], default=0.0)
                waiting = a.kind in (Kind.RECV_F, Kind.RECV_B) and free[(w, r)] <= ready
                start[a] = max(free[(w, r)], ready)
                end[a] = start[a] + (handoff_s if waiting else 0.0) + float(seconds(a))
                free[(w, r)] = end[a]
                h += 1
                progress = True
            heads[(w, r)] = h
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


def ideal_bubble(schedule_name: str, stages: int, microbatches: int, chunks: int = 1) -> float:
    """The idle share of every worker's compute for equal forward times f and backward
    times b on every stage (chunk) and free transfers, which `simulate` reproduces exactly.

    - `gpipe`, `1f1b`: (k - 1)/(M + k - 1). Each stage computes M (f + b) in a makespan of
      (M + k - 1)(f + b): the fill (k - 1 forwards before the last stage starts) and the
      drain (k - 1 backwards after stage 0 could have finished) are idle on every stage.
    - `interleaved` (p = `stages` workers, v = `chunks`): (p - 1)/(v M + p - 1). A worker
      computes v M chunk steps of f + b (chunks are 1/v of a stage) and the fill and drain
      cross p workers, p - 1 chunk steps: the 1F1B bubble of the same p workers divided by
      about v ((p - 1)/v stage steps next to M).
    """
    _check_request(schedule_name, stages, microbatches, chunks)
    return (stages - 1) / (chunks * microbatches + stages - 1)


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise ZooidValueError(name, f"must be a positive integer, got {value!r}")


def stage_actions(schedule: Schedule, stage: int) -> Sequence[Action]:
    """The actions of model `stage`, in its worker's order (raises `ZooidValueError` for a
    bad `stage`); the whole row of stage worker `stage` when each worker holds one stage."""
    lay = layout(schedule)
    if not 0 <= stage < lay.stages:
        raise ZooidValueError("stage", f"must be in 0..{lay.stages - 1}, got {stage}")
    row = schedule[lay.worker_of(stage)]
    return row if lay.chunks == 1 else [a for a in row if a.stage == stage]


def worker_actions(schedule: Schedule, worker: int) -> Sequence[Action]:
    """The action list one stage worker runs: its row, all of its chunks' actions."""
    if not 0 <= worker < len(schedule):
        raise ZooidValueError("worker", f"must be in 0..{len(schedule) - 1}, got {worker}")
    return schedule[worker]
