"""Profiling and prediction as a user sees them: epoch wall and run cost, predicted vs measured.

One run brings up a local stack (`deployments.stack.up` on a free port in a scratch home, so
the durable store and its caches start empty) and runs `train/local` on the `zooid-local`
process pool (`benchmarks.harness.stack.pool_summary`) for every configuration:

- models: `digits_mlp` and `digits_cnn` (registry names) and
  `benchmarks.prediction_models:wide_mlp` (known only by its import path), on `digits`;
  batch 16 per replica, SGD momentum 0.9, lr 0.05, seed 0, warm workers, static scaling
  (`benchmarks.harness.train.digits_job`), `--epochs` epochs (default 5);
- plans: Local-SGD 2x1 (`strategy=local_sgd`, 2 workers, averaged once per epoch) and
  pipeline 1x2 (`strategy=pipeline`, 1 replica, `stages=2`, the planner's micro-batches and
  schedule): two worker processes on the machine's two cores;
- and `digits_cnn` under `scaling=adabatch` (1 -> 2 -> 4 replicas, doubling every epoch):
  the first plan predicts each epoch at the count the policy will run;
- each configuration runs 1 + `--repeats` times back to back. Run 0 is a first run: a
  durable store of its own, nothing cached, so it profiles the model on a worker and plans
  with the start-up that worker measured and the other run terms assumed. The later runs use
  the stack's store: the first of them profiles the model there, the others read the cache
  (`cache/profiles`, `cache/stores`), and the run terms (start-up, per-epoch overhead, gaps,
  provision, teardown; `cache/timings`) are kept per target and offer, shared by every model.

Per run, from the run's own summary (`RunSummary`, what the report shows):

- epoch wall: the median over epochs 1.. of |predicted_epoch_s - seconds| / seconds, where
  `predicted_epoch_s` is the prediction in force for that epoch (calibrated after every
  epoch, `planners.calibration`). Goal <= 15 %;
- run cost: |plan.predicted_run_cost_usd - total_cost_usd| / total_cost_usd, the first
  plan's whole-run bill (made after the profile) against the ledger. Goal <= 20 %;
- the first epoch, predicted (`predicted_first_epoch_s`: start-up it cannot hide, warm-up)
  vs measured, and what the difference costs at the plan's price (its workers and the
  coordinator, billed like one more worker), beside the bill's own miss;
- epoch 0's iteration: the profile's predicted iteration (nothing calibrated yet) vs the
  measured one, the quantity the benchmark before 858a312 measured;
- the profile: the coordinator's `zooid profile of ...` log line, read back from the flow
  run's logs: measured (seconds for the model, the store and in all) or from the cache.

Noise floor: per configuration, the repeats' run-to-run difference |a - b| / mean(a, b) of
the measured median epoch wall (epochs 1..) and of the bill, over consecutive repeats.

Before: the result file of the previous benchmark, from git (`git show
cabc397:benchmarks/results/prediction.md`), its command and summary quoted verbatim.

GPU (`--gpu`, on a CUDA machine): adds resnet18 and vgg11 on `synthetic:3x32x32:10:4096`,
batch 64, Local-SGD with 1 worker on the same pool (workers train on CUDA where they see it).
The GPU figures have a results file of their own, taken with no CPU model (`GPU_COMMAND`).

    .venv/bin/python -m benchmarks.bench_prediction [--models M ...] [--epochs 5] [--repeats 2]
        [--gpu] [--out PATH] [--keep]
"""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from benchmarks.harness.home import REPO, scratch
from benchmarks.harness.stack import local_stack, pool_summary
from benchmarks.harness.tables import fmt, median, table
from benchmarks.harness.train import digits_job
from benchmarks.output import SOURCE, command_for, provenance, write_result

RESULTS = REPO / "benchmarks" / "results" / "prediction.md"
GPU_RESULTS = REPO / "benchmarks" / "results" / "prediction_gpu.md"
SOURCES = (*SOURCE, "benchmarks/prediction_models.py", "benchmarks/harness/stack.py",
           "benchmarks/harness/replicas.py", "benchmarks/harness/train.py", "benchmarks/harness/tables.py")
