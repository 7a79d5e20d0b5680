"""Pre-start (Hydrozoa Sec. 4.3) measured on the local process pool: worker start-up hidden
behind the previous epoch vs exposed, with and without pre-start, side by side in one run.

The same job, `digits_mlp` on digits, `workers=2`, `epochs=5`, static scaling, Local-SGD
averaged once per epoch, runs as `train/local` on the local stack (a Prefect server, the
`zooid-local` process pool and one Prefect worker, in a temporary `ZOOID_HOME`) with
`prestart=true` and `prestart=false`, alternated, `--repeats` times each. Optionally
(`--inline`) the same two configurations also run on the inline target (`python -m
flows.train ... --summary-out`, workers started by the coordinator), against the same
server.

Per run, from the run's summary (`runs/<id>/summary.json`) and ledger (`runs/<id>/cost.json`):

- start-up hidden / exposed / idle, in worker-seconds, summed over the epochs: a worker's
  start-up (launch to the moment its process began its work) overlapping the previous epoch
  is hidden, the rest exposed; a pre-started worker ready before the previous epoch ended
  waits idle, billed (`planners.prestart.startup_split`);
- critical exposed: per epoch the largest exposed start-up of one worker (what the epoch
  waited), summed;
- mean epoch seconds of epochs >= 2 (epoch 0 has no previous epoch and epoch 1 is the one
  whose length pre-start needs first, so epochs 2.. are the only ones that can be
  pre-started); an epoch's seconds run from its first launch, or the previous epoch's end
  when its workers were pre-started, to its last worker's exit;
- worker-seconds billed (the ledger's worker and failed-attempt rows) and the run's total
  cost (the ledger's total, the coordinator included).

Other people's jobs share this machine, so the two configurations alternate (on, off, on,
off, ...) and the ratios use medians over the repeats.

    .venv/bin/python -m benchmarks.bench_prestart [--repeats 2] [--epochs 5] [--workers 2] [--inline]
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.harness.home import scratch
from benchmarks.harness.stack import local_stack
from benchmarks.harness.tables import median, table
from benchmarks.harness.train import run_train
from benchmarks.output import HOST_SOURCE, command_for, money, provenance, write_result

RESULTS = Path(__file__).resolve().parent / "results" / "prestart.md"
SOURCES = (*HOST_SOURCE, "benchmarks/harness/stack.py", "benchmarks/harness/replicas.py",
           "benchmarks/harness/train.py", "benchmarks/harness/tables.py")
"""The code it measures (the whole project but the worker image's recipe, its workers being processes here: the
train flow on the local stack): its results file is stale once one of these changed since the commit the file
names (`benchmarks.staleness`)."""
MODEL = "digits_mlp"
FIRST_PRESTARTABLE = 2
"""The first epoch pre-start can launch early: it needs one measured epoch's start-up and length."""


@dataclass(frozen=True)
class Config:
    """One side of the comparison: where the workers run and whether they are pre-started."""

    target: str
    prestart: bool

    @property
    def name(self) -> str:
        return f"{self.target} prestart={'on' if self.prestart else 'off'}"


@dataclass
class Outcome:
    """One run: the per-epoch summary rows and the totals this benchmark reports."""

    config: Config
    repeat: int
    run_id: str
    status: str
    run_wall_s: float
    epochs: list[dict]
    worker_s: float
    cost_usd: float
    final_accuracy: float | None
    leads: dict[int, float] = field(default_factory=dict)
    """Per pre-started epoch: seconds between its first launch and the previous epoch's end."""
    totals: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        st = [e.get("startup") or {} for e in self.epochs]
        late = [e["seconds"] for e in self.epochs if e["epoch"] >= FIRST_PRESTARTABLE]
        self.totals = {
            "hidden_s": sum(s.get("hidden_s", 0.0) for s in st),
            "exposed_s": sum(s.get("exposed_s", 0.0) for s in st),
            "idle_s": sum(s.get("idle_s", 0.0) for s in st),
            "critical_exposed_s": sum(s.get("critical_exposed_s", 0.0) for s in st),
            "late_epoch_s": statistics.fmean(late) if late else float("nan"),
            "worker_s": self.worker_s, "cost_usd": self.cost_usd, "run_wall_s": self.run_wall_s,
        }

    @property
    def prestarted_epochs(self) -> list[int]:
        """The epochs whose workers were launched during the previous epoch."""
        return [e["epoch"] for e in self.epochs if e.get("prestarted")]


