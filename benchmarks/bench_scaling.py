"""Hydrozoa's dynamic-scaling experiment (Sec. 5.4) in miniature: DP-1, DP-8 and adabatch
DP-(1->8) on `digits_cnn`, synchronised every step, side by side in one run.

With `sync_period=1` every replica averages weights and momentum after every step, so D
replicas of batch b train like one process with batch D*b: more workers means a larger
global batch and fewer steps per epoch. The three configurations are real `train` flows on
the inline target (workers are local processes, the store is the directory store), driven
through `flows.train.main`, the `python -m flows.train` entry point, in this process so they
share one temporary Prefect server:

- DP-1: `workers=1 scaling=static`, `--epochs` epochs;
- DP-(1->8): `workers=1 scaling=adabatch scale_every_epochs=1 max_workers=8`, `--epochs`
  epochs: 1, 2, 4, 8, 8, ... workers, the learning rate x0.75 per doubling
  (`planners.scaling`);
- DP-8: `workers=8 scaling=static`, stopped by the flow at the target accuracy
  (`target_accuracy`), at most `--dp8-max-epochs` epochs: the large batch needs more epochs,
  and it is the costliest configuration per epoch, so it is not run past the target.

Per configuration, up to the first epoch whose validation accuracy (rank 0, end of epoch)
reaches `--target`:

- epochs and samples (each worker's trained samples, summed);
- cluster time: per epoch the slowest worker's `compute_s + sync_s`, what one core per worker
  would see, summed; read from the history record of each attempt that completed the epoch
  (`runs/<id>/history/e<epoch>/`, which warm and cold workers alike write);
- epoch wall time (the flow's per-epoch `seconds`: first launch to last exit, process
  start-up included), with 8 workers sharing this machine's cores;
- cost: worker-seconds billed in the ledger (`runs/<id>/cost.json`, failed attempts
  included, the coordinator's own row excluded) times the offer's price, and, beside it,
  what the same epochs would bill at one core per worker (workers x cluster time x price).

Final accuracy is the last epoch's, and "after N epochs" is the accuracy at the same epoch
for all three (N = `--epochs`).

Other people's jobs share this machine, and a burst of their load lands on whichever epoch
runs at the time: one DP-1 epoch measured 0.3 s of cluster time quiet and 9.8 s in a burst.
So the three configurations run `--repeats` times, interleaved (DP-1, DP-(1->8), DP-8, DP-1,
...), with the same seed, and the table shows medians over the repeats; the training is
deterministic for a seed, so only the timings (and the bill) differ between repeats.

    .venv/bin/python -m benchmarks.bench_scaling [--target 0.93] [--epochs 4] [--dp8-max-epochs 10] [--repeats 2]
"""
from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.harness.home import scratch
from benchmarks.harness.tables import median, table
from benchmarks.harness.train import param_args
from benchmarks.output import HOST_SOURCE, command_for, money, provenance, write_result

RESULTS = Path(__file__).resolve().parent / "results" / "scaling.md"
SOURCES = (*HOST_SOURCE, "benchmarks/harness/train.py", "benchmarks/harness/tables.py")
"""The code it measures (the whole project but the worker image's recipe, its workers being processes here: the
train flow): its results file is stale once one of these changed since the commit the file names
(`benchmarks.staleness`)."""
MODEL = "digits_cnn"


@dataclass(frozen=True)
class Config:
    """One side of the comparison: a name and the `--param`s of its `train` flow."""

    name: str
    params: dict


@dataclass
class EpochRow:
    """One epoch of one configuration, joined from the summary, the logs and the ledger."""

    epoch: int
    workers: int
    lr: float
    val_accuracy: float
    samples: int
    wall_s: float
    cluster_s: float
    slowest_compute_s: float
    slowest_sync_s: float
    worker_s: float
    cost_usd: float
    failed_attempts: int


@dataclass
class Outcome:
    """A configuration's run: its per-epoch rows and what it billed."""

    config: Config
    repeat: int
    run_id: str
    status: str
    price_per_s: float
    offer: str
    run_wall_s: float
    rows: list[EpochRow] = field(default_factory=list)

    def reached(self, target: float) -> int | None:
        """Number of epochs until validation accuracy first reached `target`, or None."""
        return next((i + 1 for i, r in enumerate(self.rows) if r.val_accuracy >= target), None)

    def upto(self, target: float) -> list[EpochRow]:
        """The epochs up to the target (all of them when it was missed)."""
        return self.rows[: self.reached(target) or len(self.rows)]

    def to_target(self, target: float) -> dict[str, float]:
        """Sums over the epochs up to the target: samples, cluster and wall seconds, billed
        worker-seconds, ledger cost, and the cost at one core per worker."""
        rows = self.upto(target)
        return {"samples": sum(r.samples for r in rows), "cluster_s": sum(r.cluster_s for r in rows),
                "wall_s": sum(r.wall_s for r in rows), "worker_s": sum(r.worker_s for r in rows),
                "cost_usd": sum(r.cost_usd for r in rows),
                "cluster_cost_usd": sum(r.workers * r.cluster_s for r in rows) * self.price_per_s}


