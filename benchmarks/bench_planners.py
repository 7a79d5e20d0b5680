"""Planner speed and quality, side by side with the papers' own methods, in one run.

- partition: the exact solver (planners/partition.py) for L = 32..512 layers into up to
  K = 16 stages, next to Hydrozoa's bounded DP (App. A.2: a V x V grid of caps on t and r,
  communication minimised under each pair, the best runtime kept), which is what the
  exact solver replaces. Runtimes are re-scored by one evaluator (`pipeline_runtime`).
- hybrid: D x M selection time for L = 32 and 128 layers and clusters of 16 and 64.
- provision: the full search over 3 types x 256 workers x every PS count, BSP and ASP,
  and Cynthia's Alg. 1 (Theorem 4.1 bounds, minimum PS count, stop at the first feasible
  worker count) on random instances, scored by the same model.

    .venv/bin/python -m benchmarks.bench_planners [--quick] [--out PATH]

Writes markdown to `benchmarks/results/planners_partition_provision.md` (or `--out`). Timings are
medians of the CPU time of repeated runs (single-threaded), on whatever machine runs it (the
results file says which). About two minutes on 2 shared cores.
"""
from __future__ import annotations

import argparse
import math
import platform
import random
import time
from pathlib import Path

import numpy as np

from benchmarks.harness.tables import median, rounds, table
from benchmarks.output import command_for, provenance, write_result
from planners.hybrid import HybridProblem, best_candidate, plan_hybrid
from planners.partition import (PartitionProblem, PipelineLayer, best_of, cut_times,
                                pipeline_runtime, plan_partition)
from planners.worker_count import (InstanceType, LossModel, ProvisionProblem, evaluate,
                                plan_provision)

RESULTS = Path(__file__).resolve().parent / "results" / "planners_partition_provision.md"
SOURCES = ("core/errors.py", "core/stage_memory.py", "planners/checks.py", "planners/bottleneck_partition.py",
           "planners/hybrid.py", "planners/partition.py", "planners/sync_time.py", "planners/worker_count.py",
           "requirements.lock", "benchmarks/harness/tables.py")
"""The code it measures (the planners alone): its results file is stale once one of these changed since the
commit the file names (`benchmarks.staleness`)."""
TITLE = "Planners: partition, hybrid, provision"

def timed(fn, repeats: int):
    """(median CPU seconds, last result) over `repeats` calls. CPU time of this process,
    not wall time, so that other work on a shared machine does not inflate it (the
    planners are single-threaded numpy)."""
    results = []
    seconds = rounds({"fn": lambda: results.append(fn())}, repeats, clock=time.process_time)["fn"]
    return median(seconds), results[-1] if results else None


# --- partition -----------------------------------------------------------------------------

GRIDS = (8, 32)

def make_layers(kind: str, n: int, rng: random.Random) -> tuple[PipelineLayer, ...]:
    """Synthetic profiles: `uniform` (independent forward/backward), `correlated`
    (backward = 2 x forward, as for conv nets) or `heavy` (Pareto-tailed times)."""
    layers = []
    for _ in range(n):
        if kind == "uniform":
            f, b = rng.uniform(0.001, 0.02), rng.uniform(0.002, 0.04)
        elif kind == "correlated":
            f = rng.uniform(0.001, 0.02)
            b = 2 * f
        else:
            f, b = 0.002 * rng.paretovariate(1.5), 0.004 * rng.paretovariate(1.5)
        layers.append(PipelineLayer(forward_s=f, backward_s=b,
                                    output_bytes=rng.randint(10_000, 4_000_000)))
    return tuple(layers)


