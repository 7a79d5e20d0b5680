"""Exact contiguous partition of a layer chain under a cost with bottleneck (max) terms.

The pipeline models of Hydrozoa (runtime) and of the hybrid planner (runtime plus the
slowest stage's synchronisation) share one shape. For a chain of L layers cut into stages
p_1..p_k (contiguous, non-empty), with cuts after layers i_1 < ... < i_{k-1}:

    score = w_c * sum_cuts c[i]  +  sum_d w_d * m_d
    m_d   = max( max_l V_d(p_l),  max_cuts c[i] if term d includes the cuts )
    V_d(p) = scale_d * sum_{i in p} x_d[i] + offset_d        (x_d >= 0, scale_d >= 0)

i.e. each bottleneck term is an affine, non-decreasing function of a stage's sum of a
non-negative per-layer quantity (forward seconds, backward seconds, parameter bytes
turned into synchronisation seconds). All weights are >= 0.

Why a plain DP over prefixes is not exact: the maxima couple all stages, so the best
prefix for the sum is not the best prefix for the whole score. Hydrozoa fixes caps on the
maxima on a grid (epsilon-optimal). Here the DP state carries the running maxima as a
*label* (comm, m_1..m_D) per (stage count s, last layer j), and a label is discarded only
when it provably cannot lead to a better answer:

1. Dominance. A continuation adds the same comm c' to both labels and raises each maximum
   to max(m_d, x_d) for the same future x_d; since max(a, x) - max(b, x) <= max(0, a - b),
       A dominates B  if  w_c (comm_A - comm_B) + sum_d w_d max(0, m_A,d - m_B,d) <= 0.
   This is stronger than componentwise dominance and transitive (max(0, .) is
   subadditive), so labels can be filtered in any order.
2. Bounds. Balanced cuts, then passes that keep only the few cheapest labels per state
   (a beam), yield feasible partitions and so an upper bound U_k for every stage count k. A label
   at (s, j) that would finish with q = k - s more stages over layers j+1..L-1 scores at
   least w_c (comm + c[j] + (q - 1) min c) + sum_d w_d max(m_d, c[j] if d takes cuts,
   scale_d max(rest_d / q, max single x_d) + offset_d), because some stage holds at least
   the average and every stage at least its largest layer. A label whose bound exceeds
   U_k for every k it could still reach is dropped.

Neither rule removes a label on the path of an optimum, so the least score at (k, L-1) is
the exact optimum for k stages. Filtering is vectorised with numpy: level s is built from
all labels of level s - 1 against every end column j at once; each column keeps its label
of least score, drops what that label dominates, and repeats on the survivors.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from core.stage_memory import stage_bounds

_BEAM = 4  # labels per state in the upper-bound pass


@dataclass(frozen=True)
class MaxTerm:
    """One bottleneck term: weight w_d, per-layer values x_d >= 0, whether the cut values
    also enter its maximum, and the affine map (scale, offset) from a stage sum to its
    value."""

    weight: float
    layer_values: np.ndarray
    with_cuts: bool
    scale: float = 1.0
    offset: float = 0.0


@dataclass(frozen=True)
class ChainSolution:
    """The best partition into exactly `stages` stages and its score (without constants)."""

    stages: int
    cuts: tuple[int, ...]
    score: float


@dataclass
class _Level:
    end: np.ndarray     # last layer of the s-th stage
    comm: np.ndarray    # sum of cut values so far
    maxima: np.ndarray  # (n, D) running maxima
    parent: np.ndarray  # index into the previous level (-1 at level 1)


def interval_sums(values: np.ndarray) -> np.ndarray:
    """S[a, b] = values[a] + ... + values[b] for b >= a (entries with b < a are meaningless)."""
    prefix = np.concatenate(([0.0], np.cumsum(np.asarray(values, dtype=float))))
    return prefix[None, 1:] - prefix[:-1, None]


class _Chain:
    """The precomputed tables of one problem."""

    def __init__(self, cut_values, comm_weight, terms, max_stages, allowed):
        self.n = len(cut_values) + 1
        self.cut = np.asarray(cut_values, dtype=float)
        self.w_c = float(comm_weight)
        self.weights = np.array([t.weight for t in terms], dtype=float)
        values = [np.asarray(t.layer_values, dtype=float) for t in terms]
        if np.any(self.weights < 0) or self.w_c < 0 or any(t.scale < 0 for t in terms):
            raise ValueError("weights: bottleneck weights, scales and the communication "
                             "weight must be >= 0")
        if any(np.any(x < 0) for x in values) or np.any(self.cut < 0):
            raise ValueError("layer_values: per-layer and cut values must be >= 0")
        self.prefix = [np.concatenate(([0.0], np.cumsum(x))) for x in values]
        self.scale = np.array([t.scale for t in terms], dtype=float)
        self.offset = np.array([t.offset for t in terms], dtype=float)
        self.cut_in = np.array([t.with_cuts for t in terms], dtype=bool)
        self.allowed = None if allowed is None else np.asarray(allowed, dtype=bool)
        self.top = min(max_stages, self.n)
        # Suffix data for the completion bound: sums and largest single value of layers
        # j+1..L-1, and the smallest cut value among cuts j+1..L-2.
        self.rest_sum = [p[-1] - p[1:] for p in self.prefix]
        self.rest_max = [np.concatenate((np.maximum.accumulate(x[::-1])[::-1][1:], [0.0]))
                         for x in values]
        cut_pad = np.concatenate((self.cut, [np.inf]))
        self.rest_cut_min = np.concatenate((np.minimum.accumulate(cut_pad[::-1])[::-1][1:],
                                            [np.inf]))

    def stage_value(self, d: int, start: np.ndarray, end: np.ndarray) -> np.ndarray:
        """V_d for stages start..end (arrays)."""
        p = self.prefix[d]
        return self.scale[d] * (p[end + 1] - p[start]) + self.offset[d]


def solve_chain(*, cut_values: np.ndarray, comm_weight: float, terms: Sequence[MaxTerm],
                max_stages: int, allowed: np.ndarray | None = None,
                use_bounds: bool = True) -> dict[int, ChainSolution]:
    """The exact least-score partition for every stage count 1..min(max_stages, L).

    `cut_values[i]` is the value of a cut after layer i (length L - 1); `allowed[a, b]`
    (optional) says whether a stage may span layers a..b (e.g. it fits in memory). Stage
    counts with no allowed partition are absent from the answer. `use_bounds=False` runs
    the dominance DP alone (slower; exact either way, and tests check both)."""
    chain = _Chain(cut_values, comm_weight, terms, max_stages, allowed)
    bounds = np.full(chain.top + 1, np.inf)
    if not use_bounds:
        return _run(chain, None, bounds)
    # Balanced cuts, then two cheap passes (one label per state, then a few) give upper
    # bounds; the last pass keeps every label that the bounds and dominance cannot exclude.
    for k in range(1, chain.top + 1):
        cuts = _balanced_cuts(chain, k)
        if cuts is not None:
            bounds[k] = _score(chain, cuts)
    for beam in (1, _BEAM, None):
        found = _run(chain, beam, bounds)
        for k, sol in found.items():
            bounds[k] = min(bounds[k], sol.score)
    return found


def _balanced_cuts(chain: _Chain, k: int) -> tuple[int, ...] | None:
    """k stages of about equal weighted load (a feasible guess, for an upper bound), or
    None when a stage would not be allowed."""
    n = chain.n
    load = sum(w * sc * np.diff(p) for w, sc, p in zip(chain.weights, chain.scale, chain.prefix))
    if not isinstance(load, np.ndarray) or load.sum() <= 0:
        load = np.ones(n)
    prefix = np.cumsum(load)
    cuts, prev = [], -1
    for i in range(1, k):
        raw = int(np.searchsorted(prefix, prefix[-1] * i / k)) - 1
        cut = min(max(raw, prev + 1), n - 1 - (k - i))
        cuts.append(cut)
        prev = cut
    if chain.allowed is not None:
        if not all(chain.allowed[a, b] for a, b in stage_bounds([c + 1 for c in cuts], n)):
            return None
    return tuple(cuts)


def _score(chain: _Chain, cuts: tuple[int, ...]) -> float:
    """The score of one partition (the objective without constants)."""
    n = chain.n
    starts, ends = np.array(stage_bounds([c + 1 for c in cuts], n)).T  # cut c: after layer c
    cut_vals = chain.cut[list(cuts)] if cuts else np.zeros(0)
    total = chain.w_c * float(cut_vals.sum())
    for d in range(len(chain.weights)):
        m = float(chain.stage_value(d, starts, ends).max())
        if chain.cut_in[d] and len(cut_vals):
            m = max(m, float(cut_vals.max()))
        total += chain.weights[d] * m
    return total


def _run(chain: _Chain, beam: int | None, bounds: np.ndarray) -> dict[int, ChainSolution]:
    n = chain.n
    ends = np.arange(n)
    if chain.allowed is not None:
        ends = ends[chain.allowed[0]]
    zero = np.zeros(len(ends), dtype=int)
    maxima = np.stack([chain.stage_value(d, zero, ends) for d in range(len(chain.weights))],
                      axis=1) if len(chain.weights) else np.zeros((len(ends), 0))
    maxima = np.maximum(maxima, _floor(chain, ends, 1))
    level = _Level(ends, np.zeros(len(ends)), maxima, np.full(len(ends), -1))
    keep = _reachable(chain, level.end, level.comm, level.maxima, 1, bounds)
    levels = [_Level(*(a[keep] for a in (level.end, level.comm, level.maxima, level.parent)))]
    for s in range(2, chain.top + 1):
        level = _extend(chain, levels[-1], s, beam, bounds)
        levels.append(level)
        if len(level.end) == 0:
            break
    answers: dict[int, ChainSolution] = {}
    for k, level in enumerate(levels, start=1):
        finals = np.flatnonzero(level.end == n - 1)
        if len(finals) == 0:
            continue
        scores = chain.w_c * level.comm[finals] + level.maxima[finals] @ chain.weights
        best = finals[int(np.argmin(scores))]
        answers[k] = ChainSolution(k, _trace(levels, k, best), float(scores.min()))
    return answers


def _slack(bounds: np.ndarray) -> float:
    finite = bounds[np.isfinite(bounds)]
    return 1e-9 * max(1.0, float(np.abs(finite).max())) if len(finite) else 0.0


def _floor(chain: _Chain, j: np.ndarray, s: int) -> np.ndarray:
    """A value every completion of a label at (s, j) raises each maximum to: the remaining
    layers all land in some stage (so the largest one, and their sum over the most stages
    still possible), and the next cut is certain. Raising a label's maxima to this floor
    leaves every final score unchanged and lets dominance see through differences that no
    completion can keep."""
    n, nd = chain.n, len(chain.weights)
    out = np.zeros((len(j), nd))
    q_max = np.minimum(chain.top - s, n - 1 - j)
    open_ = q_max >= 1
    if not open_.any():
        return out
    jo, qo = j[open_], q_max[open_]
    for d in range(nd):
        rest = np.maximum(chain.rest_max[d][jo], chain.rest_sum[d][jo] / qo)
        f = chain.scale[d] * rest + chain.offset[d]
        if chain.cut_in[d]:
            f = np.maximum(f, chain.cut[jo])
        out[open_, d] = f
    return out


def _reachable(chain: _Chain, j, comm, maxima, s: int, bounds: np.ndarray) -> np.ndarray:
    """Mask of labels at level s whose completion bound is within the upper bound of some
    stage count they can still reach."""
    n = chain.n
    if not np.isfinite(bounds[s:]).any():
        return np.ones(len(j), dtype=bool)
    slack = _slack(bounds)
    score = chain.w_c * comm + maxima @ chain.weights
    keep = (j == n - 1) & (score <= bounds[s] + slack)
    jj = np.minimum(j, n - 2)
    c_next = chain.cut[jj] if n > 1 else np.zeros(len(j))
    for q in range(1, chain.top - s + 1):
        ok = (n - 1 - j) >= q
        if not ok.any():
            continue
        more = (q - 1) * chain.rest_cut_min[jj] if q > 1 else 0.0
        lb = chain.w_c * (comm + c_next + more)
        for d in range(len(chain.weights)):
            rest = chain.scale[d] * np.maximum(chain.rest_sum[d][j] / q, chain.rest_max[d][j])
            m = np.maximum(maxima[:, d], rest + chain.offset[d])
            if chain.cut_in[d]:
                m = np.maximum(m, c_next)
            lb = lb + chain.weights[d] * m
        keep |= ok & (lb <= bounds[s + q] + slack)
    return keep


def _windows(chain: _Chain, start, comm, s: int, bounds: np.ndarray) -> np.ndarray:
    """The last column each new stage may reach: a stage whose own bottleneck values
    already exceed every reachable upper bound is useless, and they grow with the span."""
    n = chain.n
    hi = np.full(len(start), n - 1)
    reach = bounds[s:]
    if not np.isfinite(reach).all():
        return hi
    budget = reach.max() + _slack(bounds) - chain.w_c * comm
    for d in range(len(chain.weights)):
        if chain.weights[d] <= 0 or chain.scale[d] <= 0:
            continue
        limit = (budget / chain.weights[d] - chain.offset[d]) / chain.scale[d]
        p = chain.prefix[d]
        # the stage start..j is allowed while p[j + 1] - p[start] <= limit
        hi = np.minimum(hi, np.searchsorted(p, p[start] + limit, side="right") - 2)
    return hi


def _extend(chain: _Chain, prev: _Level, s: int, beam: int | None,
            bounds: np.ndarray) -> _Level:
    """Level s from level s - 1: every label gets one more stage ending at every column
    its window allows; candidates are pruned by bound, then by dominance per column."""
    n, weights, nd = chain.n, chain.weights, len(chain.weights)
    rows = np.flatnonzero(prev.end < n - 1)
    start = prev.end[rows] + 1
    cut = chain.cut[prev.end[rows]] if len(rows) else np.zeros(0)
    comm_row = prev.comm[rows] + cut
    hi = _windows(chain, start, comm_row, s, bounds)
    width = np.maximum(0, hi - start + 1)
    row = np.repeat(np.arange(len(rows)), width)
    first = np.cumsum(width) - width
    col = start[row] + (np.arange(len(row)) - first[row])
    # the last stage count only needs partitions that end at the last layer
    ok = (col == n - 1) | (s < chain.top)
    if chain.allowed is not None:
        ok &= chain.allowed[start[row], col]
    row, col = row[ok], col[ok]
    comm = comm_row[row]
    maxima = np.empty((len(row), nd))
    for d in range(nd):
        m = np.maximum(prev.maxima[rows[row], d], chain.stage_value(d, start[row], col))
        maxima[:, d] = np.maximum(m, cut[row]) if chain.cut_in[d] else m
    maxima = np.maximum(maxima, _floor(chain, col, s))
    ok = _reachable(chain, col, comm, maxima, s, bounds)
    row, col, comm, maxima = row[ok], col[ok], comm[ok], maxima[ok]
    if len(row) == 0:
        return _Level(np.zeros(0, int), np.zeros(0), np.zeros((0, nd)), np.zeros(0, int))

    score = chain.w_c * comm + maxima @ weights
    tol = 1e-12 * max(1.0, float(np.abs(score).max()))
    order = np.lexsort((score, col))
    idx = order
    kept = []
    rounds = 0
    while len(idx) and (beam is None or rounds < beam):
        rounds += 1
        c = col[idx]
        head_mask = np.r_[True, c[1:] != c[:-1]]
        head = idx[np.flatnonzero(head_mask)[np.cumsum(head_mask) - 1]]
        kept.append(idx[head_mask])
        dom = chain.w_c * (comm[head] - comm[idx])
        if nd:
            dom = dom + np.maximum(0.0, maxima[head] - maxima[idx]) @ weights
        idx = idx[~(dom <= tol) & ~head_mask]
    k = np.concatenate(kept)
    k = k[np.lexsort((row[k], col[k]))]
    return _Level(end=col[k], comm=comm[k], maxima=maxima[k], parent=rows[row[k]])


def _trace(levels: list[_Level], k: int, index: int) -> tuple[int, ...]:
    """The cuts of the label `index` at level k: the ends of its first k - 1 stages."""
    ends = []
    for level in reversed(levels[:k]):
        ends.append(int(level.end[index]))
        index = int(level.parent[index])
    return tuple(reversed(ends[1:]))