def configurations(args: argparse.Namespace) -> list[Config]:
    """DP-1, DP-(1->8) adabatch and DP-8 with the common settings of this run."""
    common = {"model": MODEL, "dataset": "digits", "strategy": "local_sgd", "sync_period": 1,
              "batch_size": args.batch_size, "lr": args.lr, "optimizer": "momentum",
              "seed": args.seed, "min_workers": 1, "max_workers": 8, "target": "inline"}
    return [
        Config("DP-1", {**common, "workers": 1, "scaling": "static", "epochs": args.epochs}),
        Config("DP-(1->8) adabatch", {**common, "workers": 1, "scaling": "adabatch",
                                      "scale_every_epochs": 1, "epochs": args.epochs}),
        Config("DP-8", {**common, "workers": 8, "scaling": "static", "epochs": args.dp8_max_epochs,
                        "target_accuracy": args.target}),
    ]


def worker_results(store, run_id: str, epoch: int) -> list[dict]:
    """What each rank's attempt that completed `epoch` trained: its history record (samples,
    compute and sync seconds), the latest attempt per rank."""
    from engine.local_sgd_epoch import read_epoch_history

    latest: dict[int, dict] = {}
    for record in read_epoch_history(store, run_id, epoch):
        if record["attempt"] >= latest.get(record["rank"], {}).get("attempt", -1):
            latest[record["rank"]] = record
    return [latest[rank] for rank in sorted(latest)]


def collect(home: Path, config: Config, repeat: int, summary: dict, run_wall_s: float) -> Outcome:
    """Join the run's summary, its workers' history records and ledger into per-epoch rows."""
    from comm.store_dir import DirectoryStore
    from coordinator.bill.cost import read_ledger

    store = DirectoryStore(home / "store")
    run_id = summary["run_id"]
    ledger = read_ledger(store, run_id)
    workers_rows = [r for r in ledger["rows"] if r["kind"] in ("worker", "failed_attempt")]
    price = ledger["rows"][0]["unit_price_per_s"]
    outcome = Outcome(config, repeat, run_id, summary["status"], price, ledger["rows"][0]["offer"], run_wall_s)
    for e in summary["epochs"]:
        results = worker_results(store, run_id, e["epoch"])
        slowest = max(results, key=lambda r: r["compute_s"] + r["sync_s"])
        billed = [r for r in workers_rows if r["epoch"] == e["epoch"]]
        outcome.rows.append(EpochRow(
            epoch=e["epoch"], workers=e["workers"], lr=e["lr"], val_accuracy=e["val_accuracy"],
            samples=sum(r["samples"] for r in results), wall_s=e["seconds"],
            cluster_s=slowest["compute_s"] + slowest["sync_s"], slowest_compute_s=slowest["compute_s"],
            slowest_sync_s=slowest["sync_s"], worker_s=sum(r["seconds"] for r in billed),
            cost_usd=sum(r["usd"] for r in billed),
            failed_attempts=sum(r["kind"] == "failed_attempt" for r in billed)))
    return outcome


def run_config(home: Path, config: Config, repeat: int) -> Outcome:
    """Run one configuration's `train` flow through the CLI entry point and collect it."""
    from flows.train import main as train_main

    out = home / f"summary-{config.name.split()[0].replace('(', '').replace(')', '')}-{repeat}.json"
    began = time.monotonic()
    code = train_main(param_args(config.params) + ["--summary-out", str(out)])
    wall = time.monotonic() - began
    if code != 0 or not out.exists():
        raise SystemExit(f"error: {config.name}: the train flow failed (exit {code})")
    return collect(home, config, repeat, json.loads(out.read_text()), wall)


def _same(values: list) -> str:
    """One value when every repeat agrees, else each repeat's."""
    texts = [str(v) for v in values]
    return texts[0] if len(set(texts)) == 1 else ", ".join(texts)


def _median_to_target(outcomes: list[Outcome], target: float, key: str) -> float:
    return median(o.to_target(target)[key] for o in outcomes)