def hydrozoa_grid(problem: PartitionProblem, grid: int) -> dict[int, tuple[int, ...]]:
    """Hydrozoa App. A.2: for each of grid x grid caps (T on t, R on r) the partition of
    least communication per stage count subject to the caps; the best runtime per count."""
    n, top = len(problem.layers), min(problem.max_stages, len(problem.layers))
    f = np.array([x.forward_s for x in problem.layers])
    b = np.array([x.backward_s for x in problem.layers])
    c = np.concatenate((cut_times(problem), [np.inf]))
    pf, pb = np.concatenate(([0], np.cumsum(f))), np.concatenate(([0], np.cumsum(b)))
    span_f = pf[None, 1:] - pf[:-1, None]  # stage a..b
    span_b = pb[None, 1:] - pb[:-1, None]
    upper = np.triu(np.ones((n, n), dtype=bool))
    hi_c = c[:-1].max() if n > 1 else 0.0
    caps_t = np.linspace(f.min(), max(f.sum(), hi_c), grid)
    caps_r = np.linspace(b.min(), max(b.sum(), hi_c), grid)
    best: dict[int, tuple[float, tuple[int, ...]]] = {}
    for t_cap in caps_t:
        for r_cap in caps_r:
            fits = upper & (span_f <= t_cap) & (span_b <= r_cap)
            cost = np.where(fits[0], 0.0, np.inf)  # level 1: stage 0..j
            parents = []
            for k in range(1, top + 1):
                if k > 1:
                    # stage i+1..j after a prefix ending at i, cut i within both caps
                    ok_cut = c[:-1] <= min(t_cap, r_cap)
                    total = cost[:-1, None] + c[:-1, None]
                    total = np.where(ok_cut[:, None] & fits[1:, :], total, np.inf)
                    arg = np.argmin(total, axis=0)
                    cost = total[arg, np.arange(n)]
                    parents.append(arg)
                if np.isfinite(cost[n - 1]):
                    cuts, j = [], n - 1
                    for arg in reversed(parents):
                        j = int(arg[j])
                        cuts.append(j)
                    cuts = tuple(reversed(cuts))
                    rt = pipeline_runtime(problem, cuts)
                    if k not in best or rt < best[k][0]:
                        best[k] = (rt, cuts)
    return {k: cuts for k, (_, cuts) in best.items()}


def bench_partition(sizes, repeats: int, grids=GRIDS, fine_grid_up_to: int = 256) -> tuple[list[str], list[dict]]:
    """The table's rows and, per (L, profile), the exact solver's CPU s and each grid's CPU s and excess."""
    head = " | ".join(f"grid V={v}: CPU s | grid V={v}: excess" for v in grids)
    rows = [f"| L | profile | exact: CPU s | exact: runtime (s) | {head} |",
            "|---|---|---|---|" + "---|---|" * len(grids)]
    found_all = []
    for n in sizes:
        for kind in ("uniform", "correlated", "heavy"):
            rng = random.Random(1000 + n)
            problem = PartitionProblem(layers=make_layers(kind, n, rng),
                                       bandwidth_bytes_per_s=125e6, microbatches=8,
                                       max_stages=16, transport="store", latency_s=0.02)
            t_exact, found = timed(lambda: plan_partition(problem), repeats)
            exact = best_of(found).runtime_s
            cells, grid = [], {}
            for v in grids:
                if v > grids[0] and n > fine_grid_up_to:
                    cells.append("- | -")
                    continue
                t_grid, cuts = timed(lambda: hydrozoa_grid(problem, v), 1)
                approx = min(pipeline_runtime(problem, c) for c in cuts.values())
                grid[v] = (t_grid, approx / exact - 1)
                cells.append(f"{t_grid:.3f} | {100 * (approx / exact - 1):+.2f} %")
            rows.append(f"| {n} | {kind} | {t_exact:.3f} | {exact:.4f} | {' | '.join(cells)} |")
            found_all.append({"layers": n, "kind": kind, "exact_s": t_exact, "grid": grid})
    return rows, found_all


# --- hybrid --------------------------------------------------------------------------------

def bench_hybrid(repeats: int) -> list[str]:
    rows = table(["L", "cluster G", "sync", "CPU s", "(A, B, M) chosen", "candidates"])
    for n in (32, 128):
        for g in (16, 64):
            rng = random.Random(7 + n)
            layers = tuple(PipelineLayer(forward_s=x.forward_s, backward_s=x.backward_s,
                                         output_bytes=x.output_bytes,
                                         param_bytes=rng.randint(0, 20_000_000))
                           for x in make_layers("uniform", n, rng))
            problem = HybridProblem(
                pipeline=PartitionProblem(layers=layers, bandwidth_bytes_per_s=125e6,
                                          microbatches=1, max_stages=16, latency_s=0.02),
                cluster_size=g, global_batch=1024, microbatch_size=8,
                alpha_s_per_byte=2e-10, beta_s=0.002)
            t, cands = timed(lambda: plan_hybrid(problem), repeats)
            best = best_candidate(cands)
            rows.append(f"| {n} | {g} | ring | {t:.3f} | ({best.data_parallel}, {best.stages}, "
                        f"{best.microbatches}) | {len(cands)} |")
    return rows


# --- provision -----------------------------------------------------------------------------

