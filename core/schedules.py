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
chunks per worker: the bubble shrinks by about 1/v); `build_schedule` picks one by name.
`lower` is a pure pass that adds the transfers and the per-stage sync; `format_grid` prints
a schedule as a table.

This module builds schedules. `core.schedule_validation.validate` checks one before it
runs; `core.schedule_costs` replays one for its time (`simulate`) and activation memory
(`peak_in_flight`) and gives the closed forms of both (`ideal_bubble`,
`ideal_peak_in_flight`).
"""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Iterable, Sequence

from core.errors import ZooidValueError
from core.kinds import PipelineSchedule


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

SCHEDULES = tuple(PipelineSchedule)
"""Names `build_schedule` and `ideal_bubble` accept (`core.kinds.PipelineSchedule`)."""


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
    if name == PipelineSchedule.GPIPE:
        return gpipe(stages, microbatches)
    if name == PipelineSchedule.ONE_F_ONE_B:
        return one_f_one_b(stages, microbatches)
    return interleaved(stages, chunks, microbatches)


def _check_request(name: str, stages: int, microbatches: int, chunks: int) -> None:
    if name not in SCHEDULES:
        raise ZooidValueError("pipeline_schedule", f"must be one of {', '.join(SCHEDULES)}, got {name!r}")
    _check_positive(stages=stages, microbatches=microbatches, chunks=chunks)
    if name == PipelineSchedule.INTERLEAVED:
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