NOTES = [
    "Notes:",
    "- The static policy keeps the learning rate, so DP-1 and DP-8 train at a constant lr (Hydrozoa's "
    "DP-1 decayed it every 5 epochs); part of adabatch's lead in the first epochs is its lower lr, not only "
    "its larger batch.",
    "- On this machine, per epoch, syncing every step through the directory store costs more than the compute it splits on "
    "this small model (compare compute + sync below); where adabatch needs less cluster time than DP-1 it "
    "is by reaching the target in fewer epochs.",
    "- Worker start-up (a Python process importing torch, per worker and epoch) dominates the epoch wall time "
    "and the ledger at 8 workers; the cost-at-cluster-time column leaves it out.",
]
"""A few facts that hold for any run of this benchmark, printed under the goal check."""


def by_config(outcomes: list[Outcome]) -> dict[str, list[Outcome]]:
    """The repeats of each configuration, in the order the configurations ran."""
    groups: dict[str, list[Outcome]] = {}
    for o in outcomes:
        groups.setdefault(o.config.name, []).append(o)
    return groups


MACHINE_DETAIL = ("up to 8 workers share those cores, so wall time and even cluster time (a worker waiting for "
                  "CPU computes and syncs slower) are inflated against one core per worker")


def title(target: float) -> str:
    return f"Dynamic worker scaling in miniature: DP-1, DP-8 and adabatch DP-(1->8) to {100 * target:.0f} %"


def render(outcomes: list[Outcome], args: argparse.Namespace) -> str:
    """Markdown below the header: the comparison to the target (medians over repeats), the goal
    check, each repeat's timings, then every epoch."""
    target, n = args.target, args.epochs
    price = outcomes[0].price_per_s
    groups = by_config(outcomes)
    lines = [
        f"Setup: `{MODEL}` on digits (1437 training rows), Local-SGD synchronised every step "
        f"(`sync_period=1`: D workers = one step on a global batch of D x {args.batch_size}), "
        f"batch {args.batch_size} per worker, SGD with momentum 0.9, lr {args.lr} (adabatch: x0.75 per "
        f"doubling; DP-1 and DP-8 keep it), seed {args.seed}, inline target (workers are local processes), "
        f"directory store. Target: {100 * target:.0f} % validation accuracy, checked at epoch ends. DP-1 and "
        f"DP-(1->8) run {n} epochs; DP-8 stops at the target (at most {args.dp8_max_epochs} epochs). "
        f"{args.repeats} repeat(s), interleaved; seconds and money are medians over them. Billing offer "
        f"`{outcomes[0].offer}`: ${price:.4g} per worker-second. Money in thousandths of a dollar (m).",
        "",
        "| configuration | workers per epoch | epochs to target | samples to target | cluster s to target "
        "| epoch wall s to target | worker-s billed | cost to target | cost at cluster time "
        f"| acc after {n} epochs | final acc (epochs run) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, runs in groups.items():
        lines.append("| " + " | ".join([
            name, _same([" ".join(str(r.workers) for r in o.rows) for o in runs]),
            _same([o.reached(target) or f"not reached ({max(r.val_accuracy for r in o.rows):.3f} best)"
                   for o in runs]),
            _same([o.to_target(target)["samples"] for o in runs]),
            f"{_median_to_target(runs, target, 'cluster_s'):.1f}", f"{_median_to_target(runs, target, 'wall_s'):.1f}",
            f"{_median_to_target(runs, target, 'worker_s'):.1f}", money(_median_to_target(runs, target, "cost_usd")),
            money(_median_to_target(runs, target, "cluster_cost_usd")),
            _same([f"{o.rows[n - 1].val_accuracy:.3f}" if len(o.rows) >= n else "-" for o in runs]),
            _same([f"{o.rows[-1].val_accuracy:.3f} ({len(o.rows)})" for o in runs]),
        ]) + " |")
    lines += ["", "Cluster s: per epoch the slowest worker's compute + sync, summed. Epoch wall s: the flow's "
              "epoch seconds (first launch to last exit), summed. Worker-s billed and cost: the ledger's worker "
              "rows (failed attempts included, coordinator excluded). Cost at cluster time: workers x cluster s "
              "x price, the bill at one core per worker with no process start-up.",
              "", *goal_lines(groups, target), "", *NOTES, "",
              "Each repeat, to the target: cluster s / epoch wall s / ledger cost.", "",
              "| configuration | " + " | ".join(f"repeat {i}" for i in range(args.repeats)) + " |",
              "|---|" + "---|" * args.repeats]
    for name, runs in groups.items():
        cells = [f"{t['cluster_s']:.1f} / {t['wall_s']:.1f} / {money(t['cost_usd'])}"
                 for t in (o.to_target(target) for o in runs)]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Every epoch. Cluster s = the slowest worker's compute + sync (its split beside); wall s = "
              "first launch to last exit (worker start-up included); worker-s and cost from the ledger.", "",
              *table(["configuration", "repeat", "epoch", "workers", "lr", "val acc", "samples", "cluster s",
                      "compute + sync s", "wall s", "worker-s", "cost", "failed attempts"])]
    for name, runs in groups.items():
        for o in runs:
            for r in o.rows:
                lines.append(f"| {name} | {o.repeat} | {r.epoch} | {r.workers} | {r.lr:.4g} | {r.val_accuracy:.3f} "
                             f"| {r.samples} | {r.cluster_s:.2f} | {r.slowest_compute_s:.2f} + "
                             f"{r.slowest_sync_s:.2f} | {r.wall_s:.1f} | {r.worker_s:.1f} | {money(r.cost_usd)} "
                             f"| {r.failed_attempts} |")
    lines += ["", "Runs: " + ", ".join(f"{o.config.name} #{o.repeat} `{o.run_id}` ({o.status}, {o.run_wall_s:.0f} s "
                                       "with profile and plan)" for o in outcomes)]
    return "\n".join(lines) + "\n"


