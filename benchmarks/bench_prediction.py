"""Profiling and prediction, judged out of sample: epoch wall and run bill, predicted vs measured,
each beside a naive baseline and the noise floor of identical runs.

One run brings up a local stack (`deployments.stack.up` on a free port in a scratch Zooid home,
with its container half unless `--no-docker`, so the durable stores and their caches start empty)
and runs `train/local` on two targets: the `zooid-local` process pool and, with `--docker`, the
`docker` target (a worker is a container of the worker image; the stack's S3 store). Every job:
digits, batch 16 per replica, SGD momentum 0.9, lr 0.05, seed 0, warm workers, `--epochs` epochs
(default 5) (`benchmarks.harness.train.digits_job`).

Two sets of configurations, run in this order on one stack:

- **in sample** (the fit set): what the run terms are learnt from, and what the assumed terms
  (`coordinator.plan.run_terms.ASSUMED`) were tuned on: `digits_cnn` Local-SGD 2x1 and
  `digits_mlp` pipeline 1x2 on the process pool; `digits_cnn` 2x1 on docker;
- **out of sample** (held out): what none of that saw: models known only by import path
  (`benchmarks.prediction_models:wide_mlp` on 3 workers, `:deep_cnn` as a pipeline 1x2), other
  worker counts (`digits_cnn` under `scaling=adabatch`, 1 -> 2 -> 4 replicas), and on docker
  `wide_mlp` 2x1. Run after the fit set, on the stores it filled, so their first plans use run
  terms measured on **other** jobs.

Each configuration runs as kinds, in this order:

- `fresh` (process pool only): a durable store of its own, nothing cached: it profiles the model
  on a worker, and every run term but its own start-up is the assumed one;
- `first`: the target's shared store, the job's first run there (its model profiled there; the
  run terms: the medians of the runs before it on that target, all of other jobs);
- `repeat` (x `--repeats`): the same job again on the same store (profile and terms cached).

Per run, from its own summary (what the report shows) and ledger:

- **epoch wall**: per epoch k >= 2, |predicted - measured| / measured, the prediction being the
  one in force for that epoch (`predicted_epoch_s`, recalibrated after every epoch,
  `planners.calibration`); the run's figure is the median over its epochs. **Baseline**: "the next
  epoch takes as long as the last" (epoch k predicted by epoch k - 1's measured seconds). Goal:
  the median over runs within 15 % **and** below the baseline's. Epoch 1 is judged apart, the
  same way: the epoch before it (0) held the workers' start-up and first steps, which the
  baseline carries over and the prediction must not;
- **run bill**: |plan.predicted_run_cost_usd - the ledger's total| / total, the first plan's
  prediction (made after the profile, before any epoch). **Baseline**: the median bill of the
  runs of other jobs that ended on that target before this one began (none before the target's
  first job: no baseline). Goal: within 20 % **and** below the baseline's, judged on the runs
  whose job is new to the store (`fresh`, `first`) and on all runs;
- **run wall**: the plan's `predicted_run_s` against the seconds from the plan (`planned_at`) to
  the flow run's end, with the same kind of baseline (other jobs' median); no goal;
- **noise floor**: for each job, |a - b| / mean(a, b) of consecutive runs on the shared store
  (`first` and `repeat`: the same job, same store) of the median epoch wall and of the bill.
  A prediction cannot be judged finer than this.

GPU (`--gpu`, on a CUDA machine): adds resnet18 and vgg11 on `synthetic:3x32x32:10:4096`,
batch 64, Local-SGD with 1 worker on the process pool (workers train on CUDA where they see it),
as held-out jobs. The GPU figures have a results file of their own, taken with no CPU model
(`GPU_RESULTS`).

    .venv/bin/python -m benchmarks.bench_prediction [--models [M ...]] [--epochs 5] [--repeats 2]
        [--no-docker] [--gpu] [--out PATH] [--keep]
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.harness.home import REPO, scratch
from benchmarks.harness.stack import local_stack, pool_summary
from benchmarks.harness.tables import fmt, median, pct, table
from benchmarks.harness.train import digits_job
from benchmarks.output import SOURCE, command_for, provenance, write_result

RESULTS = REPO / "benchmarks" / "results" / "prediction.md"
GPU_RESULTS = REPO / "benchmarks" / "results" / "prediction_gpu.md"
"""The GPU figures' own results file (`--models --gpu --out` it: `benchmarks.run_all`'s
`prediction_gpu` section; a CUDA machine runs no CPU model here)."""
SOURCES = (*SOURCE, "benchmarks/prediction_models.py", "benchmarks/harness/stack.py",
           "benchmarks/harness/replicas.py", "benchmarks/harness/train.py", "benchmarks/harness/tables.py")
"""The code it measures (the whole project: plans and the train flow's runs): its results file is stale
once one of these changed since the commit the file names (`benchmarks.staleness`)."""
TITLE = "Profiling and prediction, out of sample: epoch wall and run bill against naive baselines"

GPU_MODELS = ("resnet18", "vgg11")
GPU_DATASET, GPU_BATCH = "synthetic:3x32x32:10:4096", 64
DEFAULT_EPOCHS, DEFAULT_REPEATS = 5, 2
GOAL_EPOCH, GOAL_COST = 0.15, 0.20
IN_SAMPLE, HELD_OUT = "in sample", "out of sample"

PROFILE_LINE = re.compile(
    r"zooid profile of (?P<model>\S+) on (?P<where>.*?): model (?:measured in (?P<model_s>[\d.]+) s|from the cache), "
    r"store (?:measured in (?P<store_s>[\d.]+) s|from the cache); (?P<all_s>[\d.]+) s in all")


# --- configurations ----------------------------------------------------------------------

@dataclass(frozen=True)
class Config:
    """One job: its model, plan in words, target, set and TrainJob fields."""

    model: str
    plan: str
    target: str
    group: str
    params: dict = field(hash=False)

    @property
    def job(self) -> str:
        return f"{self.model} {self.plan} on {self.target}"


def configurations(epochs: int, docker: bool, models: list[str] | None = None, gpu: bool = False) -> list[Config]:
    """The fit set, then the held-out set (the module docstring), in run order; only the CPU jobs
    of `models` where given (none: the GPU jobs alone)."""
    job = lambda workers, **kw: digits_job(workers, epochs, True, **kw)  # noqa: E731
    out = []
    if models is None or models:
        out += [Config("digits_cnn", "local_sgd 2x1", "local", IN_SAMPLE, job(2, model="digits_cnn")),
                Config("digits_mlp", "pipeline 1x2", "local", IN_SAMPLE,
                       job(1, model="digits_mlp", strategy="pipeline", stages=2))]
        if docker:
            out.append(Config("digits_cnn", "local_sgd 2x1", "docker", IN_SAMPLE, job(2, model="digits_cnn")))
        out += [Config("benchmarks.prediction_models:wide_mlp", "local_sgd 3x1", "local", HELD_OUT,
                       job(3, model="benchmarks.prediction_models:wide_mlp")),
                Config("benchmarks.prediction_models:deep_cnn", "pipeline 1x2", "local", HELD_OUT,
                       job(1, model="benchmarks.prediction_models:deep_cnn", strategy="pipeline", stages=2)),
                Config("digits_cnn", "adabatch 1->4", "local", HELD_OUT,
                       job(1, model="digits_cnn", scaling="adabatch", max_workers=4, scale_every_epochs=1))]
        if docker:
            out.append(Config("benchmarks.prediction_models:wide_mlp", "local_sgd 2x1", "docker", HELD_OUT,
                              job(2, model="benchmarks.prediction_models:wide_mlp")))
    if models:
        out = [c for c in out if c.model in models]
    if gpu:
        out += [Config(model, "local_sgd 1x1", "local", HELD_OUT,
                       job(1, model=model, dataset=GPU_DATASET, batch_size=GPU_BATCH)) for model in GPU_MODELS]
    return out


def kinds(cfg: Config, repeats: int) -> list[str]:
    """The runs of `cfg` in order: a fresh store of its own (process pool only), then the shared store."""
    return (["fresh"] if cfg.target == "local" else []) + ["first"] + ["repeat"] * repeats


# --- per run -------------------------------------------------------------------------------

def _rel(predicted: float | None, measured: float | None) -> float | None:
    """predicted / measured - 1 (signed; None where either is missing or measured is 0)."""
    if predicted is None or not measured:
        return None
    return predicted / measured - 1


def _abs(x: float | None) -> float | None:
    return None if x is None else abs(x)


def run_record(cfg: Config, kind: str, summary: dict) -> dict:
    """The figures of one run (see the module docstring); the baselines are added later
    (`add_baselines`), from the runs before it."""
    epochs = sorted(summary["epochs"], key=lambda e: e["epoch"])
    plan = summary["plan"]
    pairs = [(prev, e) for prev, e in zip(epochs, epochs[1:]) if e.get("predicted_epoch_s") is not None]
    later, second = [p for p in pairs if p[1]["epoch"] >= 2], [p for p in pairs if p[1]["epoch"] == 1]
    e0 = epochs[0] if epochs else {}
    billed = float(summary["total_cost_usd"])
    terms = plan.get("run_terms") or {}
    # the run's prediction counts from the plan (`planned_at`) to the flow run's end
    flow_s = summary["flow_end_at"] - plan["planned_at"] if summary.get("flow_end_at") and plan.get("planned_at") \
        else None
    return {
        "job": cfg.job, "model": cfg.model, "plan": cfg.plan, "target": cfg.target, "group": cfg.group,
        "kind": kind, "run_id": summary["run_id"],
        "began": summary.get("submitted_at"), "ended": summary.get("seen_final_at"),
        "planned": f"{plan.get('strategy')} {plan.get('data_parallel')}x{plan.get('stages')}"
                   + (f" {plan.get('pipeline_schedule')} M={plan.get('microbatches')}" if plan.get("stages", 1) > 1 else ""),
        "epoch_error": median(_abs(_rel(e["predicted_epoch_s"], e["seconds"])) for _, e in later),
        "epoch_baseline": median(_abs(_rel(prev["seconds"], e["seconds"])) for prev, e in later),
        "epoch1_error": median(_abs(_rel(e["predicted_epoch_s"], e["seconds"])) for _, e in second),
        "epoch1_baseline": median(_abs(_rel(prev["seconds"], e["seconds"])) for prev, e in second),
        "wall_s": median(e["seconds"] for e in epochs[1:]),
        "predicted_cost": plan.get("predicted_run_cost_usd"), "billed": billed,
        "cost_error": _rel(plan.get("predicted_run_cost_usd"), billed), "cost_baseline": None,
        "predicted_run_s": plan.get("predicted_run_s"), "flow_s": flow_s,
        "run_s_error": _rel(plan.get("predicted_run_s"), flow_s), "run_s_baseline": None,
        "first_pred_s": plan.get("predicted_first_epoch_s"), "first_meas_s": e0.get("seconds"),
        "terms": {k: terms.get(k) for k in ("startup_s", "provision_s", "warmup_s", "epoch_overhead_s",
                                             "gap_s", "teardown_s", "stop_s")},
        "assumed": sorted(k for k, v in (terms.get("measured") or {}).items() if not v),
        "workers": [e.get("workers") for e in epochs],
        "epochs": [{"epoch": e["epoch"], "seconds": e["seconds"], "predicted_epoch_s": e.get("predicted_epoch_s"),
                    "workers": e.get("workers"), "replan": (e.get("replan") or {}).get("reason", "")} for e in epochs],
        "profile": None,
    }


def add_baselines(records: list[dict]) -> None:
    """Each run's bill and wall baselines: the median over the runs of other jobs on its target
    that ended before it began, as the error of predicting this run by it (None where no such run)."""
    for r in records:
        earlier = [o for o in records if o["target"] == r["target"] and o["job"] != r["job"]
                   and o["ended"] is not None and r["began"] is not None and o["ended"] <= r["began"]]
        if not earlier:
            continue
        r["cost_baseline"] = _rel(median(o["billed"] for o in earlier), r["billed"])
        r["run_s_baseline"] = _rel(median(o["flow_s"] for o in earlier), r["flow_s"])
        r["baseline_runs"] = len(earlier)


def profile_lines(api_url: str, run_ids: list[str]) -> dict[str, dict]:
    """Run id -> the last `zooid profile of ...` line its coordinator logged, parsed
    (`source`: measured or cache; `model_s`, `store_s`, `all_s`; `line`: the text)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName, LogFilter, LogFilterFlowRunId
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from coordinator.run.context import run_id_for

    found: dict[str, dict] = {}
    with temporary_settings(updates={PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["train"])), limit=200)
        ids = {run_id_for(fr.id): fr.id for fr in runs}
        for run_id in run_ids:
            if run_id not in ids:
                continue
            logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[ids[run_id]])),
                                    limit=200)
            for log in logs:
                m = PROFILE_LINE.search(log.message or "")
                if m:
                    found[run_id] = {"line": m.group(0), "all_s": float(m.group("all_s")),
                                     "model_s": float(m.group("model_s")) if m.group("model_s") else None,
                                     "store_s": float(m.group("store_s")) if m.group("store_s") else None,
                                     "source": "measured" if m.group("model_s") or m.group("store_s") else "cache"}
    return found


