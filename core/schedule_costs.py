"""What a pipeline schedule (`core.schedules`) costs: its time and its activation memory,
measured by replaying it and in closed form.

`simulate` replays a schedule with per-action durations on three resources per worker
(compute, upload link, download link, as the executor's three threads) and reports
timelines, makespan and bubble shares; `ideal_bubble` / `gpipe_bubble` give the bubble's
closed forms for equal stage times and free transfers, which `simulate` reproduces exactly.
`peak_in_flight` / `worker_peak_in_flight` measure a schedule's activation memory by walking
its rows; `ideal_peak_in_flight` gives their closed forms for `build_schedule`'s schedules.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

from core.errors import ZooidValueError
from core.kinds import PipelineSchedule
from core.schedule_validation import _data_deps, _index_actions, validate
from core.schedules import Action, Kind, Schedule, _check_positive, _check_request, _interleaved_warmup, layout


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
    if schedule_name == PipelineSchedule.GPIPE:
        return microbatches
    if schedule_name == PipelineSchedule.ONE_F_ONE_B:
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