"""The code it measures (the whole project: plans and the train flow's runs): its results file is stale
once one of these changed since the commit the file names (`benchmarks.staleness`)."""
GPU_COMMAND = f".venv/bin/python -m benchmarks.bench_prediction --models --gpu --out {GPU_RESULTS.relative_to(REPO)}"
"""The GPU figures alone, in a results file of their own (a CUDA machine runs no CPU model here)."""
TITLE = "Profiling and prediction: epoch wall and run cost, predicted vs measured"

CPU_MODELS = ("digits_mlp", "digits_cnn", "benchmarks.prediction_models:wide_mlp")
GPU_MODELS = ("resnet18", "vgg11")
GPU_DATASET, GPU_BATCH = "synthetic:3x32x32:10:4096", 64
DEFAULT_EPOCHS, DEFAULT_REPEATS = 5, 2
GOAL_EPOCH, GOAL_COST = 0.15, 0.20
ADABATCH_MODEL = "digits_cnn"
BEFORE_COMMIT, BEFORE_PATH = "cabc397", "benchmarks/results/prediction.md"
DELETING_COMMIT = "858a312"

PROFILE_LINE = re.compile(
    r"zooid profile of (?P<model>\S+) on (?P<where>.*?): model (?:measured in (?P<model_s>[\d.]+) s|from the cache), "
    r"store (?:measured in (?P<store_s>[\d.]+) s|from the cache); (?P<all_s>[\d.]+) s in all")


# --- configurations ----------------------------------------------------------------------

def configurations(models: list[str], gpu: bool, epochs: int) -> list[dict]:
    """Each model as Local-SGD 2x1 and pipeline 1x2 (CPU), or Local-SGD 1x1 (GPU)."""
    out = []
    for model in models:
        out.append({"model": model, "plan": "local_sgd 2x1", "device": "cpu",
                    "params": digits_job(2, epochs, True, model=model)})
        out.append({"model": model, "plan": "pipeline 1x2", "device": "cpu",
                    "params": digits_job(1, epochs, True, model=model, strategy="pipeline", stages=2)})
    if models:  # a policy that adds workers as it goes: 1 -> 2 -> 4 replicas
        out.append({"model": ADABATCH_MODEL, "plan": "adabatch 1->4", "device": "cpu",
                    "params": digits_job(1, epochs, True, model=ADABATCH_MODEL, scaling="adabatch", max_workers=4,
                                         scale_every_epochs=1)})
    if gpu:
        for model in GPU_MODELS:
            out.append({"model": model, "plan": "local_sgd 1x1", "device": "cuda",
                        "params": digits_job(1, epochs, True, model=model, dataset=GPU_DATASET,
                                             batch_size=GPU_BATCH)})
    return out


# --- per run -------------------------------------------------------------------------------

def _rel(predicted: float | None, measured: float | None) -> float | None:
    """predicted / measured - 1 (signed; None where either is missing or measured is 0)."""
    if predicted is None or not measured:
        return None
    return predicted / measured - 1