# --- judgments -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Judgment:
    """One figure over a set of runs: the prediction's and the baseline's median |error|."""

    what: str
    runs: int
    predicted: float | None
    baseline: float | None
    goal: float | None
    within: int = 0

    @property
    def verdict(self) -> str:
        if self.goal is None:
            return "no goal"
        if self.predicted is None:
            return "not measured"
        beats = self.baseline is None or self.predicted < self.baseline
        met = self.predicted <= self.goal and beats
        why = [] if met else ([f"above {100 * self.goal:.0f} %"] if self.predicted > self.goal else []) + (
            [] if beats else ["no better than the baseline"])
        return "**met**" if met else f"**not met** ({', '.join(why)})"


def judge(records: list[dict], what: str, key: str, goal: float | None) -> Judgment:
    """Median |error| of `key` and of its baseline (`<key>` with `_error` -> `_baseline`) over
    the runs that have both where a baseline exists (all runs with a figure where none does)."""
    base_key = key.replace("_error", "_baseline")
    with_base = [r for r in records if r.get(key) is not None and r.get(base_key) is not None]
    runs = with_base or [r for r in records if r.get(key) is not None]
    pred = median(abs(r[key]) for r in runs)
    return Judgment(what, len(runs), pred, median(abs(r[base_key]) for r in with_base) if with_base else None, goal,
                    sum(abs(r[key]) <= goal for r in runs) if goal is not None else 0)