def job_params(args: argparse.Namespace, config: Config) -> dict:
    """The `TrainJob` fields of one run."""
    return {"model": MODEL, "dataset": "digits", "workers": args.workers, "min_workers": 1,
            "max_workers": max(8, args.workers), "epochs": args.epochs, "scaling": "static",
            "strategy": "local_sgd", "batch_size": args.batch_size, "seed": args.seed,
            "target": config.target, "prestart": config.prestart,
            "warm": False}  # pre-start of cold per-epoch workers (warm workers need none)


def outcome_from(home: Path, config: Config, repeat: int, summary: dict, wall_s: float) -> Outcome:
    """Join a run's summary with its ledger (read from the stack's directory store)."""
    from comm.store_dir import DirectoryStore
    from coordinator.bill.cost import read_ledger

    ledger = read_ledger(DirectoryStore(home / "store"), summary["run_id"])
    workers = [r for r in ledger["rows"] if r["kind"] in ("worker", "failed_attempt")]
    return Outcome(config, repeat, summary["run_id"], summary["status"], wall_s, summary["epochs"],
                   sum(r["seconds"] for r in workers), summary["total_cost_usd"], summary.get("final_accuracy"),
                   launch_leads(summary["epochs"], workers))


def launch_leads(epochs: list[dict], worker_rows: list[dict]) -> dict[int, float]:
    """For each pre-started epoch, how long before the previous epoch's end (its last completed
    worker's stop) its first worker was launched, from the ledger's intervals."""
    leads = {}
    for e in epochs:
        if not e.get("prestarted"):
            continue
        mine = [r["start"] for r in worker_rows if r["epoch"] == e["epoch"]]
        before = [r["stop"] for r in worker_rows if r["epoch"] == e["epoch"] - 1 and r["kind"] == "worker"]
        if mine and before:
            leads[e["epoch"]] = max(before) - min(mine)
    return leads


def run_local(home: Path, args: argparse.Namespace, config: Config, repeat: int) -> Outcome:
    """`train/local` on the stack: the coordinator and its workers are process-pool flow runs."""
    from deployments.stack import run_deployed

    began = time.monotonic()
    summary = run_deployed(job_params(args, config), home=home, timeout_s=args.run_timeout)
    wall = time.monotonic() - began
    if summary.pop("flow_run_state") != "COMPLETED" or summary["status"] == "failed":
        raise SystemExit(f"error: {config.name} #{repeat}: run {summary['run_id']} failed: {summary.get('error')}")
    return outcome_from(home, config, repeat, summary, wall)


def run_inline(home: Path, args: argparse.Namespace, config: Config, repeat: int) -> Outcome:
    """The inline target through the train command, pointed at the stack's server and store (the
    stack's environment is this process's)."""
    try:
        run = run_train(job_params(args, config), home / f"summary-inline-{int(config.prestart)}-{repeat}.json",
                        timeout_s=args.run_timeout)
    except RuntimeError as exc:
        raise SystemExit(f"error: {config.name} #{repeat}: {str(exc)[-500:]}") from None
    return outcome_from(home, config, repeat, run.summary, run.wall_s)


def by_config(outcomes: list[Outcome]) -> dict[str, list[Outcome]]:
    """The repeats of each configuration, in the order the configurations first ran."""
    groups: dict[str, list[Outcome]] = {}
    for o in outcomes:
        groups.setdefault(o.config.name, []).append(o)
    return groups


def repeat_median(runs: list[Outcome], key: str) -> float:
    """The median of one total over a configuration's repeats."""
    return median(o.totals[key] for o in runs)


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b > 0 else ("1.00" if a == b else "-")


COLUMNS = [("hidden_s", "start-up hidden worker-s", "{:.1f}"),
           ("exposed_s", "start-up exposed worker-s", "{:.1f}"),
           ("idle_s", "idle worker-s", "{:.1f}"),
           ("critical_exposed_s", "critical exposed s", "{:.1f}"),
           ("late_epoch_s", f"mean epoch s (epochs >= {FIRST_PRESTARTABLE})", "{:.2f}"),
           ("worker_s", "worker-s billed", "{:.1f}"),
           ("cost_usd", "total cost", None),
           ("run_wall_s", "run wall s", "{:.0f}")]
