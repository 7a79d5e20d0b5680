"""Exact combinatorial solver for the co-optimisation (the default; same optimum as the MIQP).

For each data-parallel degree d, a label-setting dynamic programme over cut positions builds
the pipeline from the last stage to the first. A state (a, j) is "layers a..L-1 are placed,
the stage starting at layer a uses memory option j"; each label on it summarises a placed
suffix by six numbers, every one of which the final objective is non-decreasing in:

    F   forward compute + forward cut transfers so far          (adds up)
    Xf  largest forward compute / transfer so far               (max: the forward lag)
    SB  backward compute + backward cut transfers so far         (adds up)
    MB  largest backward compute / transfer so far               (max: the suffix lag)
    Tb  max over placed stages l of t_b(l) + Sy_l                (exact, see below)
    R   sum of the placed stages' rates (dollars per second)     (adds up)

Placing stage l in front of a suffix makes SB and MB exactly the suffix sum and suffix max
that the contract's t_b(l) needs, so t_b(l) + Sy_l is known the moment l is placed and Tb
is exact. At layer 0, t_iter = F + (mu - 1) Xf + Tb and the objective is
t_iter * (alpha2 + alpha1 * d * R). Because every update (sum, max) and the objective are
monotone in every component, a label that is no better in all six than another on the same
state cannot lead to a better plan: dropping it (Pareto dominance) keeps the search exact.
Components that cannot matter are zeroed so dominance bites harder: the lags when mu = 1,
R when alpha1 = 0.

Pruning: every label gets a lower bound on the objective of any completion, and labels
whose bound exceeds the best plan found so far are dropped. The bound combines the placed
suffix with, for the layers still to place, the lower-left convex hull of (time, rate) over
all prefix plans (compute, transfers and the first stage's sync, which add up). The
objective is a product of two positive affine functions of (time, rate), so it is
quasi-concave and its least value over all prefix plans is taken at a hull vertex. The
(mu - 1) lag terms are not additive, so prefix plans are split into classes by their
largest stage work Z: class g holds plans with Z in [caps[g], caps[g+1]), its hull is built
from stages of work <= caps[g+1] only, and it is credited a lag of at least
(mu - 1) * caps[g]. A heuristic pass (the same DP keeping few labels per state) supplies the
first upper bound, and a whole degree is skipped when its bound cannot beat it. Ties keep
one optimum. Exactness is checked against brute force in tests/test_planners_co_optimize.py.

Stage limits (`stages(d) = (low, high)`) add components k and -k, so a label dominates only
labels of as many stages; a stage is placed while k <= high, a complete label counts when
k >= low; the bounds ignore k (a relaxation). `frontier_exact` searches by dominance alone:
the complete labels then hold the exact (time, cost) Pareto frontier.
"""
from __future__ import annotations

import numpy as np

from planners.co_optimize_problem import MEMORY_SLACK, CoOptProblem, CoOptSolution

_PRUNE_SLACK = 1e-9   # keep labels whose bound ties the incumbent up to rounding
_HEURISTIC_BEAM = 8
_CAP_CLASSES = 8      # classes of prefix plans by largest stage work, for bounds
_NO_PLAN = 1e300      # hull padding
_SMALL = 8            # up to this many layers, skip the beam pass and use fewer classes


_COLUMNS = 8   # F, Xf, SB, MB, Tb, R, k, -k