def goal_lines(groups: dict[str, list[Outcome]], target: float) -> list[str]:
    """The issue's goal, checked on the medians and in each repeat: adabatch needs less
    cluster time than DP-1 and costs less than DP-8 to the same accuracy."""
    by = {name.split()[0]: runs for name, runs in groups.items()}
    ada, out = by["DP-(1->8)"], []
    for other, key, label, fmt in ((by["DP-1"], "cluster_s", "cluster time", "{:.1f} s"),
                                   (by["DP-8"], "cost_usd", "cost (ledger)", "${:.6f}")):
        name = other[0].config.name
        if not all(o.reached(target) for o in ada + other):
            out.append(f"- {label} vs {name}: not comparable, a run missed the target.")
            continue
        a, b = _median_to_target(ada, target, key), _median_to_target(other, target, key)
        wins = sum(x.to_target(target)[key] < y.to_target(target)[key] for x, y in zip(ada, other))
        out.append(f"- Goal, less {label} than {name} to {100 * target:.0f} %: "
                   f"{'met' if a < b else 'NOT met'} on the medians: adabatch {fmt.format(a)} vs "
                   f"{fmt.format(b)} ({100 * (1 - a / b):.0f} % less); in {wins} of {len(ada)} repeat(s).")
    return out


def command_line(args: argparse.Namespace) -> str:
    """The command that reproduces this run (non-default flags only)."""
    return command_for("benchmarks.bench_scaling", flags=[
        ("--target", args.target, 0.93), ("--epochs", args.epochs, 4), ("--dp8-max-epochs", args.dp8_max_epochs, 10),
        ("--batch-size", args.batch_size, 16), ("--lr", args.lr, 0.05), ("--seed", args.seed, 0),
        ("--repeats", args.repeats, 2), ("--out", args.out.resolve(), RESULTS)])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Flags, validated: bad values stop with a one-line message naming the flag."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_scaling",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=float, default=0.93, help="validation accuracy to reach")
    parser.add_argument("--epochs", type=int, default=4, help="epochs of DP-1 and DP-(1->8)")
    parser.add_argument("--dp8-max-epochs", type=int, default=10, help="cap on DP-8's epochs")
    parser.add_argument("--batch-size", type=int, default=16, help="samples per step per worker")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each configuration, interleaved")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--keep", action="store_true", help="keep the temporary ZOOID_HOME")
    args = parser.parse_args(argv)
    if not 0 < args.target <= 1:
        parser.error("--target: must be in (0, 1]")
    for name in ("epochs", "dp8_max_epochs", "batch_size", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: must be a positive integer")
    if not args.lr > 0:
        parser.error("--lr: must be > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the three configurations `--repeats` times, interleaved, and write the markdown."""
    args = parse_args(argv)
    prov = provenance()
    outcomes = []
    # The scratch folder is Zooid's and Prefect's home before Prefect and the engine are imported:
    # they read these once.
    with scratch("scaling", keep=args.keep, home=True) as home:
        os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
        for repeat in range(args.repeats):
            for config in configurations(args):
                print(f"--- {config.name} #{repeat}: python -m flows.train {' '.join(param_args(config.params))}",
                      flush=True)
                outcome = run_config(home, config, repeat)
                outcomes.append(outcome)
                for r in outcome.rows:
                    print(f"{config.name} #{repeat} epoch {r.epoch} workers {r.workers} acc {r.val_accuracy:.3f} "
                          f"cluster {r.cluster_s:.2f} s wall {r.wall_s:.1f} s cost ${r.cost_usd:.6f}", flush=True)
    write_result(args.out, title(args.target), command_line(args), prov, render(outcomes, args),
                 detail=MACHINE_DETAIL, echo=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