"""Per-run totals shown in the tables: key, heading, format (None: money)."""


def _cell(key: str, value: float) -> str:
    fmt = next(f for k, _, f in COLUMNS if k == key)
    return money(value) if fmt is None else fmt.format(value)


TITLE = "Pre-start on the local process pool: worker start-up hidden vs exposed"
MACHINE_DETAIL = ("the Prefect server, the process worker, the coordinator and the training workers all run on "
                  "those cores, so start-up (a Python process importing torch and Prefect) is slower than on an "
                  "idle machine")


def render(outcomes: list[Outcome], args: argparse.Namespace) -> str:
    """Markdown below the header: every run, the medians with the ratio on/off per target, then every epoch."""
    groups = by_config(outcomes)
    head = "| " + " | ".join(h for _, h, _ in COLUMNS) + " |"
    lines = [
        f"Job: `{MODEL}` on digits, {args.workers} workers, {args.epochs} epochs, static scaling, Local-SGD "
        f"averaged once per epoch, batch {args.batch_size}, seed {args.seed}, directory store. Target "
        "`local` = the `train/local` deployment on the `zooid-local` process pool (each worker is a "
        "`worker/local` flow run started by the Prefect process worker)"
        + (", `inline` = workers started by the coordinator itself" if args.inline else "")
        + f". Configurations alternate (on, off, on, off, ...), {args.repeats} repeat(s) each. Seconds "
        "of start-up are worker-seconds summed over all epochs; money in thousandths of a dollar (m).",
        "",
        "Every run:", "",
        "| configuration | repeat | pre-started epochs " + head + " final acc |",
        "|---|---|---|" + "---|" * len(COLUMNS) + "---|",
    ]
    for o in outcomes:
        lines.append(f"| {o.config.name} | {o.repeat} | {' '.join(map(str, o.prestarted_epochs)) or '-'} | "
                     + " | ".join(_cell(k, o.totals[k]) for k, _, _ in COLUMNS)
                     + (f" | {o.final_accuracy:.3f} |" if o.final_accuracy is not None else " | - |"))
    lines += ["", "Medians over the repeats, and the ratio prestart on / off:", "",
              "| configuration " + head, "|---|" + "---|" * len(COLUMNS)]
    for name, runs in groups.items():
        lines.append(f"| {name} | " + " | ".join(_cell(k, repeat_median(runs, k)) for k, _, _ in COLUMNS) + " |")
    for target in dict.fromkeys(o.config.target for o in outcomes):
        on, off = groups.get(f"{target} prestart=on"), groups.get(f"{target} prestart=off")
        if on and off:
            lines.append(f"| **{target}: on / off** | "
                         + " | ".join(_ratio(repeat_median(on, k), repeat_median(off, k)) for k, _, _ in COLUMNS) + " |")
    lines += ["", *findings(groups), "", "Every epoch (start-up in worker-seconds; s = the epoch's seconds):", "",
              *table(["configuration", "repeat", "epoch", "pre-started (launched s before previous end)", "hidden",
                      "exposed", "idle", "critical exposed", "s", "val acc", "$"])]
    for o in outcomes:
        for e in o.epochs:
            st = e.get("startup") or {}
            pre = f"yes ({o.leads[e['epoch']]:.1f})" if e["epoch"] in o.leads else ("yes" if e.get("prestarted") else "no")
            lines.append(f"| {o.config.name} | {o.repeat} | {e['epoch']} | {pre} | "
                         f"{st.get('hidden_s', 0):.2f} | {st.get('exposed_s', 0):.2f} | {st.get('idle_s', 0):.2f} | "
                         f"{st.get('critical_exposed_s', 0):.2f} | {e['seconds']:.2f} | "
                         f"{e['val_accuracy']:.3f} | {money(e['cost_usd'])} |")
    lines += ["", "Runs: " + ", ".join(f"{o.config.name} #{o.repeat} `{o.run_id}` ({o.status})" for o in outcomes)]
    return "\n".join(lines) + "\n"


