"""FuncPipe's co-optimisation as an MIQP (Sec. 3.4, App. B, App. C), for gurobipy or SCIP.

The model is built once into a small solver-neutral form (`_Model`: variables, linear
constraints, an objective with at most one bilinear term) and handed to gurobipy or to
pyscipopt. gurobipy's bundled licence refuses models over 2000 variables or constraints, or
over 200 variables when the objective has a quadratic term (GurobiError 10010); then, or
when gurobipy cannot be imported, the same model goes to SCIP and the answer says why.

Formulation (layers i = 0..L-1, cuts c = 0..L-2 between layers c and c+1, memory options
j = 1..J, data-parallel degrees k = 1..K restricted to those dividing M, mu_k = M / D_k):

Binary variables
    x_c = 1  iff the model is cut after layer c
    y_k = 1  iff d = D_k;                  sum_k y_k = 1
    z_ij = 1 iff layer i's workers use option j;  sum_j z_ij = 1
    stage consistency (3c): |z_{c+1,j} - z_{c,j}| <= x_c for every j
Continuous variables (all >= 0) and their constraints. The objective is non-decreasing in
every one of them and every memory term is "larger is worse", so each product is bounded
from the side that matters only (the minimisation drives it onto the true value); the
other side of App. C's Technique 2 and Technique 3's selector binaries are not needed:
    hat/tilde accumulations (App. C (1), as a recursion instead of r-dot products):
      u_hat_i >= u_i + u_hat_{i-1} - U x_{i-1},  u_hat_i >= u_i     for u = a, s and
      Fc_i = beta sum_j Tf_ij z_ij;  tilde (backward) likewise for Bc_i and the sync
      bytes-over-bandwidth 2 phi s_i / W_j (sum_j ... z_ij), cut by x_i (phi: the sync's
      bytes per float32 byte, `sync_bytes_factor`)
    transfers at cut c (App. C (2), Technique 2 with x_c):
      FU_c >= sum_j z_cj o_c / W_j + lat - U (1 - x_c); FD_c with z_{c+1,j};
      BU_c >= sum_j z_{c+1,j} g_{c+1} / W_j + lat - U (1 - x_c); BD_c with z_cj
    lags (Technique 3, epigraph): Df >= Fc_hat_i, FU_c, FD_c;
      Db_i >= Db_{i+1}, Bc_tilde_i, BU_i, BD_i
    (mu - 1) * lag = sum_k (mu_k - 1) h_k with h_k >= lag - U (1 - y_k)   (App. C (3))
    memory (3b) at every layer (App. C (7)):
      sum_k mu_k p_ik + (4 + f) s_hat_i - 2 q_i + s0 <= sum_j M_j z_ij,
      p_ik >= a_hat_i - U (1 - y_k);  q_i <= s_hat_i, q_i <= U y_[D=1]   (q = y_[D=1] s_hat)
    sync (App. C (4)): Sy_i >= S_tilde_i - U y_[D=1] + sum_k [D_k > 1] (2 + D_k) lat y_k
    t_f = sum_i Fc_i + sum_c (FU_c + FD_c) + sum_k (mu_k - 1) hf_k
    t_b(i) = sum_{q >= i} Bc_q + sum_{c >= i} (BU_c + BD_c) + sum_k (mu_k - 1) hb_ik
    t >= t_f + t_b(i) + Sy_i for every i                                  (App. C (5))
    stage rates (App. C (6)): rho_c >= sum_j r_j z_cj - U (1 - x_c); the last layer's stage
      adds sum_j r_j z_{L-1,j}; e_k >= rho - U (1 - y_k); R >= sum_k D_k e_k  (= d * sum rates)
Objective (quadratic, bilinear):  minimise  alpha1 * t * R + alpha2 * t
with r_j = P * M_j, or price_per_s[j] when given. Memory rows are in units of the largest
option so every row is of order one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from core.stage_memory import stage_bounds
from planners.co_optimize_problem import CoOptProblem, CoOptSolution, Solved, plan_fits

LICENCE_ERROR = 10010
_TOLERANCE = 1e-9


@dataclass
class _Model:
    """A solver-neutral MIQP: variables, linear rows, objective alpha1 * t * R + alpha2 * t."""

    names: list = field(default_factory=list)
    kinds: list = field(default_factory=list)     # "B" or "C"
    lower: list = field(default_factory=list)
    upper: list = field(default_factory=list)
    rows: list = field(default_factory=list)      # (dict var -> coef, sense, rhs)
    bilinear: tuple | None = None                 # (coef, var_a, var_b)
    linear: dict = field(default_factory=dict)

    def var(self, name: str, kind: str = "C", upper: float = math.inf) -> int:
        """Add a variable (lower bound 0) and return its index."""
        self.names.append(name)
        self.kinds.append(kind)
        self.lower.append(0.0)
        self.upper.append(1.0 if kind == "B" else upper)
        return len(self.names) - 1

    def row(self, terms: dict, sense: str, rhs: float) -> None:
        """Add sum(coef * var) sense rhs, sense one of <=, >=, ==."""
        self.rows.append(({v: c for v, c in terms.items() if c != 0}, sense, rhs))


def model_size(problem: CoOptProblem) -> tuple[int, int]:
    """(variables, constraints) of the MIQP for `problem` (to compare with licence limits)."""
    model, _ = build_model(problem)
    return len(model.names), len(model.rows)


def build_model(problem: CoOptProblem) -> tuple[_Model, dict]:
    """The MIQP of the module docstring and the index of its decision variables."""
    p = problem
    L, J = p.num_layers, p.num_options
    degrees = list(p.valid_degrees())
    if not degrees:
        raise ValueError("dp_degrees: no degree divides microbatches, so there is no model")
    mus = [p.microbatches // d for d in degrees]
    beta, lat = p.contention, p.latency_s
    W = p.bandwidth_bytes_per_s
    w_min = min(W)
    mem_unit = max(p.memory_options_bytes)
    rates = p.rates()
    m = _Model()
    x = [m.var(f"x{c}", "B") for c in range(L - 1)]
    y = [m.var(f"y{k}", "B") for k in range(len(degrees))]
    z = [[m.var(f"z{i}_{j}", "B") for j in range(J)] for i in range(L)]
    m.row({v: 1 for v in y}, "==", 1)
    for i in range(L):
        m.row({v: 1 for v in z[i]}, "==", 1)
    for c in range(L - 1):
        for j in range(J):
            m.row({z[c + 1][j]: 1, z[c][j]: -1, x[c]: -1}, "<=", 0)
            m.row({z[c][j]: 1, z[c + 1][j]: -1, x[c]: -1}, "<=", 0)
    y_one = [y[k] for k, d in enumerate(degrees) if d == 1]

    def accumulate(name, per_layer, forward):
        """hat (forward) or tilde (backward) accumulation of per-layer linear terms."""
        total = sum(max(term.values(), default=0) for term in per_layer)
        acc = [m.var(f"{name}{i}", upper=total) for i in range(L)]
        order = range(L) if forward else range(L - 1, -1, -1)
        prev = None
        for i in order:
            m.row({acc[i]: 1, **{v: -c for v, c in per_layer[i].items()}}, ">=", 0)
            if prev is not None:
                cut = x[i - 1] if forward else x[i]
                m.row({acc[i]: 1, acc[prev]: -1, cut: total,
                       **{v: -c for v, c in per_layer[i].items()}}, ">=", 0)
            prev = i
        return acc, total

    # Memory quantities in units of the largest option; constants become rhs terms.
    a_hat, a_tot = _accumulate_constant(m, x, [a / mem_unit for a in p.activation_bytes], "a")
    s_hat, s_tot = _accumulate_constant(m, x, [s / mem_unit for s in p.param_bytes], "s")
    fc_terms = [{z[i][j]: beta * p.forward_s[i][j] for j in range(J)} for i in range(L)]
    bc_terms = [{z[i][j]: beta * p.backward_s[i][j] for j in range(J)} for i in range(L)]
    sy_terms = [{z[i][j]: 2 * p.sync_bytes(p.param_bytes[i]) / W[j] for j in range(J)} for i in range(L)]
    fc_hat, fc_tot = accumulate("Fc", fc_terms, True)
    bc_tilde, bc_tot = accumulate("Bc", bc_terms, False)
    sy_tilde, sy_tot = accumulate("Sb", sy_terms, False)
    # Memory rows.
    for i in range(L):
        terms = {s_hat[i]: 4 + p.optimizer_state_factor}
        for k, mu in enumerate(mus):
            pik = m.var(f"p{i}_{k}", upper=a_tot)
            m.row({pik: 1, a_hat[i]: -1, y[k]: -a_tot}, ">=", -a_tot)
            terms[pik] = mu
        if y_one:
            q = m.var(f"q{i}", upper=s_tot)
            m.row({q: 1, s_hat[i]: -1}, "<=", 0)
            m.row({q: 1, y_one[0]: -s_tot}, "<=", 0)
            terms[q] = -2
        for j in range(J):
            terms[z[i][j]] = -p.memory_options_bytes[j] / mem_unit
        m.row(terms, "<=", -p.base_memory_bytes / mem_unit)
    # Transfers at cuts.
    comm = {}
    comm_max = 0.0
    for c in range(L - 1):
        o, g = p.output_bytes[c], p.grad_bytes[c + 1]
        for name, size, side in (("FU", o, c), ("FD", o, c + 1), ("BU", g, c + 1), ("BD", g, c)):
            top = size / w_min + lat
            comm_max = max(comm_max, top)
            v = m.var(f"{name}{c}", upper=top)
            m.row({v: 1, **{z[side][j]: -size / W[j] for j in range(J)}, x[c]: -top}, ">=", lat - top)
            comm[name, c] = v
    # Lags and their (mu - 1) multiples.
    lag_f_top = max(fc_tot, comm_max)
    lag_f = m.var("Df", upper=lag_f_top)
    for i in range(L):
        m.row({lag_f: 1, fc_hat[i]: -1}, ">=", 0)
    for c in range(L - 1):
        m.row({lag_f: 1, comm["FU", c]: -1}, ">=", 0)
        m.row({lag_f: 1, comm["FD", c]: -1}, ">=", 0)
    lag_b_top = max(bc_tot, comm_max)
    lag_b = [m.var(f"Db{i}", upper=lag_b_top) for i in range(L)]
    for i in range(L):
        m.row({lag_b[i]: 1, bc_tilde[i]: -1}, ">=", 0)
        if i < L - 1:
            m.row({lag_b[i]: 1, lag_b[i + 1]: -1}, ">=", 0)
            m.row({lag_b[i]: 1, comm["BU", i]: -1}, ">=", 0)
            m.row({lag_b[i]: 1, comm["BD", i]: -1}, ">=", 0)

    def times_mu_minus_one(name, lag, top):
        terms = {}
        for k, mu in enumerate(mus):
            if mu > 1:
                h = m.var(f"{name}_{k}", upper=top)
                m.row({h: 1, lag: -1, y[k]: -top}, ">=", -top)
                terms[h] = mu - 1
        return terms

    t_f = {}
    for i in range(L):
        for v, c in fc_terms[i].items():
            t_f[v] = t_f.get(v, 0) + c
    for c in range(L - 1):
        t_f[comm["FU", c]] = 1
        t_f[comm["FD", c]] = 1
    t_f.update(times_mu_minus_one("hf", lag_f, lag_f_top))
    mu_max = max(mus)
    t_top = (fc_tot + bc_tot + 4 * (L - 1) * comm_max + (mu_max - 1) * (lag_f_top + lag_b_top)
             + sy_tot + (2 + max(degrees)) * lat)
    t = m.var("t", upper=t_top)
    lat_sync = {y[k]: -(2 + d) * lat for k, d in enumerate(degrees) if d > 1}
    for i in range(L):
        sync = m.var(f"Sy{i}", upper=sy_tot + (2 + max(degrees)) * lat)
        terms = {sync: 1, sy_tilde[i]: -1, **lat_sync}
        if y_one:
            terms[y_one[0]] = sy_tot
        m.row(terms, ">=", 0)
        t_b = {}
        for q in range(i, L):
            for v, c in bc_terms[q].items():
                t_b[v] = t_b.get(v, 0) + c
        for c in range(i, L - 1):
            t_b[comm["BU", c]] = 1
            t_b[comm["BD", c]] = 1
        t_b.update(times_mu_minus_one(f"hb{i}", lag_b[i], lag_b_top))
        row = {t: 1, sync: -1}
        for v, c in list(t_f.items()) + list(t_b.items()):
            row[v] = row.get(v, 0) - c
        m.row(row, ">=", 0)
    # Rates: one worker per stage and replica.
    r_max = max(rates) if max(rates) > 0 else 1.0
    rho_terms = {z[L - 1][j]: rates[j] / r_max for j in range(J)}
    for c in range(L - 1):
        rho = m.var(f"rho{c}", upper=1.0)
        m.row({rho: 1, **{z[c][j]: -rates[j] / r_max for j in range(J)}, x[c]: -1}, ">=", -1)
        rho_terms[rho] = 1
    total = m.var("rho", upper=float(L))
    m.row({total: 1, **{v: -c for v, c in rho_terms.items()}}, ">=", 0)
    R = m.var("R", upper=float(L * max(degrees)))
    e_terms = {R: 1}
    for k, d in enumerate(degrees):
        e = m.var(f"e{k}", upper=float(L))
        m.row({e: 1, total: -1, y[k]: -L}, ">=", -L)
        e_terms[e] = -d
    m.row(e_terms, ">=", 0)
    a1, a2 = p.weights
    if a1 > 0:
        m.bilinear = (a1 * r_max, t, R)
    if a2 > 0:
        m.linear[t] = a2
    return m, {"x": x, "y": y, "z": z, "degrees": degrees}


def _accumulate_constant(m: _Model, x: list, values: list, name: str):
    """Forward (hat) accumulation of per-layer constants, cut by x."""
    total = sum(values)
    acc = [m.var(f"{name}hat{i}", upper=total) for i in range(len(values))]
    for i, value in enumerate(values):
        m.row({acc[i]: 1}, ">=", value)
        if i > 0:
            m.row({acc[i]: 1, acc[i - 1]: -1, x[i - 1]: total}, ">=", value)
    return acc, total


def _plan_from(values: list, index: dict, L: int) -> CoOptSolution:
    cuts = tuple(c for c, v in enumerate(index["x"]) if values[v] > 0.5)
    d = next(index["degrees"][k] for k, v in enumerate(index["y"]) if values[v] > 0.5)
    firsts = [first for first, _ in stage_bounds([c + 1 for c in cuts], L)]
    options = tuple(max(range(len(index["z"][i])), key=lambda j: values[index["z"][i][j]])
                    for i in firsts)
    return CoOptSolution(cuts, d, options)


# ----------------------------------------------------------------------------- backends

def solve_miqp(problem: CoOptProblem, backend: str = "gurobi",
               time_limit_s: float | None = None) -> Solved:
    """Solve the MIQP with gurobipy ("gurobi", falling back to SCIP) or SCIP ("scip")."""
    model, index = build_model(problem)
    fallback = ""
    if backend == "gurobi":
        try:
            result = _solve_gurobi(model, time_limit_s)
            return _answer(problem, index, "gurobi", result, "")
        except ImportError as exc:
            fallback = f"gurobipy cannot be imported ({exc}); solved with SCIP"
        except _GurobiRefused as exc:
            fallback = f"gurobipy refused the model ({exc}); solved with SCIP"
    result = _solve_scip(model, time_limit_s)
    return _answer(problem, index, "scip", result, fallback)


class _GurobiRefused(Exception):
    """gurobipy raised a GurobiError (licence size limit 10010, or a licence problem)."""


def _answer(problem, index, solver, result, fallback) -> Solved:
    status, values, gap = result
    if values is None:
        reason = ("no plan fits the memory options at any degree" if status == "infeasible"
                  else f"{solver} found no plan ({status})")
        return Solved(None, solver, reason=reason, fallback=fallback, status=status, gap=gap)
    plan = _plan_from(values, index, problem.num_layers)
    if not plan_fits(problem, plan):
        return Solved(None, solver, reason=f"{solver} returned a plan that does not fit memory",
                      fallback=fallback, status="numerical_error", gap=gap)
    return Solved(plan, solver, fallback=fallback, status=status, gap=gap)


def _solve_gurobi(model: _Model, time_limit_s):
    import gurobipy as gp

    try:
        env = gp.Env(params={"OutputFlag": 0})
        g = gp.Model(env=env)
        vs = [g.addVar(lb=lo, ub=(hi if math.isfinite(hi) else gp.GRB.INFINITY),
                       vtype=gp.GRB.BINARY if kind == "B" else gp.GRB.CONTINUOUS, name=name)
              for name, kind, lo, hi in zip(model.names, model.kinds, model.lower, model.upper)]
        for terms, sense, rhs in model.rows:
            expr = gp.LinExpr([c for c in terms.values()], [vs[v] for v in terms])
            g.addLConstr(expr, {"<=": gp.GRB.LESS_EQUAL, ">=": gp.GRB.GREATER_EQUAL,
                                "==": gp.GRB.EQUAL}[sense], rhs)
        obj = gp.QuadExpr(gp.LinExpr([c for c in model.linear.values()], [vs[v] for v in model.linear]))
        if model.bilinear:
            coef, a, b = model.bilinear
            obj.add(vs[a] * vs[b], coef)
        g.setObjective(obj, gp.GRB.MINIMIZE)
        g.Params.MIPGap = 1e-9
        g.Params.FeasibilityTol = _TOLERANCE
        g.Params.IntFeasTol = _TOLERANCE
        g.Params.NonConvex = 2
        if time_limit_s:
            g.Params.TimeLimit = time_limit_s
        g.optimize()
    except gp.GurobiError as exc:
        raise _GurobiRefused(f"GurobiError {exc.errno}: {exc}") from exc
    if g.Status in (gp.GRB.INFEASIBLE, gp.GRB.INF_OR_UNBD):  # bounded model: infeasible
        return "infeasible", None, math.inf
    if g.SolCount == 0:
        return ("time_limit" if g.Status == gp.GRB.TIME_LIMIT else f"status_{g.Status}"), None, math.inf
    status = "optimal" if g.Status == gp.GRB.OPTIMAL else "time_limit"
    gap = 0.0 if status == "optimal" else float(g.MIPGap)
    return status, [v.X for v in vs], gap


def _solve_scip(model: _Model, time_limit_s):
    import pyscipopt as scip

    s = scip.Model()
    s.hideOutput()
    vs = [s.addVar(name=name, vtype="B" if kind == "B" else "C", lb=lo,
                   ub=(hi if math.isfinite(hi) else None))
          for name, kind, lo, hi in zip(model.names, model.kinds, model.lower, model.upper)]
    for terms, sense, rhs in model.rows:
        expr = scip.quicksum(c * vs[v] for v, c in terms.items())
        if sense == "<=":
            s.addCons(expr <= rhs)
        elif sense == ">=":
            s.addCons(expr >= rhs)
        else:
            s.addCons(expr == rhs)
    objective = scip.quicksum(c * vs[v] for v, c in model.linear.items())
    if model.bilinear:
        # SCIP takes a linear objective: minimise an epigraph variable of the bilinear term.
        coef, a, b = model.bilinear
        epi = s.addVar(name="objective", vtype="C", lb=0.0, ub=None)
        s.addCons(epi >= coef * vs[a] * vs[b])
        objective = objective + epi
    s.setObjective(objective, "minimize")
    s.setParam("limits/gap", 0.0)
    s.setParam("numerics/feastol", _TOLERANCE)
    if time_limit_s:
        s.setParam("limits/time", time_limit_s)
    s.optimize()
    status = s.getStatus()
    if status == "infeasible":
        return "infeasible", None, math.inf
    if s.getNSols() == 0:
        return status, None, math.inf
    best = s.getBestSol()
    values = [s.getSolVal(best, v) for v in vs]
    gap = 0.0 if status == "optimal" else float(s.getGap())
    return ("optimal" if status == "optimal" else status), values, gap