def solve_exact(problem: CoOptProblem, stages=None) -> CoOptSolution | None:
    """The plan of least objective, or None when no plan fits memory at any valid degree.

    `stages`: None, or a function d -> (low, high) stage counts allowed at degree d (high
    < low: no solution at that degree)."""
    tables = {d: _Tables(problem, d, stages(d) if stages else None) for d in problem.valid_degrees()}
    incumbent: tuple[float, CoOptSolution] | None = None
    # A cheap beam pass over every degree gives a first bound, then each degree is solved
    # exactly, most promising first.
    heuristic = {d: 0.0 for d in tables}
    for d, tab in tables.items():
        if problem.num_layers <= _SMALL:
            break       # small problems: the exact passes are cheaper than the beam pass
        if tab.stage_range[0] > tab.stage_range[1]:
            continue
        found = _search(tab, upper=np.inf, beam=_HEURISTIC_BEAM)
        heuristic[d] = found[0] if found else np.inf
        if found and (incumbent is None or found[0] < incumbent[0]):
            incumbent = found
    for d in sorted(tables, key=lambda d: heuristic[d]):
        if tables[d].stage_range[0] > tables[d].stage_range[1]:
            continue
        upper = incumbent[0] if incumbent else np.inf
        if tables[d].whole_model_bound() > upper * (1 + _PRUNE_SLACK):
            continue
        found = _search(tables[d], upper=upper, beam=None)
        if found and (incumbent is None or found[0] < incumbent[0]):
            incumbent = found
    return incumbent[1] if incumbent else None


def frontier_exact(problem: CoOptProblem, stages=None) -> list[tuple[float, float, CoOptSolution]]:
    """Every Pareto-optimal (t_iter, c_iter, solution) over the valid degrees, fastest first
    (`stages` as in `solve_exact`); callers re-score with `planners.co_optimize.evaluate`."""
    from dataclasses import replace

    scored = replace(problem, weights=(1.0, 1.0))   # alpha1 > 0: the rate is a label component
    points = []
    for d in scored.valid_degrees():
        tab = _Tables(scored, d, stages(d) if stages else None)
        if tab.stage_range[0] > tab.stage_range[1]:
            continue
        labels = _labels(tab, upper=np.inf, beam=None)
        lag = float(tab.mu - 1)
        for j, (vals, _) in enumerate(labels[0]):
            for k in np.nonzero(_complete(tab, vals))[0]:
                t_iter = float(vals[k, 0] + lag * vals[k, 1] + vals[k, 4])
                points.append((t_iter, t_iter * d * float(vals[k, 5]), _trace(tab, labels, j, int(k))))
    points.sort(key=lambda p: (p[0], p[1]))
    least = np.minimum.accumulate([np.inf] + [p[1] for p in points])
    return [p for p, before in zip(points, least[:-1]) if p[1] < before]


