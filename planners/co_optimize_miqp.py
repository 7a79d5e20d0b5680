"""FuncPipe's co-optimisation as an MIQP (Sec. 3.4, App. B, App. C), for gurobipy or SCIP.

The model is built once into a small solver-neutral form (`_Model`: variables, linear
constraints, an objective with at most one bilinear term), one `_Builder` step per part of
the formulation below, and handed to gurobipy or to pyscipopt. gurobipy's bundled licence
refuses models over 2000 variables or constraints, or over 200 variables when the objective
has a quadratic term (GurobiError 10010); then, or when gurobipy cannot be imported, the
same model goes to SCIP and the answer says why.

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
    """The MIQP of the module docstring and the index of its decision variables, built part by
    part in a fixed order (the order numbers the variables and rows)."""
    b = _Builder(problem)
    b.decisions()
    b.accumulations()
    b.memory_rows()
    b.transfers()
    b.lags()
    b.iteration_time()
    b.stage_rates()
    b.objective()
    return b.m, {"x": b.x, "y": b.y, "z": b.z, "degrees": b.degrees}


class _Builder:
    """The MIQP's constants for one problem and the steps that add its parts to `m`; each step
    keeps the variables later steps read (`x`, `y`, `z`, the accumulations, the lags, `t`)."""

    def __init__(self, problem: CoOptProblem):
        p = self.p = problem
        self.L, self.J = p.num_layers, p.num_options
        self.degrees = list(p.valid_degrees())
        if not self.degrees:
            raise ValueError("dp_degrees: no degree divides microbatches, so there is no model")
        self.mus = [p.microbatches // d for d in self.degrees]
        self.lat = p.latency_s
        self.W = p.bandwidth_bytes_per_s
        self.mem_unit = max(p.memory_options_bytes)
        self.m = _Model()

    def decisions(self) -> None:
        """The binaries x_c (cut after layer c), y_k (d = D_k), z_ij (layer i uses option j),
        their one-hot rows (3d) and stage consistency (3c): |z_{c+1,j} - z_cj| <= x_c."""
        m, L, J = self.m, self.L, self.J
        self.x = x = [m.var(f"x{c}", "B") for c in range(L - 1)]
        self.y = y = [m.var(f"y{k}", "B") for k in range(len(self.degrees))]
        self.z = z = [[m.var(f"z{i}_{j}", "B") for j in range(J)] for i in range(L)]
        m.row({v: 1 for v in y}, "==", 1)
        for i in range(L):
            m.row({v: 1 for v in z[i]}, "==", 1)
        for c in range(L - 1):
            for j in range(J):
                m.row({z[c + 1][j]: 1, z[c][j]: -1, x[c]: -1}, "<=", 0)
                m.row({z[c][j]: 1, z[c + 1][j]: -1, x[c]: -1}, "<=", 0)
        self.y_one = [y[k] for k, d in enumerate(self.degrees) if d == 1]

    def accumulations(self) -> None:
        """App. C (1): the hat sums a_hat, s_hat (memory, in units of the largest option) and
        Fc_hat (forward compute), the tilde sums Bc_tilde (backward compute) and Sb_tilde
        (the sync's 2 phi s_i / W_j), each cut by x; keeps the per-layer terms for the times."""
        p, z, L, J, W, unit = self.p, self.z, self.L, self.J, self.W, self.mem_unit
        beta = p.contention
        activations, params = [a / unit for a in p.activation_bytes], [s / unit for s in p.param_bytes]
        self.a_hat, self.a_tot = _accumulate_constant(self.m, self.x, activations, "a")
        self.s_hat, self.s_tot = _accumulate_constant(self.m, self.x, params, "s")
        self.fc_terms = [{z[i][j]: beta * p.forward_s[i][j] for j in range(J)} for i in range(L)]
        self.bc_terms = [{z[i][j]: beta * p.backward_s[i][j] for j in range(J)} for i in range(L)]
        sy_terms = [{z[i][j]: 2 * p.sync_bytes(p.param_bytes[i]) / W[j] for j in range(J)} for i in range(L)]
        self.fc_hat, self.fc_tot = self._accumulate("Fc", self.fc_terms, True)
        self.bc_tilde, self.bc_tot = self._accumulate("Bc", self.bc_terms, False)
        self.sy_tilde, self.sy_tot = self._accumulate("Sb", sy_terms, False)

    def _accumulate(self, name: str, per_layer: list, forward: bool) -> tuple[list, float]:
        """hat (forward) or tilde (backward) accumulation of per-layer linear terms."""
        m, x, L = self.m, self.x, self.L
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

    def memory_rows(self) -> None:
        """(3b) at every layer, linearised as App. C (7): sum_k mu_k p_ik + (4 + f) s_hat_i
        - 2 q_i + s0 <= sum_j M_j z_ij, with p_ik >= a_hat_i y_k and q_i = y_[D=1] s_hat_i."""
        m, p, y = self.m, self.p, self.y
        a_tot, s_tot = self.a_tot, self.s_tot
        for i in range(self.L):
            terms = {self.s_hat[i]: 4 + p.optimizer_state_factor}
            for k, mu in enumerate(self.mus):
                pik = m.var(f"p{i}_{k}", upper=a_tot)
                m.row({pik: 1, self.a_hat[i]: -1, y[k]: -a_tot}, ">=", -a_tot)
                terms[pik] = mu
            if self.y_one:
                q = m.var(f"q{i}", upper=s_tot)
                m.row({q: 1, self.s_hat[i]: -1}, "<=", 0)
                m.row({q: 1, self.y_one[0]: -s_tot}, "<=", 0)
                terms[q] = -2
            for j in range(self.J):
                terms[self.z[i][j]] = -p.memory_options_bytes[j] / self.mem_unit
            m.row(terms, "<=", -p.base_memory_bytes / self.mem_unit)

    def transfers(self) -> None:
        """App. C (2), Technique 2 with x_c: FU_c, FD_c (layer c's output up from c's workers
        and down to c + 1's) and BU_c, BD_c (layer c + 1's gradient back) at every cut."""
        m, p, z, W, lat = self.m, self.p, self.z, self.W, self.lat
        w_min = min(W)
        self.comm, self.comm_max = {}, 0.0
        for c in range(self.L - 1):
            o, g = p.output_bytes[c], p.grad_bytes[c + 1]
            for name, size, side in (("FU", o, c), ("FD", o, c + 1), ("BU", g, c + 1), ("BD", g, c)):
                top = size / w_min + lat
                self.comm_max = max(self.comm_max, top)
                v = m.var(f"{name}{c}", upper=top)
                m.row({v: 1, **{z[side][j]: -size / W[j] for j in range(self.J)}, self.x[c]: -top},
                      ">=", lat - top)
                self.comm[name, c] = v

    def lags(self) -> None:
        """Technique 3's epigraphs of the pipeline's lags: Df >= Fc_hat_i, FU_c, FD_c, and
        Db_i >= Db_{i+1}, Bc_tilde_i, BU_i, BD_i."""
        m, L, comm = self.m, self.L, self.comm
        self.lag_f_top = max(self.fc_tot, self.comm_max)
        self.lag_f = m.var("Df", upper=self.lag_f_top)
        for i in range(L):
            m.row({self.lag_f: 1, self.fc_hat[i]: -1}, ">=", 0)
        for c in range(L - 1):
            m.row({self.lag_f: 1, comm["FU", c]: -1}, ">=", 0)
            m.row({self.lag_f: 1, comm["FD", c]: -1}, ">=", 0)
        self.lag_b_top = max(self.bc_tot, self.comm_max)
        lag_b = self.lag_b = [m.var(f"Db{i}", upper=self.lag_b_top) for i in range(L)]
        for i in range(L):
            m.row({lag_b[i]: 1, self.bc_tilde[i]: -1}, ">=", 0)
            if i < L - 1:
                m.row({lag_b[i]: 1, lag_b[i + 1]: -1}, ">=", 0)
                m.row({lag_b[i]: 1, comm["BU", i]: -1}, ">=", 0)
                m.row({lag_b[i]: 1, comm["BD", i]: -1}, ">=", 0)

    def _times_mu_minus_one(self, name: str, lag: int, top: float) -> dict:
        """App. C (3): (mu - 1) * lag as sum_k (mu_k - 1) h_k, h_k >= lag - U (1 - y_k)."""
        terms = {}
        for k, mu in enumerate(self.mus):
            if mu > 1:
                h = self.m.var(f"{name}_{k}", upper=top)
                self.m.row({h: 1, lag: -1, self.y[k]: -top}, ">=", -top)
                terms[h] = mu - 1
        return terms

    def _forward_time(self) -> dict:
        """t_f = sum_i Fc_i + sum_c (FU_c + FD_c) + sum_k (mu_k - 1) hf_k, as terms."""
        t_f = {}
        for i in range(self.L):
            for v, c in self.fc_terms[i].items():
                t_f[v] = t_f.get(v, 0) + c
        for c in range(self.L - 1):
            t_f[self.comm["FU", c]] = 1
            t_f[self.comm["FD", c]] = 1
        t_f.update(self._times_mu_minus_one("hf", self.lag_f, self.lag_f_top))
        return t_f

    def _backward_time(self, i: int) -> dict:
        """t_b(i) = sum_{q >= i} Bc_q + sum_{c >= i} (BU_c + BD_c) + sum_k (mu_k - 1) hb_ik."""
        t_b = {}
        for q in range(i, self.L):
            for v, c in self.bc_terms[q].items():
                t_b[v] = t_b.get(v, 0) + c
        for c in range(i, self.L - 1):
            t_b[self.comm["BU", c]] = 1
            t_b[self.comm["BD", c]] = 1
        t_b.update(self._times_mu_minus_one(f"hb{i}", self.lag_b[i], self.lag_b_top))
        return t_b

    def _sync_time(self, i: int, sync_top: float) -> int:
        """App. C (4): Sy_i >= Sb_tilde_i - U y_[D=1] + sum_k [D_k > 1] (2 + D_k) lat y_k."""
        sync = self.m.var(f"Sy{i}", upper=sync_top)
        terms = {sync: 1, self.sy_tilde[i]: -1,
                 **{self.y[k]: -(2 + d) * self.lat for k, d in enumerate(self.degrees) if d > 1}}
        if self.y_one:
            terms[self.y_one[0]] = self.sy_tot
        self.m.row(terms, ">=", 0)
        return sync

    def iteration_time(self) -> None:
        """App. C (5): t >= t_f + t_b(i) + Sy_i for every layer i (Technique 3 on t_iter)."""
        t_f = self._forward_time()
        L, lat, top_degree = self.L, self.lat, max(self.degrees)
        t_top = (self.fc_tot + self.bc_tot + 4 * (L - 1) * self.comm_max
                 + (max(self.mus) - 1) * (self.lag_f_top + self.lag_b_top)
                 + self.sy_tot + (2 + top_degree) * lat)
        self.t = self.m.var("t", upper=t_top)
        for i in range(L):
            sync = self._sync_time(i, self.sy_tot + (2 + top_degree) * lat)
            t_b = self._backward_time(i)
            row = {self.t: 1, sync: -1}
            for v, c in list(t_f.items()) + list(t_b.items()):
                row[v] = row.get(v, 0) - c
            self.m.row(row, ">=", 0)

    def stage_rates(self) -> None:
        """App. C (6), one worker per stage and replica: rho_c >= sum_j r_j z_cj - U (1 - x_c)
        (plus the last layer's stage), e_k >= rho - U (1 - y_k), R >= sum_k D_k e_k; rates in
        units of the largest, `r_max`."""
        m, L, J, z = self.m, self.L, self.J, self.z
        rates = self.p.rates()
        r_max = self.r_max = max(rates) if max(rates) > 0 else 1.0
        rho_terms = {z[L - 1][j]: rates[j] / r_max for j in range(J)}
        for c in range(L - 1):
            rho = m.var(f"rho{c}", upper=1.0)
            m.row({rho: 1, **{z[c][j]: -rates[j] / r_max for j in range(J)}, self.x[c]: -1}, ">=", -1)
            rho_terms[rho] = 1
        total = m.var("rho", upper=float(L))
        m.row({total: 1, **{v: -c for v, c in rho_terms.items()}}, ">=", 0)
        self.R = m.var("R", upper=float(L * max(self.degrees)))
        e_terms = {self.R: 1}
        for k, d in enumerate(self.degrees):
            e = m.var(f"e{k}", upper=float(L))
            m.row({e: 1, total: -1, self.y[k]: -L}, ">=", -L)
            e_terms[e] = -d
        m.row(e_terms, ">=", 0)

    def objective(self) -> None:
        """(3a): minimise alpha1 * r_max * t * R (the cost) + alpha2 * t (the time)."""
        a1, a2 = self.p.weights
        if a1 > 0:
            self.m.bilinear = (a1 * self.r_max, self.t, self.R)
        if a2 > 0:
            self.m.linear[self.t] = a2


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
