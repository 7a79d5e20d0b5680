"""Benchmark the co-optimisation solvers side by side: exact combinatorial, SCIP, gurobipy.

A synthetic 96-layer model profiled on FuncPipe's eight memory options (512 MB to 10 GB,
Sec. 5.1; compute speeds up with the vCPU share of the memory, bandwidth grows with memory)
is merged by balanced compute time to L = 4 ... 32 layers. Every solver's plan is re-scored
with `planners.co_optimize.evaluate`. gurobipy runs only where its bundled size-limited
licence accepts the model (at most 200 variables with a quadratic objective).

    .venv/bin/python -m benchmarks.bench_co_optimize [--scip-time-limit 60] [--sizes 4 8 ...] [--out PATH]
"""
from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

from benchmarks.harness.tables import median, table
from benchmarks.output import command_for, provenance, write_result
from planners.co_optimize import CoOptProblem, evaluate, merge_layers, parse_problem
from planners.co_optimize_exact import solve_exact
from planners.co_optimize_miqp import model_size, solve_miqp

MB = 2 ** 20
MEMORY_MB = [512, 1024, 2048, 3072, 4096, 6144, 8192, 10240]
BANDWIDTH_MB_PER_S = [40, 60, 80, 90, 100, 110, 115, 120]
SIZES = [4, 8, 12, 16, 24, 32]
DEGREES = [1, 2, 4, 8, 16, 32]
WEIGHTS = [1.0, 5e-4]          # dollars per iteration + 5e-4 dollars per second of iteration
RESULTS = Path(__file__).resolve().parent / "results" / "co_optimize.md"
SOURCES = ("core/errors.py", "core/stage_memory.py", "planners/checks.py", "planners/co_optimize*.py",
           "requirements.lock", "benchmarks/harness/tables.py")
"""The code it measures (the co-optimisers alone): its results file is stale once one of these changed
since the commit the file names (`benchmarks.staleness`)."""
GUROBI_QUADRATIC_LIMIT = 200


def _speed(memory_mb: float) -> float:
    """Relative compute speed of a function with this memory (vCPU share, sublinear above 1)."""
    vcpu = memory_mb / 1769
    return vcpu if vcpu <= 1 else 1 + 0.6 * (min(vcpu, 6) - 1)


def model_doc(num_layers: int = 96, seed: int = 0) -> dict:
    """A co-optimize document for a synthetic model (a few parameter-heavy layers)."""
    rng = random.Random(seed)
    layers = []
    for _ in range(num_layers):
        base = rng.uniform(0.005, 0.1)
        heavy = rng.random() < 0.1
        layers.append({
            "forward_s": [base / _speed(m) for m in MEMORY_MB],
            "backward_s": [2 * base / _speed(m) for m in MEMORY_MB],
            "output_bytes": rng.uniform(0.5, 8) * MB,
            "activation_bytes": rng.uniform(2, 20) * MB,
            "param_bytes": (rng.uniform(20, 60) if heavy else rng.uniform(0.1, 5)) * MB,
        })
    return {"layers": layers, "memory_options_bytes": [m * MB for m in MEMORY_MB],
            "bandwidth_bytes_per_s": [b * MB for b in BANDWIDTH_MB_PER_S], "latency_s": 0.02,
            "contention": 1.1, "base_memory_bytes": 300 * MB, "dp_degrees": DEGREES,
            "microbatches": 32, "price_per_byte_s": 1.6667e-5 / 2 ** 30, "weights": WEIGHTS}


def time_exact(problem: CoOptProblem, repeats: int = 3):
    """Median wall and CPU time of the exact solver, its re-scored objective and plan."""
    walls, cpus, plan = [], [], None
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        plan = solve_exact(problem)
        walls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - start_cpu)
    objective = evaluate(problem, plan.cuts, plan.d, plan.options)[2]
    return median(walls), median(cpus), objective, plan


def time_miqp(problem: CoOptProblem, backend: str, limit: float):
    start = time.perf_counter()
    solved = solve_miqp(problem, backend=backend, time_limit_s=limit)
    elapsed = time.perf_counter() - start
    objective = None
    if solved.plan is not None:
        objective = evaluate(problem, solved.plan.cuts, solved.plan.d, solved.plan.options)[2]
    return elapsed, objective, solved


def main(argv=None) -> int:
    """Run the benchmark and write the markdown table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scip-time-limit", type=float, default=60.0)
    parser.add_argument("--sizes", type=int, nargs="*", default=SIZES)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    prov = provenance()
    base = parse_problem(model_doc())
    rows = []
    for L in args.sizes:
        problem, _ = merge_layers(base, L)
        variables, constraints = model_size(problem)
        exact_s, exact_cpu, exact_obj, plan = time_exact(problem)
        scip_s, scip_obj, scip = time_miqp(problem, "scip", args.scip_time_limit)
        if variables <= GUROBI_QUADRATIC_LIMIT:
            gurobi_s, gurobi_obj, gurobi = time_miqp(problem, "gurobi", args.scip_time_limit)
            gurobi_cell = f"{gurobi_s:.3f} s, {gurobi_obj:.6g} ({gurobi.solver}, {gurobi.status})"
        else:
            gurobi_cell = f"licence refuses ({variables} variables > {GUROBI_QUADRATIC_LIMIT})"
        scip_cell = f"{scip_s:.2f} s, {scip_obj:.6g}" if scip_obj is not None else f"{scip_s:.2f} s, no plan"
        speedup = f"{scip_s / exact_s:,.0f}x" if scip.status == "optimal" else "n/a (not proven)"
        rows.append(f"| {L} | {variables} / {constraints} | {exact_s:.3f} s ({exact_cpu:.3f} s CPU) | {exact_obj:.6g} | "
                    f"d={plan.d}, {len(plan.cuts) + 1} stages | {scip_cell} | {scip.status} | "
                    f"{scip.gap:.3g} | {speedup} | {gurobi_cell} |")
        print(rows[-1], flush=True)
    command = command_for("benchmarks.bench_co_optimize", argv)
    text = "\n".join([
        f"Synthetic 96-layer model merged by balanced compute time to L layers; J = 8 memory options "
        f"({MEMORY_MB[0]} MB to {MEMORY_MB[-1]} MB), K = {len(DEGREES)} data-parallel degrees {DEGREES}, "
        f"M = 32 micro-batches, weights {WEIGHTS} (dollars + dollars per second). Every objective is the "
        f"plan re-scored by `planners.co_optimize.evaluate`. Exact time: median of 3. SCIP time limit "
        f"{args.scip_time_limit:.0f} s; gap is SCIP's final relative gap. Speed-up = SCIP time / exact "
        f"time where SCIP proved optimality. gurobipy runs where its bundled licence accepts the model "
        f"(at most {GUROBI_QUADRATIC_LIMIT} variables with a quadratic objective).",
        "",
        *table(["L", "MIQP vars / rows", "exact time", "exact objective", "exact plan", "SCIP time, objective",
                "SCIP status", "SCIP gap", "speed-up", "gurobipy"]),
        *rows, ""])
    write_result(args.out, "co-optimize: exact combinatorial solver vs SCIP vs gurobipy", command, prov, text,
                 detail="wall times are inflated by other users' work; CPU time is the exact solver's own process time")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