def judgments(records: list[dict]) -> list[tuple[str, str, Judgment]]:
    """(set, target, judgment) for each set and target that ran, in sample beside out of sample."""
    out = []
    for target in dict.fromkeys(r["target"] for r in records):
        for group in (IN_SAMPLE, HELD_OUT):
            rs = [r for r in records if r["target"] == target and r["group"] == group]
            if not rs:
                continue
            new = [r for r in rs if r["kind"] in ("fresh", "first")]
            out += [(group, target, judge(rs, "epoch wall, epochs 2..", "epoch_error", GOAL_EPOCH)),
                    (group, target, judge(rs, "epoch 1 (the epoch after the start-up's)", "epoch1_error", GOAL_EPOCH)),
                    (group, target, judge(new, "run bill, the job's first runs (fresh, first)", "cost_error", GOAL_COST)),
                    (group, target, judge(rs, "run bill, every run", "cost_error", GOAL_COST)),
                    (group, target, judge(rs, "run wall, every run", "run_s_error", None))]
    return out


def noise_floor(records: list[dict]) -> list[dict]:
    """Per job: |a - b| / mean(a, b) of the median epoch wall and of the bill over consecutive
    runs on the shared store (`first`, `repeat`: the same job on the same store)."""
    out = []
    for job in dict.fromkeys(r["job"] for r in records):
        reps = [r for r in records if r["job"] == job and r["kind"] != "fresh" and r["wall_s"] is not None]
        pairs = list(zip(reps, reps[1:]))
        if not pairs:
            continue
        d = lambda a, b: abs(a - b) / ((a + b) / 2) if a + b > 0 else None  # noqa: E731
        out.append({"job": job, "group": reps[0]["group"], "pairs": len(pairs),
                    "wall": median(d(a["wall_s"], b["wall_s"]) for a, b in pairs),
                    "bill": median(d(a["billed"], b["billed"]) for a, b in pairs),
                    "walls": [r["wall_s"] for r in reps], "bills": [r["billed"] for r in reps]})
    return out