class _Tables:
    """Per-degree arrays: stage compute, sync and fit for every [a, b] and option, cut transfers."""

    def __init__(self, p: CoOptProblem, d: int, stage_range: tuple[int, int] | None = None):
        L, J = p.num_layers, p.num_options
        self.problem, self.d, self.L, self.J = p, d, L, J
        self.limit_stages = stage_range is not None
        self.stage_range = tuple(stage_range) if stage_range is not None else (1, L)
        self.mu = p.microbatches // d
        beta, lat = p.contention, p.latency_s
        W = np.asarray(p.bandwidth_bytes_per_s, dtype=float)
        fwd = np.asarray(p.forward_s, dtype=float).reshape(L, J)
        bwd = np.asarray(p.backward_s, dtype=float).reshape(L, J)

        def span(values):  # span(x)[a, b] = sum of x[a..b] (along axis 0), zero when b < a
            c = np.concatenate([np.zeros((1,) + values.shape[1:]), np.cumsum(values, axis=0)])
            out = c[None, 1:] - c[:-1, None]
            return out

        self.fc = beta * span(fwd)                                   # [a, b, j]
        self.bc = beta * span(bwd)
        params = span(np.asarray(p.param_bytes, dtype=float))        # [a, b]
        acts = span(np.asarray(p.activation_bytes, dtype=float))
        need = self.mu * acts + p.memory_factor(d) * params + p.base_memory_bytes
        memory = np.asarray(p.memory_options_bytes, dtype=float)
        upper = np.triu(np.ones((L, L), dtype=bool))
        self.fit = (need[:, :, None] <= memory[None, None, :] * (1 + MEMORY_SLACK)) & upper[:, :, None]
        if d > 1:
            self.sync = 2 * p.sync_bytes(params)[:, :, None] / W[None, None, :] + (2 + d) * lat
        else:
            self.sync = np.zeros((L, L, J))
        out = np.asarray(p.output_bytes, dtype=float)
        grad = np.asarray(p.grad_bytes, dtype=float)
        # Cut after layer i (i = 0..L-2) by option of the stage before (jb) or after (ja).
        self.up_f = out[:-1, None] / W[None, :] + lat          # [i, jb]
        self.down_f = self.up_f                                # [i, ja]: same size, same link
        self.up_b = grad[1:, None] / W[None, :] + lat          # [i, ja]
        self.down_b = self.up_b                                # [i, jb]
        self.rate = np.asarray(p.rates(), dtype=float)
        a1, a2 = p.weights
        self.cost_w, self.time_w = a1 * d, a2
        self.use_rate = a1 > 0
        self._prefix_bounds(fwd, bwd, beta, W, out, grad, lat)

    def whole_model_bound(self) -> float:
        """A lower bound of the objective of every plan at this degree (inf: none fits)."""
        floor = self.pre_xf[self.L] + self.pre_mb[self.L]
        fixed = (self.mu - 1) * np.maximum(floor, self.caps[:-1])[:, None]
        value = (fixed + self.hull_t[self.L]) * (self.time_w + self.cost_w * self.hull_r[self.L])
        return float(value.min())

    def _prefix_bounds(self, fwd, bwd, beta, W, out, grad, lat):
        """Lower bounds on what layers 0..a-1 still add once layers a..L-1 are placed.

        pre_f/pre_b: least compute; pre_xf/pre_mb: the largest single-layer least compute
        (some stage holds that layer); cut_*_lb: the prefix side of the cut before layer a at
        the fastest link; hull[a]: the lower-left convex hull of (time, rate) over all prefix
        plans, time = compute + transfers that add up + the first stage's sync. The objective bound built from a hull
        is a product of two positive affine functions of (time, rate), which is
        quasi-concave, so its least value over all prefix plans is taken at a hull vertex.
        """
        L, J = self.L, self.J
        least_f, least_b = beta * fwd.min(axis=1), beta * bwd.min(axis=1)
        self.pre_f = np.concatenate([[0.0], np.cumsum(least_f)])
        self.pre_b = np.concatenate([[0.0], np.cumsum(least_b)])
        self.pre_xf = np.concatenate([[0.0], np.maximum.accumulate(least_f)])
        self.pre_mb = np.concatenate([[0.0], np.maximum.accumulate(least_b)])
        w_max = W.max()
        self.cut_f_lb = np.concatenate([[0.0], out[:-1] / w_max + lat])   # by a
        self.cut_b_lb = np.concatenate([[0.0], grad[1:] / w_max + lat])
        rate = self.rate if self.use_rate else np.zeros(J)
        work = self.fc + self.bc                                           # [a, b, j]
        # Classes of prefix plans by their largest stage work Z in [caps[g], caps[g+1]): the
        # lags add at least (mu - 1) * caps[g], and the plans of class g are among those whose
        # stages all have work <= caps[g+1], so hull g is built from those stages alone.
        values = np.unique(work[self.fit])
        classes = _CAP_CLASSES if L > _SMALL else 2
        inner = np.quantile(values, np.linspace(0, 1, classes + 1)[1:-1]) if len(values) else []
        self.caps = np.concatenate([[0.0], np.unique(inner), [np.inf]])
        hulls = [self._hulls(work, rate, self.fit & (work <= cap)) for cap in self.caps[1:]]
        width = max(1, max(len(h) for hull in hulls for h in hull))
        # Padding is a huge finite time (not inf, so a zero rate cannot make NaN): a padded
        # entry only ever gives a larger, still valid, bound.
        self.hull_t = np.full((L + 1, len(hulls), width), _NO_PLAN)   # [a, class, point]
        self.hull_r = np.zeros((L + 1, len(hulls), width))
        for g, hull in enumerate(hulls):
            for a, h in enumerate(hull):
                self.hull_t[a, g, :len(h)], self.hull_r[a, g, :len(h)] = h[:, 0], h[:, 1]
        self.least_rate = np.where(self.hull_t[:, -1] < _NO_PLAN, self.hull_r[:, -1], np.inf).min(axis=1)

    def _hulls(self, work, rate, allowed):
        """hull[a] for a = 0..L over prefix plans made of `allowed` [a, b, j] stages."""
        L = self.L
        enter = np.zeros((L, self.J))    # transfers a stage starting at layer a pays at its cut
        enter[1:] = self.down_f + self.up_b + (self.cut_f_lb[1:] + self.cut_b_lb[1:])[:, None]
        hull = [np.zeros((1, 2))]
        pts_t, pts_r, pts_a = np.zeros(1), np.zeros(1), np.zeros(1, dtype=int)
        for b in range(1, L + 1):
            fit = allowed[pts_a, b - 1]                                   # [n, J]
            t = pts_t[:, None] + work[pts_a, b - 1] + enter[pts_a]
            # The model's first stage syncs after its whole backward pass: t >= t_b(1) + Sy_1.
            t = t + np.where(pts_a == 0, 1.0, 0.0)[:, None] * self.sync[0, b - 1][None, :]
            r = pts_r[:, None] + rate[None, :]
            cand = np.stack([t[fit], r[fit]], axis=1)
            new = _lower_hull(cand) if len(cand) else np.empty((0, 2))
            hull.append(new)
            pts_t = np.concatenate([pts_t, new[:, 0]])
            pts_r = np.concatenate([pts_r, new[:, 1]])
            pts_a = np.concatenate([pts_a, np.full(len(new), b)])
        return hull