def random_provision(rng: random.Random, mode: str, max_workers: int = 256) -> ProvisionProblem:
    """Instances in the range of Cynthia's Table 2 workloads on three EC2-like types."""
    kinds = tuple(InstanceType(name=name, cpu_flops=cpu * rng.uniform(0.8, 1.2),
                               bandwidth_bytes_per_s=bw * rng.uniform(0.8, 1.2),
                               price_per_hour=price)
                  for name, cpu, bw, price in (("m4.xlarge", 4 * 2.4e9, 93.75e6, 0.20),
                                               ("c5.2xlarge", 8 * 3.0e9, 312e6, 0.34),
                                               ("m5.4xlarge", 16 * 2.5e9, 625e6, 0.768)))
    beta0 = rng.uniform(50, 500)
    return ProvisionProblem(
        mode=mode, w_iter_flops=rng.uniform(5e9, 2e11), g_param_bytes=rng.uniform(1e6, 2.5e8),
        c_prof_flops=rng.uniform(1e8, 3e9), b_prof_bytes_per_s=rng.uniform(5e6, 1.2e8),
        c_base_flops=9.6e9, loss_model=LossModel(beta0=beta0, beta1=rng.uniform(0, 0.9) * beta0),
        target_loss=rng.uniform(0.2, 0.9), deadline_s=10 ** rng.uniform(3, 5),
        instance_types=kinds, max_workers=max_workers)


def cynthia(problem: ProvisionProblem):
    """Cynthia Alg. 1 with Theorem 4.1's bounds, scored by the contract's model."""
    best = None
    b0, b1, l_g, t_g = (problem.loss_model.beta0, problem.loss_model.beta1,
                        problem.target_loss, problem.deadline_s)
    w, g = problem.w_iter_flops, problem.g_param_bytes
    for kind in problem.instance_types:
        c, bw = kind.cpu_flops, kind.bandwidth_bytes_per_s
        r = min(problem.c_base_flops * c / (problem.c_prof_flops * c),
                bw * problem.c_base_flops / (problem.b_prof_bytes_per_s * c))  # Eq. 12
        if problem.mode == "BSP":
            s = max(1, math.ceil(b0 / l_g - b1))
            lower = max(1, math.ceil(w * s / (t_g * c)))                      # Eq. 16
            u = min(r, t_g * bw / (2 * s * g))                                # Eq. 17
            n_ps = max(1, math.ceil(lower / u))                               # Eq. 18
            upper = math.ceil(min(u * n_ps, math.sqrt(w * n_ps * bw / (2 * g * c))))  # Eq. 19
        else:
            lower = max(1, math.ceil((w * (b0 - b1) / (c * t_g * l_g)) ** 2))  # Eq. 13
            n_ps = max(1, math.ceil(lower / r))                               # Eq. 22
            upper = math.ceil(r * n_ps)                                       # Eq. 23
        for n_wk in range(lower, min(upper, problem.max_workers) + 1):
            if n_ps > n_wk:
                continue
            plan = evaluate(problem, kind, n_wk, n_ps)
            if plan.time_s <= t_g:
                if best is None or plan.cost < best.cost:
                    best = plan
                break
    return best


def bench_provision(repeats: int, instances: int) -> list[str]:
    rows = table(["mode", "search", "CPU ms", "instances", "Zooid feasible", "Cynthia finds none", "Cynthia costlier",
                  "median / max excess"])
    for mode in ("BSP", "ASP"):
        rng = random.Random(3 if mode == "BSP" else 4)
        problems = [random_provision(rng, mode) for _ in range(instances)]
        t, _ = timed(lambda: plan_provision(problems[0]), repeats)
        feasible = none = costlier = 0
        excess = []
        for problem in problems:
            exact = plan_provision(problem)
            if exact is None:
                continue
            feasible += 1
            theirs = cynthia(problem)
            if theirs is None:
                none += 1
            elif theirs.cost > exact.cost * (1 + 1e-9):
                costlier += 1
                excess.append(theirs.cost / exact.cost - 1)
        ex = (f"{100 * median(excess):.1f} % / {100 * max(excess):.1f} %"
              if excess else "-")
        rows.append(f"| {mode} | 3 types x 256 workers x all PS counts | {1000 * t:.1f} | "
                    f"{instances} | {feasible} | {none} | {costlier} | {ex} |")
    return rows


# --- report --------------------------------------------------------------------------------

def _span(values, fmt: str) -> str:
    lo, hi = fmt.format(min(values)), fmt.format(max(values))
    return lo if lo == hi else f"{lo}-{hi}"