# --- report --------------------------------------------------------------------------------

def _usd(x) -> str:
    return "-" if x is None else f"${x:.3g}"


def _profile_cell(p: dict | None) -> str:
    if p is None:
        return "no log line"
    if p["source"] == "cache":
        return "cached"
    parts = [f"{name} {p[name + '_s']:.1f} s" if p[name + "_s"] is not None else f"{name} cached"
             for name in ("model", "store")]
    return f"measured: {', '.join(parts)}"


def jobs_line(cfgs: list[Config], epochs: int, repeats: int) -> str:
    """The results file's first paragraph, from the configurations that ran: each model's data and
    batch, the targets, the sets, how a configuration runs, the baselines and the goals' rule."""
    data: dict[tuple, list[str]] = {}
    for c in cfgs:
        data.setdefault((c.params["dataset"], c.params["batch_size"]), []).append(f"`{c.model}`")
    jobs = "; ".join(f"{', '.join(dict.fromkeys(models))} on {dataset}, batch {batch} per replica"
                     for (dataset, batch), models in data.items())
    local, docker = (any(c.target == t for c in cfgs) for t in ("local", "docker"))
    fit, held = ([c for c in cfgs if c.group == g] for g in (IN_SAMPLE, HELD_OUT))
    held_kinds = [what for what, ran in (
        ("models known only by import path", any(":" in c.model for c in held)),
        ("other worker counts", any(c.params.get("scaling") == "adabatch" for c in held)),
        ("the docker target's second job", any(c.target == "docker" for c in held)),
        ("models trained on CUDA", any(c.params["dataset"] == GPU_DATASET for c in held))) if ran]
    fresh = "`fresh` (process pool only: a store of its own, nothing cached, the run terms assumed), "
    text = [f"Every job: {jobs}; SGD momentum 0.9, lr 0.05, seed 0, warm workers, {epochs} epochs, on "
            + " and ".join(t for t, ran in (("the process pool", local), ("docker", docker)) if ran) + ".",
            f"Each configuration runs as {fresh if local else ''}`first` (the target's shared store, the job's first "
            f"run there: run terms learnt from the runs of other jobs before it) and {repeats} x `repeat`.",
            "In sample: the fit set, which the run terms are learnt from and the assumed terms were tuned on."
            if fit else "No job of the fit set ran: every run term was learnt from the runs here or assumed.",
            f"Out of sample: {', '.join(held_kinds)}{', run after the fit set' if fit else ''}." if held else "",
            ("Baselines: for an epoch, the last epoch's measured seconds; for a run's bill and wall, the median of "
             "the runs of other jobs that ended on that target before it began. A goal is met only where the "
             "prediction's median |error| is within the goal and below the baseline's. Method: the module "
             "docstring of `benchmarks/bench_prediction.py`.")]
    return " ".join(t for t in text if t)