def run_record(cfg: dict, index: int, summary: dict) -> dict:
    """The figures of one run (see the module docstring)."""
    epochs = sorted(summary["epochs"], key=lambda e: e["epoch"])
    plan = summary["plan"]
    later = [e for e in epochs if e["epoch"] >= 1 and e.get("predicted_epoch_s") is not None]
    epoch_errors = [abs(_rel(e["predicted_epoch_s"], e["seconds"])) for e in later]
    e0 = epochs[0] if epochs else {}
    billed = float(summary["total_cost_usd"])
    price = float(plan.get("price_per_worker_s") or 0.0)
    first_pred, first_meas = plan.get("predicted_first_epoch_s"), e0.get("seconds")
    terms = plan.get("run_terms") or {}
    flow_s = (summary["flow_end_at"] - summary["flow_start_at"]
              if summary.get("flow_start_at") and summary.get("flow_end_at") else None)
    return {
        "model": cfg["model"], "plan": cfg["plan"], "device": cfg["device"], "run": index,
        "run_id": summary["run_id"], "status": summary["status"], "planned": f"{plan.get('strategy')} "
        f"{plan.get('data_parallel')}x{plan.get('stages')}" + (f" {plan.get('pipeline_schedule')} M={plan.get('microbatches')}"
                                                               if plan.get("stages", 1) > 1 else ""),
        "epoch_error": median(epoch_errors),
        "wall_s": median(e["seconds"] for e in later),
        "predicted_cost": plan.get("predicted_run_cost_usd"), "billed": billed,
        "cost_error": _rel(plan.get("predicted_run_cost_usd"), billed),
        "first_pred_s": first_pred, "first_meas_s": first_meas,
        "first_exposed_s": (e0.get("startup") or {}).get("exposed_s"),
        "predicted_exposed_s": max(0.0, first_pred - float(plan.get("predicted_epoch_s") or 0.0)
                                   - float(terms.get("warmup_s") or 0.0)) if first_pred is not None else None,
        "startups": [],  # each worker's start-up seconds, from the ledger
        "first_miss_usd": (first_meas - first_pred) * (int(plan.get("workers") or 0) + 1) * price
        if first_pred is not None and first_meas is not None else None,
        "iteration0_error": _rel(e0.get("predicted_iteration_s"), e0.get("measured_iteration_s")),
        "iteration_error": median(abs(x) for x in (_rel(e.get("predicted_iteration_s"), e.get("measured_iteration_s"))
                                                    for e in later) if x is not None),
        "predicted_run_s": plan.get("predicted_run_s"), "flow_s": flow_s,
        "terms": {k: terms.get(k) for k in ("startup_s", "provision_s", "warmup_s", "epoch_overhead_s",
                                             "gap_s", "teardown_s", "stop_s")},
        "assumed": sorted(k for k, v in (terms.get("measured") or {}).items() if not v),
        "worker_seconds": summary.get("worker_seconds") or {},
        "switched": sum(bool((e.get("replan") or {}).get("switched")) for e in epochs),
        "epochs": [{"epoch": e["epoch"], "seconds": e["seconds"], "predicted_epoch_s": e.get("predicted_epoch_s"),
                    "overhead_s": e.get("overhead_s"), "critical_busy_s": e.get("critical_busy_s"),
                    "predicted_iteration_s": e.get("predicted_iteration_s"),
                    "measured_iteration_s": e.get("measured_iteration_s"),
                    "exposed_s": (e.get("startup") or {}).get("exposed_s"),
                    "replan": (e.get("replan") or {}).get("reason", "")} for e in epochs],
        "profile": None,
    }


def ledger_startups(summary: dict) -> list[float]:
    """Each worker's billed start-up seconds (launch to ready) from the run's ledger, by rank:
    the `ledger` (cost.json) that `pool_summary` read from the run's own durable store."""
    rows = (summary.get("ledger") or {}).get("rows")
    if rows is None:
        raise KeyError(f"no ledger for {summary.get('run_id')}")
    per: dict[str, list] = {}
    for row in rows:
        if row.get("kind") == "worker" and row.get("status") == "startup":
            entry = per.setdefault(row.get("worker") or row.get("resource"), [row.get("rank") or 0, 0.0])
            entry[1] += float(row["seconds"])
    return [v for _, v in sorted(per.values())]


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


# --- summary -------------------------------------------------------------------------------

def goal_stats(records: list[dict], key: str, goal: float) -> dict:
    """Median and worst |error| over runs and how many are within `goal`."""
    errors = [abs(r[key]) for r in records if r.get(key) is not None]
    return {"n": len(errors), "median": median(errors), "max": max(errors) if errors else None,
            "within": sum(e <= goal for e in errors)}


def noise_floor(records: list[dict]) -> list[dict]:
    """Per configuration: |a - b| / mean(a, b) of the median epoch wall and of the bill over
    consecutive repeats (runs 1..; run 0 filled the caches)."""
    out = []
    for cfg in dict.fromkeys((r["model"], r["plan"]) for r in records):
        reps = [r for r in records if (r["model"], r["plan"]) == cfg and r["run"] >= 1 and r["wall_s"] is not None]
        pairs = list(zip(reps, reps[1:]))
        if not pairs:
            continue
        d = lambda a, b: abs(a - b) / ((a + b) / 2) if a + b > 0 else None
        out.append({"model": cfg[0], "plan": cfg[1], "pairs": len(pairs),
                    "wall": median(d(a["wall_s"], b["wall_s"]) for a, b in pairs),
                    "bill": median(d(a["billed"], b["billed"]) for a, b in pairs),
                    "walls": [r["wall_s"] for r in reps], "bills": [r["billed"] for r in reps]})
    return out