def partition_findings(found: list[dict]) -> str:
    """What the partition table shows, computed from it."""
    fine = max(GRIDS)
    at = 128 if any(r["layers"] == 128 for r in found) else max(r["layers"] for r in found)
    at_128 = [r["exact_s"] for r in found if r["layers"] == at]
    largest = max(r["layers"] for r in found)
    worst = max((r for r in found if r["layers"] == largest), key=lambda r: r["exact_s"])
    fine_rows = [r for r in found if fine in r["grid"]]
    ratio = [r["grid"][fine][0] / r["exact_s"] for r in fine_rows if r["exact_s"] > 0]
    excess = [r["grid"][fine][1] for r in fine_rows]
    text = (f"The exact solver takes {_span(at_128, '{:.3f}')} s for {at} "
            f"layers into up to 16 stages (goal: well under 1 s) and returns every stage count's optimum in the "
            "same call. The grid's error grows with L because its V caps are spread evenly over [min f, sum f] "
            "while the optimum's bottleneck is near sum f / K")
    if ratio:
        text += (f"; V = {fine} costs {_span(ratio, '{:.0f}')}x the exact solver's time and is up to "
                 f"{100 * max(excess):.1f} % off")
    why = (" (most partitions share the same giant-layer bottleneck, so more labels survive)"
           if worst["kind"] == "heavy" else "")
    return text + f". The slowest exact solve at L = {largest} is the `{worst['kind']}` profile, {worst['exact_s']:.2f} s{why}."


def render(partition: tuple[list[str], list[dict]], hybrid: list[str], provision: list[str],
           repeats: int, provision_repeats: int, instances: int) -> str:
    rows, found = partition
    return "\n".join([
        f"Times are the *CPU* seconds of the planner process (other work shares the cores, so wall time "
        f"is higher), median of {repeats} runs for partition and hybrid, of {provision_repeats} for provision; "
        f"Python {platform.python_version()}, numpy {np.__version__}. All planners are single-threaded numpy.", "",
        "## Partition", "",
        "`python -m planners partition`: the exact solver (`planners/partition.py` on "
        "`planners/bottleneck_partition.py`: a DP whose labels carry the running maxima t and r, pruned "
        "only by a proven dominance rule and by bounds from feasible partitions) against Hydrozoa's "
        "bounded DP (App. A.2: V x V caps on t and r, least communication under each pair), for K = 16 "
        "stages, M = 8 micro-batches, store transport (125 MB/s, 20 ms), synthetic layers: `uniform` "
        "(independent forward/backward times), `correlated` (backward = 2 x forward), `heavy` "
        "(Pareto-tailed times). Every partition is re-scored by the one contract evaluator "
        "(`pipeline_runtime`); \"excess\" is the grid's best runtime over the exact optimum (the exact "
        "solver's is the least runtime over all partitions; tests check it against brute-force "
        "enumeration).", "",
        *rows, "",
        partition_findings(found), "",
        "## Hybrid", "",
        "`python -m planners hybrid`: every (A, B) with A * B <= G and a whole number of micro-batches, "
        "each with its jointly optimal partition (pipeline runtime plus the slowest stage's ring "
        "allreduce, both in one exact solve), global batch 1024, micro-batch 8, 2e-10 s/B alpha, 2 ms "
        "beta, 20 MB of parameters per layer at most.", "",
        *hybrid, "",
        "## Provision", "",
        f"`python -m planners provision`: the full search over 3 instance types x 1..256 workers x "
        f"1..n_wk parameter servers (32,896 pairs per type) under the contract's model, on {instances} "
        "random instances per mode in the range of Cynthia's workloads, next to Cynthia's Alg. 1 "
        "(Theorem 4.1 bounds, Eq. 18/22 minimum PS count, stop at the first feasible worker count) "
        "scored by the same model. \"Cynthia costlier\": instances where its plan costs more than the "
        "true minimum; \"finds none\": a feasible plan exists but its bounds exclude every one.", "",
        *provision])


def main(argv: list[str] | None = None) -> int:
    """Run every section and write the markdown."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_planners", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, one repeat")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    prov = provenance()
    repeats = 1 if args.quick else 3
    provision_repeats, instances = (1, 40) if args.quick else (5, 200)
    sizes = (32, 64) if args.quick else (32, 64, 128, 256, 512)
    body = render(bench_partition(sizes, repeats), bench_hybrid(repeats),
                  bench_provision(provision_repeats, instances), repeats, provision_repeats, instances)
    command = command_for("benchmarks.bench_planners", flags=[("--quick", args.quick, False),
                                                              ("--out", args.out.resolve(), RESULTS)])
    write_result(args.out, TITLE, command, prov, body, echo=True,
                 detail="the planners are single-threaded numpy; times are CPU seconds of this process")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