def render(records: list[dict], failures: list[dict], cfgs: list[Config], epochs: int, repeats: int) -> str:
    """The results file's body (its header: `benchmarks.output.write_result`)."""
    found = judgments(records)
    noise = noise_floor(records)
    lines = [jobs_line(cfgs, epochs, repeats), "", "## Summary", "",
             *table(["set", "target", "figure", "runs", "prediction, median abs error",
                     "baseline, median abs error", "goal", "verdict"])]
    for group, target, j in found:
        lines.append(f"| {group} | {target} | {j.what} | {j.runs} | {pct(j.predicted)} | {pct(j.baseline)} | "
                     f"{'-' if j.goal is None else f'<= {100 * j.goal:.0f} %'} | {j.verdict} |")
    if noise:
        for group in (IN_SAMPLE, HELD_OUT):
            ns = [n for n in noise if n["group"] == group]
            if ns:
                lines.append("")
                lines.append(f"Noise floor, {group} (the same job run again on the same store, {len(ns)} jobs): the "
                             f"measured median epoch wall differs by a median {pct(median(n['wall'] for n in ns))} "
                             f"(max {pct(max(n['wall'] for n in ns))}) and the bill by "
                             f"{pct(median(n['bill'] for n in ns))} (max {pct(max(n['bill'] for n in ns))}).")
    if failures:
        lines += ["", f"{len(failures)} run(s) failed: " + "; ".join(f"{f['job']} {f['kind']}: {f['error']}"
                                                                    for f in failures)]
    lines += ["", "## Every run", "",
              "epoch err = median over epochs 2.. of |predicted - measured| / measured (baseline: the last epoch's "
              "seconds); epoch 1 = the same for epoch 1 alone; wall = measured median epoch wall (epochs 1..); bill err = the first plan's bill / the ledger's "
              "- 1 (baseline: the median bill of the other jobs' runs before it on the target, over `n` runs); run s = "
              "predicted_run_s / the seconds from the plan to the flow run's end; assumed = run terms not yet measured on this target at "
              "the plan; profile = the coordinator's `zooid profile of ...` log line.", "",
              *table(["set", "job", "kind", "planned", "profile", "epoch err", "baseline", "epoch 1 err", "baseline", "wall s", "bill predicted",
                      "billed", "bill err", "baseline (n)", "run s", "run s err", "baseline", "assumed"])]
    for r in records:
        lines.append(
            f"| {r['group']} | {r['job']} | {r['kind']} | {r['planned']} | {_profile_cell(r['profile'])} | "
            f"{pct(r['epoch_error'])} | {pct(r['epoch_baseline'])} | {pct(r['epoch1_error'])} | "
            f"{pct(r['epoch1_baseline'])} | {fmt(r['wall_s'], '{:.3f}')} | "
            f"{_usd(r['predicted_cost'])} | {_usd(r['billed'])} | {pct(r['cost_error'], signed=True)} | "
            f"{pct(r['cost_baseline'], signed=True)} ({r.get('baseline_runs', 0)}) | "
            f"{fmt(r['predicted_run_s'], '{:.1f}')} / {fmt(r['flow_s'], '{:.1f}')} | {pct(r['run_s_error'], signed=True)} | "
            f"{pct(r['run_s_baseline'], signed=True)} | {', '.join(r['assumed']) or '-'} |")
    if noise:
        lines += ["", "## Noise floor", "",
                  *table(["set", "job", "median epoch wall s (first, repeats)", "difference", "bill", "difference"])]
        for n in noise:
            lines.append(f"| {n['group']} | {n['job']} | {', '.join(fmt(w, '{:.3f}') for w in n['walls'])} | "
                         f"{pct(n['wall'])} | {', '.join(_usd(b) for b in n['bills'])} | {pct(n['bill'])} |")
    lines += ["", "## Run terms of the first plan", "",
              "Seconds; the plan's `run_terms` (medians of the target's cached samples, or assumed where not yet "
              "measured).", "",
              *table(["job", "kind", "start-up", "provision", "warm-up", "epoch overhead", "gap", "teardown", "stop"])]
    for r in records:
        t = r["terms"]
        lines.append(f"| {r['job']} | {r['kind']} | " + " | ".join(
            fmt(t.get(k)) for k in ("startup_s", "provision_s", "warmup_s", "epoch_overhead_s", "gap_s",
                                   "teardown_s", "stop_s")) + " |")
    lines += ["", "## Every epoch", "",
              "predicted = `predicted_epoch_s` in force for the epoch; baseline = the epoch before's measured seconds; "
              "re-plan = the decision taken after the epoch.", "",
              *table(["job", "kind", "epoch", "workers", "measured s", "predicted s", "error", "baseline error",
                      "re-plan"])]
    for r in records:
        prev = None
        for e in r["epochs"]:
            lines.append(
                f"| {r['job']} | {r['kind']} | {e['epoch']} | {e['workers']} | {e['seconds']:.3f} | "
                f"{fmt(e['predicted_epoch_s'], '{:.3f}')} | {pct(_rel(e['predicted_epoch_s'], e['seconds']), signed=True)} | "
                f"{pct(_rel(prev, e['seconds']), signed=True)} | {e['replan'].replace('|', '/') or '-'} |")
            prev = e["seconds"]
    lines += ["", "The benchmark before this one judged its predictions on the configurations its assumed terms were "
              "tuned on (`git show 43126399bd69:benchmarks/results/prediction.md`)."]
    return "\n".join(lines) + "\n"