# --- before: the previous benchmark's figures, from git ----------------------------------

def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout


def before_section() -> list[str]:
    """The previous result file's command and summary lines, quoted verbatim with where
    they come from, and what 858a312 deleted (from git)."""
    source = f"git show {BEFORE_COMMIT}:{BEFORE_PATH}"
    try:
        text = _git("show", f"{BEFORE_COMMIT}:{BEFORE_PATH}")
    except (subprocess.CalledProcessError, OSError) as exc:
        return [f"Before: `{source}` could not be read ({type(exc).__name__})."]
    lines = text.splitlines()
    picked = []  # (line number, text)
    for i, line in enumerate(lines, 1):
        if i == 1 or line.strip().startswith(".venv/bin/python -m benchmarks.bench_prediction"):
            picked.append((i, line.strip()))
    in_summary = False
    for i, line in enumerate(lines, 1):
        if line.startswith("## "):
            in_summary = line.strip() == "## Summary"
            continue
        if in_summary and line.lstrip().startswith("- "):
            picked.append((i, line))
    picked.sort()
    out = [f"Quoted verbatim from `{source}` (each line after its line number), the results of "
           "the benchmark as it was before the shared-host corrections were deleted: per-iteration "
           "period predicted from the profile with the co-run slowdown, wake costs and the store "
           "collective probe, vs the steady-state period measured in instrumented worker processes "
           "(no Prefect, no epoch overhead):", ""]
    out += ["```text"] + [f"{i}: {l}" for i, l in picked] + ["```"]  # `N:` keeps a quoted `# title` no heading
    try:
        numstat = _git("show", "--numstat", "--format=", DELETING_COMMIT)
        deleted = _git("show", "--diff-filter=D", "--name-only", "--format=", DELETING_COMMIT).split()
        rows = [l.split("\t") for l in numstat.splitlines() if l.count("\t") == 2]
        removed = {p: int(d) for a, d, p in rows if d.isdigit()}
        added_all = sum(int(a) for a, d, p in rows if a.isdigit())
        removed_all = sum(removed.values())
        out += ["", f"What `{DELETING_COMMIT}` deleted in their favour of per-epoch calibration (`git show --numstat "
                f"{DELETING_COMMIT}`): the files {', '.join(f'`{p}` ({removed.get(p, 0)} lines)' for p in deleted)}; "
                f"`profiling/store_probe.py` lost {removed.get('profiling/store_probe.py', 0)} lines (the store collective "
                f"timed among spawned processes); the commit added {added_all} and removed {removed_all} lines in all."]
    except (subprocess.CalledProcessError, OSError):
        pass
    return out


# --- report --------------------------------------------------------------------------------

def _pct(x, signed: bool = False) -> str:
    return "-" if x is None else (f"{100 * x:+.1f} %" if signed else f"{100 * x:.1f} %")


def _usd(x) -> str:
    return "-" if x is None else f"${x:.3g}"


def _profile_cell(p: dict | None, prefix: bool = True) -> str:
    if p is None:
        return "no log line"
    if p["source"] == "cache":
        return f"cached, {p['all_s']:.1f} s"
    parts = [f"{name} {p[name + '_s']:.1f} s" if p[name + "_s"] is not None else f"{name} cached"
             for name in ("model", "store")]
    return ("measured: " if prefix else "") + f"{', '.join(parts)} ({p['all_s']:.1f} s in all)"


def _goal_line(name: str, stats: dict, goal: float, after: dict) -> str:
    if stats["median"] is None:
        return f"- {name} (goal <= {100 * goal:.0f} %): not measured."
    ok = stats["median"] <= goal
    return (f"- {name} (goal <= {100 * goal:.0f} %, median over runs): **{'met' if ok else 'not met'}**, "
            f"{_pct(stats['median'])} over {stats['n']} runs (worst {_pct(stats['max'])}; {stats['within']} of "
            f"{stats['n']} runs within the goal); runs after the first of each configuration (caches filled): "
            f"{_pct(after['median'])}, {after['within']} of {after['n']} within.")