def _lower_hull(points: np.ndarray) -> np.ndarray:
    """Vertices of the lower-left convex hull of 2-D points (both coordinates minimised)."""
    points = points[np.lexsort((points[:, 1], points[:, 0]))]
    # Keep the Pareto frontier first (numpy), then the convex chain (few points).
    best_before = np.minimum.accumulate(np.concatenate([[np.inf], points[:-1, 1]]))
    points = points[points[:, 1] < best_before]
    chain = []
    for x, y in points:
        if chain and y >= chain[-1][1]:
            continue          # no lower rate for more time: dominated
        while len(chain) >= 2:
            (x1, y1), (x2, y2) = chain[-2], chain[-1]
            # Drop the middle point when it lies on or above the segment to the new one.
            if (x2 - x1) * (y - y1) - (y2 - y1) * (x - x1) <= 0:
                chain.pop()
            else:
                break
        chain.append((x, y))
    return np.array(chain)


def _search(tab: _Tables, upper: float, beam: int | None) -> tuple[float, CoOptSolution] | None:
    """Best (objective, plan) for one degree, pruning labels whose bound exceeds `upper`."""
    return _best_complete(tab, _labels(tab, upper, beam), float(tab.mu - 1))


def _labels(tab: _Tables, upper: float, beam: int | None) -> dict:
    """The labels of every state (a, j), built from the last layer back."""
    L, J, mu = tab.L, tab.J, tab.mu
    lag = float(mu - 1)
    limit = upper * (1 + _PRUNE_SLACK) if np.isfinite(upper) else np.inf
    labels: dict[int, list] = {}   # a -> per option j: (vals [n, _COLUMNS], back [n, 3])
    one = 1.0 if tab.limit_stages else 0.0
    pool_vals, pool_a, pool_j, pool_idx = [], [], [], []   # every label of states a' > a
    for a in range(L - 1, -1, -1):
        cand_vals = [[] for _ in range(J)]
        cand_back = [[] for _ in range(J)]
        # The last stage [a, L-1] on its own.
        for j in range(J):
            if tab.fit[a, L - 1, j]:
                fc, bc, sy = tab.fc[a, L - 1, j], tab.bc[a, L - 1, j], tab.sync[a, L - 1, j]
                vals = np.array([[fc, fc * (mu > 1), bc, bc * (mu > 1), bc + lag * bc + sy,
                                  tab.rate[j] * tab.use_rate, one, -one]])
                cand_vals[j].append(vals)
                cand_back[j].append(np.array([[-1, -1, -1]]))
        if pool_vals:
            _extend(tab, a, lag, np.concatenate(pool_vals), np.concatenate(pool_a),
                    np.concatenate(pool_j), np.concatenate(pool_idx), cand_vals, cand_back)
        labels[a] = []
        for j in range(J):
            if not cand_vals[j]:
                labels[a].append((np.empty((0, _COLUMNS)), np.empty((0, 3), dtype=int)))
                continue
            vals, back = np.concatenate(cand_vals[j]), np.concatenate(cand_back[j])
            if beam is not None:
                # Heuristic pass: shortlist by the cheap bound, keep the best by the full one.
                vals, back = _shortlist(vals, back, _lower_bound(tab, a, j, vals, lag, joint=False), 4 * beam)
                vals, back = _shortlist(vals, back, _lower_bound(tab, a, j, vals, lag), beam)
            else:
                if len(vals) > 64:     # many labels: drop the hopeless ones cheaply first
                    keep = _lower_bound(tab, a, j, vals, lag, joint=False) <= limit
                    vals, back = vals[keep], back[keep]
                keep = _lower_bound(tab, a, j, vals, lag) <= limit
                vals, back = vals[keep], back[keep]
                keep = _pareto(vals)
                vals, back = vals[keep], back[keep]
            labels[a].append((vals, back))
            if a > 0 and len(vals):
                pool_vals.append(vals)
                pool_a.append(np.full(len(vals), a))
                pool_j.append(np.full(len(vals), j))
                pool_idx.append(np.arange(len(vals)))
    return labels