def findings(groups: dict[str, list[Outcome]]) -> list[str]:
    """What the medians say, per target: exposed start-up and epoch time saved, idle paid for."""
    out = []
    for target in dict.fromkeys(runs[0].config.target for runs in groups.values()):
        on, off = groups.get(f"{target} prestart=on"), groups.get(f"{target} prestart=off")
        if not (on and off):
            continue
        leads = [(lead, prev["seconds"]) for o in on for ep, lead in o.leads.items()
                 for prev in o.epochs if prev["epoch"] == ep - 1]
        lead = (f"; pre-started workers were launched a median {median(a for a, _ in leads):.1f} s "
                f"before the previous epoch ended (those epochs took a median "
                f"{median(b for _, b in leads):.1f} s)") if leads else ""
        out.append(f"- {target}, medians prestart off -> on: start-up hidden {repeat_median(off, 'hidden_s'):.1f} -> "
                   f"{repeat_median(on, 'hidden_s'):.1f} worker-s, exposed {repeat_median(off, 'exposed_s'):.1f} -> "
                   f"{repeat_median(on, 'exposed_s'):.1f} worker-s, critical exposed {repeat_median(off, 'critical_exposed_s'):.1f}"
                   f" -> {repeat_median(on, 'critical_exposed_s'):.1f} s, idle (billed) {repeat_median(off, 'idle_s'):.1f} -> "
                   f"{repeat_median(on, 'idle_s'):.1f} worker-s; mean epoch (epochs >= {FIRST_PRESTARTABLE}) "
                   f"{repeat_median(off, 'late_epoch_s'):.2f} -> {repeat_median(on, 'late_epoch_s'):.2f} s; worker-s billed "
                   f"{repeat_median(off, 'worker_s'):.1f} -> {repeat_median(on, 'worker_s'):.1f}; total cost "
                   f"{money(repeat_median(off, 'cost_usd'))} -> {money(repeat_median(on, 'cost_usd'))}{lead}.")
    return out


def command_line(args: argparse.Namespace) -> str:
    """The command that reproduces this run (non-default flags only)."""
    return command_for("benchmarks.bench_prestart", flags=[
        ("--repeats", args.repeats, 2), ("--epochs", args.epochs, 5), ("--workers", args.workers, 2),
        ("--batch-size", args.batch_size, 16), ("--seed", args.seed, 0), ("--run-timeout", args.run_timeout, 600.0),
        ("--out", args.out.resolve(), RESULTS), ("--inline", args.inline, False)])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Flags, validated: bad values stop with a one-line message naming the flag."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_prestart", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2, help="runs of each configuration, alternated")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--inline", action="store_true", help="also run both configurations on the inline target")
    parser.add_argument("--run-timeout", type=float, default=600.0, help="seconds one run may take")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--keep", action="store_true", help="keep the temporary ZOOID_HOME")
    args = parser.parse_args(argv)
    for name in ("repeats", "workers", "batch_size", "run_timeout"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')}: must be positive")
    if args.epochs <= FIRST_PRESTARTABLE:
        parser.error(f"--epochs: must be > {FIRST_PRESTARTABLE}, or no epoch can be pre-started")
    if args.seed < 0:
        parser.error("--seed: must be >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    """Bring the stack up, run the configurations alternated, bring it down, write the markdown."""
    args = parse_args(argv)
    prov = provenance()
    outcomes: list[Outcome] = []
    with scratch("prestart", keep=args.keep) as home, local_stack(home):
        targets = ["local"] + (["inline"] if args.inline else [])
        for repeat in range(args.repeats):
            for target in targets:
                for prestart in (True, False):
                    config = Config(target, prestart)
                    print(f"--- {config.name} #{repeat}", flush=True)
                    if target == "local":
                        outcome = run_local(home, args, config, repeat)
                    else:
                        outcome = run_inline(home, args, config, repeat)
                    outcomes.append(outcome)
                    print(f"{config.name} #{repeat}: " + ", ".join(f"{k} {_cell(k, v)}" for k, v in outcome.totals.items()),
                          flush=True)
    write_result(args.out, TITLE, command_line(args), prov, render(outcomes, args), detail=MACHINE_DETAIL, echo=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