def _print_run(r: dict) -> None:
    print(f"{r['group']:13s} {r['job']:60s} {r['kind']:6s}: epoch err {pct(r['epoch_error'])} (baseline "
          f"{pct(r['epoch_baseline'])}), bill {_usd(r['predicted_cost'])} predicted vs {_usd(r['billed'])} billed "
          f"({pct(r['cost_error'], signed=True)}), epochs "
          + ", ".join(f"{e['seconds']:.3f}/{fmt(e['predicted_epoch_s'], '{:.3f}')}" for e in r["epochs"]), flush=True)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_prediction", description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=DEFAULT_EPOCHS)
    parser.add_argument("--repeats", type=int, default=DEFAULT_REPEATS,
                        help="runs of each configuration after its first on the shared store (the noise floor needs 1)")
    parser.add_argument("--no-docker", dest="docker", action="store_false", help="the process pool only")
    parser.add_argument("--models", nargs="*", default=None,
                        help="run only the CPU jobs of these models (none: the GPU jobs alone)")
    parser.add_argument("--gpu", action="store_true", help="also resnet18 and vgg11, 1 worker, on CUDA")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder (stack, stores, logs)")
    args = parser.parse_args(argv)
    if args.epochs < 4:
        parser.error("--epochs must be at least 4 (epoch 0 starts the workers, epoch 1 is judged apart, "
                     "the baseline needs two more)")
    gpu = args.gpu
    if gpu:
        import torch

        if not torch.cuda.is_available():
            parser.error("--gpu: this machine has no CUDA device")

    prov = provenance()
    records, failures = [], []
    cfgs = configurations(args.epochs, args.docker, args.models, gpu)
    docker = any(c.target == "docker" for c in cfgs)
    with scratch("pred", home=True, keep=args.keep) as home, local_stack(home, docker=docker) as state:
        shared = {"local": {}, "docker": {"store": state["docker"]["store"]} if docker else {}}
        for cfg in cfgs:
            for kind in kinds(cfg, args.repeats):
                store = {"store": f"file://{home}/fresh-{len(records) + len(failures)}"} if kind == "fresh" \
                    else shared[cfg.target]
                try:
                    summary = pool_summary({**cfg.params, **store}, target=cfg.target)
                except Exception as exc:  # the run is recorded as failed; the others still run
                    failures.append({"job": cfg.job, "kind": kind, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
                    print(f"{cfg.job} {kind} failed: {exc}", flush=True)
                    continue
                records.append(run_record(cfg, kind, summary))
                _print_run(records[-1])
        add_baselines(records)
        try:
            lines = profile_lines(state["api_url"], [r["run_id"] for r in records])
        except Exception as exc:  # the figures stand without it; the table says "no log line"
            print(f"could not read the profile log lines: {type(exc).__name__}: {exc}", flush=True)
            lines = {}
        for r in records:
            r["profile"] = lines.get(r["run_id"])
        command = command_for("benchmarks.bench_prediction", flags=(
            ("--epochs", args.epochs, DEFAULT_EPOCHS), ("--repeats", args.repeats, DEFAULT_REPEATS),
            ("--models", " ".join(args.models) if args.models is not None else None, None),
            ("--no-docker", not args.docker, False), ("--gpu", args.gpu, False),
            ("--out", _shown(args.out), _shown(RESULTS)), ("--keep", args.keep, False)))
        write_result(args.out, TITLE, command, prov, render(records, failures, cfgs, args.epochs, args.repeats),
                     detail=machine_detail(docker), echo=True)
        (home / "records.json").write_text(json.dumps(records, indent=1))
    return 0 if not failures else 1


def machine_detail(docker: bool) -> str:
    """What shares the machine's cores during the benchmark."""
    if docker:
        return ("the Prefect server, the pool's and the Docker worker, the coordinator and the training workers "
                "(processes or containers) share these cores")
    return "the Prefect server, the pool's worker, the coordinator and the training workers (processes) share these cores"


def _shown(path: Path) -> Path:
    """`path` as the command names it: from the repository root where it lies inside."""
    path = path.resolve()
    return path.relative_to(REPO) if path.is_relative_to(REPO) else path


if __name__ == "__main__":
    raise SystemExit(main())