def _shortlist(vals, back, score, count):
    """The `count` labels of least score (all of them when there are fewer)."""
    if len(vals) <= count:
        return vals, back
    best = np.argpartition(score, count - 1)[:count]
    return vals[best], back[best]


def _extend(tab, a, lag, vals, src_a, src_j, src_idx, cand_vals, cand_back):
    """Put a new first stage [a, a'-1] with every option j in front of each pooled label."""
    last = src_a - 1                               # last layer of the new stage = cut position
    fc, bc, sy = tab.fc[a, last, :], tab.bc[a, last, :], tab.sync[a, last, :]   # [n, J]
    fit = tab.fit[a, last, :]
    up_f = tab.up_f[last, :]                       # new stage uploads its output   [n, J]
    down_f = tab.down_f[last, src_j][:, None]      # the suffix stage downloads it  [n, 1]
    up_b = tab.up_b[last, src_j][:, None]          # the suffix stage uploads the gradient
    down_b = tab.down_b[last, :]                   # the new stage downloads it     [n, J]
    F, Xf, SB, MB, Tb, R, K, NK = (vals[:, k:k + 1] for k in range(_COLUMNS))
    if tab.limit_stages:   # one more stage: drop the labels that would exceed the most allowed
        room = (K[:, 0] + 1 <= tab.stage_range[1])
        fit = fit & room[:, None]
        K, NK = K + 1, NK - 1
    new_f = F + fc + up_f + down_f
    new_sb = SB + bc + up_b + down_b
    if lag > 0:
        new_xf = np.maximum(np.maximum(Xf, fc), np.maximum(up_f, down_f))
        new_mb = np.maximum(np.maximum(MB, bc), np.maximum(up_b, down_b))
    else:
        new_xf = np.zeros_like(new_f)
        new_mb = np.zeros_like(new_f)
    new_tb = np.maximum(Tb, new_sb + lag * new_mb + sy)
    new_r = R + tab.rate[None, :] * tab.use_rate
    stacked = np.stack(np.broadcast_arrays(new_f, new_xf, new_sb, new_mb, new_tb, new_r, K, NK), axis=2)
    for j in range(tab.J):
        rows = np.nonzero(fit[:, j])[0]
        if len(rows):
            cand_vals[j].append(stacked[rows, j, :])
            cand_back[j].append(np.stack([src_a[rows], src_j[rows], src_idx[rows]], axis=1))