def render(records: list[dict], failures: list[dict], epochs: int, repeats: int, gpu: bool,
           before: list[str]) -> str:
    """The results file's body (its header: `benchmarks.output.write_result`)."""
    epoch_all, cost_all = goal_stats(records, "epoch_error", GOAL_EPOCH), goal_stats(records, "cost_error", GOAL_COST)
    later = [r for r in records if r["run"] >= 1]
    epoch_later, cost_later = goal_stats(later, "epoch_error", GOAL_EPOCH), goal_stats(later, "cost_error", GOAL_COST)
    noise = noise_floor(records)
    runs = []
    if any(r["device"] == "cpu" for r in records):
        runs.append("digits, batch 16 per replica, SGD momentum 0.9, lr 0.05, warm workers; Local-SGD 2x1 (averaged "
                    "once per epoch) and pipeline 1x2 (stages=2, the planner's micro-batches and schedule), and "
                    f"{ADABATCH_MODEL} under adabatch (1 -> 2 -> 4 replicas, doubling every epoch)")
    if gpu:
        runs.append(f"on CUDA, {' and '.join(GPU_MODELS)} on `{GPU_DATASET}`, batch {GPU_BATCH}, SGD momentum 0.9, "
                    "lr 0.05, warm workers, Local-SGD with 1 worker")
    lines = ["What a user sees, per run of `train/local` on the `zooid-local` process pool of a fresh local stack "
             "(empty durable store, so the first run of each model profiles it on a worker and the later ones read "
             f"the cache): {'; '.join(runs)}; {epochs} epochs; each "
             f"configuration runs {1 + repeats} times back to back: run 0 is a first run, on a fresh store of its "
             "own (no profile, no run terms cached), the later runs use the stack's store (the first of them "
             "profiles the model there, later ones read the cache). Epoch wall error = per run, the median over epochs 1.. of |predicted_epoch_s - seconds| / "
             "seconds (the prediction in force for that epoch, recalibrated after every epoch). Bill error = "
             "plan.predicted_run_cost_usd (the first plan, made after the profile) / total_cost_usd (the ledger) - 1. "
             "Method: the module docstring of `benchmarks/bench_prediction.py`.", "",
             "## Summary", ""]
    lines.append(_goal_line("Epoch wall, predicted vs measured", epoch_all, GOAL_EPOCH, epoch_later))
    lines.append(_goal_line("Run cost, predicted vs billed", cost_all, GOAL_COST, cost_later))
    for label, group in (("First runs (run 0: a fresh store, nothing cached; the run measures its own profile "
                          "and start-up, the other terms are assumed)", [r for r in records if r["run"] == 0]),
                         (f"adabatch 1 -> 4 replicas ({ADABATCH_MODEL}, every run; the plan predicts each epoch at "
                          "the count the policy will run)", [r for r in records if r["plan"].startswith("adabatch")])):
        stats = goal_stats(group, "cost_error", GOAL_COST)
        if stats["median"] is not None:
            lines.append(f"- {label}: run cost **{'met' if stats['median'] <= GOAL_COST else 'not met'}**, median "
                         f"{_pct(stats['median'])} over {stats['n']} runs (worst {_pct(stats['max'])}; "
                         f"{stats['within']} within {100 * GOAL_COST:.0f} %).")
    if noise:
        lines.append(f"- Noise floor, the same run repeated (consecutive runs after the first of each configuration): the measured median "
                     f"epoch wall differs by a median {_pct(median(n['wall'] for n in noise))} (max "
                     f"{_pct(max(n['wall'] for n in noise))}) and the bill by {_pct(median(n['bill'] for n in noise))} "
                     f"(max {_pct(max(n['bill'] for n in noise))}) over {len(noise)} configurations.")
    signed = [r["cost_error"] for r in records if r["cost_error"] is not None]
    if signed:
        low = median(signed) < 0
        lines.append(f"- The bill is predicted {'low' if low else 'high'} in {sum((x < 0) == low for x in signed)} of "
                     f"{len(signed)} runs (median {_pct(median(signed), True)}). The first epoch is predicted at a "
                     f"median {fmt(median(r['first_pred_s'] for r in records))} s and measured at "
                     f"{fmt(median(r['first_meas_s'] for r in records))} s; that miss, at the plan's price for its "
                     f"workers and the coordinator, is a median {_usd(median(r['first_miss_usd'] for r in records))} "
                     f"per run against a median bill miss of "
                     f"{_usd(median(r['billed'] - r['predicted_cost'] for r in records if r['predicted_cost'] is not None))}. "
                     "The first epoch's start-up exposed (the epoch waits for its last worker), predicted "
                     "(predicted_first_epoch_s - predicted_epoch_s - warm-up term) vs measured:")
        for label, group in (("runs that measured a profile (a worker was started for it before the plan)",
                              [r for r in records if r["profile"] and r["profile"]["source"] == "measured"]),
                             ("runs that read the profile from the cache (no worker before the plan)",
                              [r for r in records if r["profile"] and r["profile"]["source"] == "cache"])):
            if not group:
                continue
            slowest = [max(r["startups"]) for r in group if r["startups"]]
            lines.append(f"  - {label}: {fmt(median(r['predicted_exposed_s'] for r in group))} s predicted, "
                         f"{fmt(median(r['first_exposed_s'] for r in group))} s measured (medians over {len(group)} "
                         f"runs); the slowest worker's start-up (ledger) a median {fmt(median(slowest))} s against "
                         f"the plan's start-up term {fmt(median(r['terms'].get('startup_s') for r in group))} s.")
    it0 = goal_stats(records, "iteration0_error", GOAL_EPOCH)
    it = goal_stats(records, "iteration_error", GOAL_EPOCH)
    if it0["n"]:
        lines.append(f"- Per iteration, the quantity the benchmark before measured (see the last section): epoch 0's "
                     f"iteration predicted from the profile alone (taken on the target, no shared-host corrections, "
                     f"nothing calibrated yet) vs measured: median |error| {_pct(it0['median'])} over {it0['n']} runs "
                     f"(max {_pct(it0['max'])}); epochs 1.., calibrated by the epochs before: median "
                     f"{_pct(it['median'])} (per run, the median over its epochs; max {_pct(it['max'])}; each epoch's "
                     "prediction is calibrated to the epoch before, so this is mostly how much the iteration moves "
                     "from one epoch to the next). Epoch 0's iteration includes the workers' first steps.")
    profiles = _profile_summary(records)
    for p in profiles:
        lines.append(f"- Profile of `{p['model']}`: measured ({p['fresh']}); from the cache {p['cached']}.")
    if failures:
        lines.append(f"- {len(failures)} run(s) failed: " + "; ".join(f"{f['model']} {f['plan']} run {f['run']}: "
                                                                     f"{f['error']}" for f in failures))
    if profiles:
        lines.append("  (in all = the coordinator's profile step, from asking to answer: for a measured profile it "
                     "includes starting the worker that measures it, as the local pool starts workers only after "
                     "the profile where they share the coordinator's machine)")
    if not gpu:
        lines.append(f"- GPU figures ({', '.join(GPU_MODELS)}, 1 worker) are not in this run (no CUDA device): "
                     f"`{GPU_COMMAND}` on a CUDA machine takes them (`benchmarks/results/{GPU_RESULTS.name}`).")
    lines += ["", "## Every run", "",
              "profile = the coordinator's `zooid profile of ...` log line; planned = the first plan's shape; "
              "epoch err = median over epochs 1..; wall = measured median epoch wall (epochs 1..); first epoch = "
              "predicted_first_epoch_s / measured (start-up exposed: predicted / measured); start-ups = each worker's "
              "billed start-up (ledger), by rank; first miss = (measured - predicted first "
              "epoch) x (workers + coordinator) x price; it0 err = epoch 0's predicted iteration (profile, "
              "uncalibrated) / measured - 1; run s = predicted_run_s (from the plan) / the flow run's start -> end "
              "(from before the profile); worker-s = billed start-up / busy / idle / profile; assumed = run terms "
              "not yet measured on this target at the plan.", "",
              *table(["model", "plan", "run", "profile", "planned", "epoch err", "wall s", "bill predicted", "billed",
                      "bill err", "first epoch s", "start-ups s", "first miss", "it0 err", "run s", "worker-s",
                      "assumed", "re-plans"])]
    for r in records:
        ws = r["worker_seconds"]
        lines.append(
            f"| {r['model']} | {r['plan']} | {r['run']} | {_profile_cell(r['profile'])} | {r['planned']} | "
            f"{_pct(r['epoch_error'])} | {fmt(r['wall_s'], '{:.3f}')} | {_usd(r['predicted_cost'])} | {_usd(r['billed'])} | "
            f"{_pct(r['cost_error'], True)} | {fmt(r['first_pred_s'])} / {fmt(r['first_meas_s'])} "
            f"({fmt(r['predicted_exposed_s'])} / {fmt(r['first_exposed_s'])}) | "
            f"{', '.join(f'{x:.1f}' for x in r['startups']) or '-'} | {_usd(r['first_miss_usd'])} | {_pct(r['iteration0_error'], True)} | "
            f"{fmt(r['predicted_run_s'], '{:.1f}')} / {fmt(r['flow_s'], '{:.1f}')} | "
            f"{' / '.join(fmt(ws.get(k), '{:.1f}') for k in ('startup', 'busy', 'idle', 'profile'))} | "
            f"{', '.join(r['assumed']) or '-'} | {r['switched']} |")
    if noise:
        lines += ["", "## Noise floor", "",
                  *table(["model", "plan", "median epoch wall s (runs 1..)", "difference", "bill (runs 1..)",
                          "difference"])]
        for n in noise:
            lines.append(f"| {n['model']} | {n['plan']} | {', '.join(fmt(w, '{:.3f}') for w in n['walls'])} | "
                         f"{_pct(n['wall'])} | {', '.join(_usd(b) for b in n['bills'])} | {_pct(n['bill'])} |")
    lines += ["", "## Run terms of the first plan", "",
              "Seconds; the plan's `run_terms` (medians of the target's cached samples, or assumed where not yet "
              "measured).", "",
              *table(["model", "plan", "run", "start-up", "provision", "warm-up", "epoch overhead", "gap", "teardown",
                      "stop"])]
    for r in records:
        t = r["terms"]
        lines.append(f"| {r['model']} | {r['plan']} | {r['run']} | " + " | ".join(
            fmt(t.get(k)) for k in ("startup_s", "provision_s", "warmup_s", "epoch_overhead_s", "gap_s",
                                   "teardown_s", "stop_s")) + " |")
    lines += ["", "## Every epoch", "",
              "predicted = `predicted_epoch_s` in force for the epoch; iteration = predicted / measured ms per step; "
              "exposed = start-up the epoch waited for; re-plan = the decision taken after the epoch.", "",
              *table(["model", "plan", "run", "epoch", "measured s", "predicted s", "error", "overhead s",
                      "iteration ms", "exposed s", "re-plan"])]
    for r in records:
        for e in r["epochs"]:
            lines.append(
                f"| {r['model']} | {r['plan']} | {r['run']} | {e['epoch']} | {e['seconds']:.3f} | "
                f"{fmt(e['predicted_epoch_s'], '{:.3f}')} | {_pct(_rel(e['predicted_epoch_s'], e['seconds']), True)} | "
                f"{fmt(e['overhead_s'], '{:.3f}')} | {fmt(_ms(e['predicted_iteration_s']), '{:.2f}')} / "
                f"{fmt(_ms(e['measured_iteration_s']), '{:.2f}')} | {fmt(e['exposed_s'])} | "
                f"{e['replan'].replace('|', '/') or '-'} |")
    lines += ["", "## Before: the benchmark this one replaces", ""] + before
    return "\n".join(lines) + "\n"


def _ms(x):
    return None if x is None else 1000 * x


def _profile_summary(records: list[dict]) -> list[dict]:
    """Per model: the runs that measured something (the model's first run; a pipeline's first
    run probes the store again with its transfers) and the cached ones."""
    out = []
    for model in dict.fromkeys(r["model"] for r in records):
        runs = [r for r in records if r["model"] == model and r["profile"]]
        fresh = [r for r in runs if r["profile"]["source"] == "measured"]
        cached = [r["profile"]["all_s"] for r in runs if r["profile"]["source"] == "cache"]
        out.append({"model": model,
                    "fresh": "; ".join(f"{r['plan']} run {r['run']}: {_profile_cell(r['profile'], False)}" for r in fresh)
                             or "not seen",
                    "cached": (f"{median(cached):.1f} s in all (median of {len(cached)} runs, max {max(cached):.1f} s; "
                               "the log line gives 0.1 s)" if cached else "not seen")})
    return out


def _print_run(r: dict) -> None:
    print(f"{r['model']:40s} {r['plan']:13s} run {r['run']}: epoch err {_pct(r['epoch_error'])}, bill "
          f"{_usd(r['predicted_cost'])} predicted vs {_usd(r['billed'])} billed ({_pct(r['cost_error'], True)}), "
          f"first epoch {fmt(r['first_pred_s'])} / {fmt(r['first_meas_s'])} s, epochs "
          + ", ".join(f"{e['seconds']:.3f}/{fmt(e['predicted_epoch_s'], '{:.3f}')}" for e in r["epochs"]), flush=True)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_prediction", description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(CPU_MODELS),
                        help="CPU models (registry names or package.module:factory); none: GPU only")
    parser.add_argument("--epochs", type=int, default=DEFAULT_EPOCHS)
    parser.add_argument("--repeats", type=int, default=DEFAULT_REPEATS,
                        help="runs of each configuration after its first (the noise floor needs 2)")
    parser.add_argument("--gpu", action="store_true", help="also resnet18 and vgg11, 1 worker, on CUDA")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder (stack, store, logs)")
    args = parser.parse_args(argv)
    if args.epochs < 2:
        parser.error("--epochs must be at least 2 (epoch 0 starts the workers)")
    if args.gpu:
        import torch

        if not torch.cuda.is_available():
            parser.error("--gpu: this machine has no CUDA device")

    prov = provenance()
    records, failures = [], []
    with scratch("pred", keep=args.keep) as base:
        with local_stack(base / "stack") as state:
            for cfg in configurations(args.models, args.gpu, args.epochs):
                for i in range(1 + args.repeats):
                    # run 0: a first run, its own fresh store (no profile, no run terms cached); then the stack's
                    params = {**cfg["params"], "store": f"file://{base}/fresh-{len(records)}"} if i == 0 else cfg["params"]
                    try:
                        summary = pool_summary(params)
                    except (RuntimeError, TimeoutError) as exc:
                        failures.append({"model": cfg["model"], "plan": cfg["plan"], "run": i,
                                         "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
                        print(f"{cfg['model']} {cfg['plan']} run {i} failed: {exc}", flush=True)
                        continue
                    records.append(run_record(cfg, i, summary))
                    try:
                        records[-1]["startups"] = ledger_startups(summary)
                    except (KeyError, ValueError, OSError) as exc:
                        print(f"no ledger for {summary['run_id']}: {type(exc).__name__}: {exc}", flush=True)
                    _print_run(records[-1])
            try:
                lines = profile_lines(state["api_url"], [r["run_id"] for r in records])
            except Exception as exc:  # the figures stand without it; the table says "no log line"
                print(f"could not read the profile log lines: {type(exc).__name__}: {exc}", flush=True)
                lines = {}
            for r in records:
                r["profile"] = lines.get(r["run_id"])
        command = command_for("benchmarks.bench_prediction", flags=(
            ("--models", " ".join(args.models), " ".join(CPU_MODELS)), ("--epochs", args.epochs, DEFAULT_EPOCHS),
            ("--repeats", args.repeats, DEFAULT_REPEATS), ("--gpu", args.gpu, False),
            ("--out", _shown(args.out), _shown(RESULTS)), ("--keep", args.keep, False)))
        write_result(args.out, TITLE, command, prov,
                     render(records, failures, args.epochs, args.repeats, args.gpu, before_section()),
                     detail="the Prefect server, the process worker, the coordinator and the training workers share "
                            "these cores", echo=True)
        (base / "records.json").write_text(json.dumps(records, indent=1))
    return 0 if not failures else 1


def _shown(path: Path) -> Path:
    """`path` as the command names it: from the repository root where it lies inside."""
    path = path.resolve()
    return path.relative_to(REPO) if path.is_relative_to(REPO) else path


if __name__ == "__main__":
    raise SystemExit(main())