def _lower_bound(tab, a, j, vals, lag, joint=True):
    """Objective lower bound for completing labels of state (a, j) with layers 0..a-1."""
    F, Xf, SB, MB, Tb, R = (vals[:, k] for k in range(6))
    if a == 0:
        t_iter = F + lag * Xf + Tb
        return t_iter * (tab.time_w + tab.cost_w * R)
    if not np.isfinite(tab.least_rate[a]):
        return np.full(len(vals), np.inf)   # layers 0..a-1 fit no memory option
    i = a - 1
    down_f, up_b = tab.down_f[i, j], tab.up_b[i, j]          # paid by this stage: exact
    up_f, down_b = tab.cut_f_lb[a], tab.cut_b_lb[a]         # paid by the prefix: at least
    f_now = F + down_f + up_f
    sb_now = SB + up_b + down_b
    xf = np.maximum(Xf, max(down_f, up_f, tab.pre_xf[a])) if lag > 0 else 0.0
    mb = np.maximum(MB, max(up_b, down_b, tab.pre_mb[a])) if lag > 0 else 0.0
    # Bound 1 keeps the placed stages' sync (Tb) and the least prefix compute and rate.
    t_iter = f_now + tab.pre_f[a] + lag * xf + np.maximum(Tb, sb_now + tab.pre_b[a] + lag * mb)
    bound = t_iter * (tab.time_w + tab.cost_w * (R + tab.least_rate[a]))
    if not joint:
        return bound
    # Bound 2 trades prefix time against prefix rate along the prefix hulls, one class of
    # prefix plans (by largest stage work) at a time: [label, class, hull point].
    lags = np.broadcast_to(xf + mb, f_now.shape)[:, None]
    fixed = (f_now + sb_now)[:, None] + lag * np.maximum(lags, tab.caps[None, :-1])
    value = (fixed[:, :, None] + tab.hull_t[a][None]) * (tab.time_w + tab.cost_w * (R[:, None, None] + tab.hull_r[a][None]))
    return np.maximum(bound, value.min(axis=(1, 2)))


def _pareto(vals: np.ndarray) -> np.ndarray:
    """Mask of labels no other label is at most as large as in every component (one per tie)."""
    n = len(vals)
    if n <= 1:
        return np.ones(n, dtype=bool)
    order = np.lexsort(vals.T[::-1])
    ordered = vals[order]
    dominated = np.zeros(n, dtype=bool)
    # After a lexicographic sort, only an earlier label can dominate a later one.
    block = 512
    for start in range(0, n, block):
        rows = ordered[start:start + block]
        le = np.all(ordered[None, :start + len(rows), :] <= rows[:, None, :], axis=2)
        earlier = np.arange(start + len(rows))[None, :] < np.arange(start, start + len(rows))[:, None]
        dominated[start:start + len(rows)] = np.any(le & earlier, axis=1)
    mask = np.zeros(n, dtype=bool)
    mask[order[~dominated]] = True
    return mask


def _best_complete(tab, labels, lag) -> tuple[float, CoOptSolution] | None:
    """The least-objective complete label (a = 0) and its plan, traced back through states."""
    best = None
    for j, (vals, _) in enumerate(labels[0]):
        ok = _complete(tab, vals)
        if ok.any():
            obj = (vals[:, 0] + lag * vals[:, 1] + vals[:, 4])
            obj = np.where(ok, obj * (tab.time_w + tab.cost_w * vals[:, 5]), np.inf)
            k = int(np.argmin(obj))
            if best is None or obj[k] < best[0]:
                best = (float(obj[k]), j, k)
    if best is None:
        return None
    objective, j, k = best
    return objective, _trace(tab, labels, j, k)


def _complete(tab: _Tables, vals: np.ndarray) -> np.ndarray:
    """Mask of complete labels (a = 0) with at least the fewest stages allowed."""
    if not tab.limit_stages:
        return np.ones(len(vals), dtype=bool)
    return vals[:, 6] >= tab.stage_range[0]


def _trace(tab: _Tables, labels: dict, j: int, k: int) -> CoOptSolution:
    """The solution of complete label k of state (0, j), traced back through the states."""
    cuts, options, a = [], [], 0
    while True:
        options.append(j)
        next_a, next_j, next_k = labels[a][j][1][k]
        if next_a < 0:
            break
        cuts.append(int(next_a) - 1)
        a, j, k = int(next_a), int(next_j), int(next_k)
    return CoOptSolution(tuple(cuts), tab.d, tuple(options))
