"""Zooid beside the peer its users would pick instead, Ray Train (TorchTrainer, DDP over gloo),
on the same job, side by side in one run.

The job, the same for every row: `digits_cnn` on digits (the project's model and split), 2 CPU
workers, batch 16 each, SGD momentum 0.9, lr 0.05, 4 epochs, parameters (DDP: gradients)
averaged every step. Rows, run `--rounds` times, interleaved (Ray, Zooid ring first run, Zooid
ring cached, Zooid store first run, Zooid store cached, plain PyTorch, then again):

- **Ray Train**: a driver script in a virtualenv of its own that this benchmark creates under
  its scratch folder (`ray[train]` `RAY_VERSION` and the project's torch, from the wheels on disk
  where they are); Ray never becomes a project dependency. `RAY_USAGE_STATS_ENABLED=0`, the node
  bound to 127.0.0.1, no dashboard, its home and temp directory under the scratch folder, the
  controller's poll at `RAY_POLL_S` s (its default is 2 s; at that poll an epoch waits on
  `report()`). Model and data come from the project's `engine` modules (on `PYTHONPATH`).
- **Zooid**: `python -m flows.train` (the command line, its own temporary Prefect server, target
  `inline`), `sync_period=1`, `collective=ring` or the directory store; "first run" on a fresh
  Zooid home and store (the profile is measured), "cached" on the home the first run left (the
  profile and the run terms are read back).
- **plain PyTorch**: one process, the same model, data, batch 16 and optimizer: the floor.

- **Zooid on the running stack** (after the rounds above): one local stack (`deployments.stack.up`,
  the scratch folder its home), and per round `train/local` submitted twice through Prefect
  (`deployments.stack.run_deployed`, `collective=ring`): on a fresh store (the profile is measured)
  and on the store that run left (cached). Its "whole command" is submit to the flow run's end,
  its "to first step" submit to the first step (the process worker's poll, the flow run's process,
  the profile when measured, the workers' start).

Per row, medians over the rounds: the whole command (process start to exit); time to first step
(process start to the first training step: Ray's workers report it, Zooid's is the later of the
two workers' first busy interval of epoch 0 in the run's ledger); epochs 1-3 (mean seconds of
epochs 1, 2 and 3); final validation accuracy.

Goals (#26): Zooid's whole command at or below Ray's on a first run and at most 0.8x Ray's with
a cached profile; every-step epochs at most 1.1x Ray's over `ring` and 1.5x over the store;
submit to first step on a running stack 5 s or less.

    .venv/bin/python -m benchmarks.bench_peers [--rounds 3] [--out PATH] [--keep] [--no-stack]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.harness.home import REPO, scratch
from benchmarks.harness.stack import local_stack
from benchmarks.harness.tables import median
from benchmarks.harness.train import run_train
from benchmarks.output import HOST_SOURCE, command_for, provenance, write_result
from core.keys import ledger_key

RESULTS = Path(__file__).resolve().parent / "results" / "peers.md"
SOURCES = (*HOST_SOURCE, "benchmarks/harness/stack.py", "benchmarks/harness/replicas.py",
           "benchmarks/harness/train.py", "benchmarks/harness/tables.py")
"""The code it measures (the whole project but the worker image's recipe, its workers being processes here: the
train flow on the local stack): its results file is stale once one of these changed since the commit the file
names (`benchmarks.staleness`)."""
TITLE = "Ahead of Ray Train? The same job, side by side"
WHEELS = REPO / "worker_images" / "wheels"
RAY_VERSION = "2.60.0"
RAY_POLL_S = 0.1
JOB = {"model": "digits_cnn", "dataset": "digits", "workers": 2, "batch_size": 16, "optimizer": "momentum",
       "lr": 0.05, "epochs": 4, "seed": 0}
GOALS = {"first": 1.0, "cached": 0.8, "ring": 1.1, "store": 1.5, "submit_s": 5.0}

TRAIN = r'''
import json, os, sys, time
import torch
from engine.datasets import load_dataset
from engine.models import build_model

JOB = json.loads(sys.argv[1])


def train_epochs(model, data, rank, world, batch, report=lambda epoch, acc: None):
    # JOB's epochs of `model` on this rank's share of each epoch's shuffled rows, `batch` rows a
    # step: each epoch's seconds and validation accuracy, and when the first step ended
    opt = torch.optim.SGD(model.parameters(), lr=JOB["lr"], momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    epochs, first_step = [], None
    for epoch in range(JOB["epochs"]):
        began = time.time()
        order = torch.randperm(len(data.train_x), generator=torch.Generator().manual_seed(epoch))[rank::world]
        model.train()
        for i in range(0, len(order) - batch + 1, batch):
            idx = order[i:i + batch]
            opt.zero_grad()
            loss_fn(model(data.train_x[idx]), data.train_y[idx]).backward()
            opt.step()
            if first_step is None:
                first_step = time.time()
        model.eval()
        with torch.no_grad():
            acc = (model(data.val_x).argmax(1) == data.val_y).float().mean().item()
        epochs.append({"seconds": time.time() - began, "val_accuracy": acc})
        report(epoch, acc)
    return epochs, first_step
'''
"""The training both scripts run, from the project's model and data: the driver's and the plain
process's epochs differ only in the rows each process takes and in what it reports."""

RAY_DRIVER = TRAIN + r'''
import ray
from ray import train
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer


def loop(config):
    torch.set_num_threads(1)
    ctx = train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.manual_seed(JOB["seed"])
    data = load_dataset(JOB["dataset"])
    model = train.torch.prepare_model(build_model(JOB["model"], JOB["seed"]))
    epochs, first_step = train_epochs(model, data, rank, world, JOB["batch_size"],
                                      lambda epoch, acc: train.report({"epoch": epoch, "val_accuracy": acc}))
    with open(os.path.join(config["out"], f"rank-{rank}.json"), "w") as fh:  # report() keeps no history here
        json.dump({"epochs": epochs, "first_step": first_step}, fh)


ray.init(address="local", num_cpus=JOB["workers"] + 1, include_dashboard=False, _node_ip_address="127.0.0.1",
         _temp_dir=os.environ["RAY_TMPDIR"], log_to_driver=False)
out = os.environ["RAY_STORAGE"]
os.makedirs(out, exist_ok=True)
trainer = TorchTrainer(loop, train_loop_config={"out": out},
                       scaling_config=ScalingConfig(num_workers=JOB["workers"], use_gpu=False),
                       run_config=RunConfig(storage_path=out, name="peers"))
trainer.fit()
ranks = [json.load(open(os.path.join(out, f"rank-{r}.json"))) for r in range(JOB["workers"])]
print("RESULT " + json.dumps({"epochs": ranks[0]["epochs"], "first_step": max(r["first_step"] for r in ranks)}))
ray.shutdown()
'''

PLAIN = TRAIN + r'''
torch.manual_seed(JOB["seed"])
epochs, first_step = train_epochs(build_model(JOB["model"], JOB["seed"]), load_dataset(JOB["dataset"]), 0, 1,
                                  JOB["batch_size"] * JOB["workers"])
print("RESULT " + json.dumps({"epochs": epochs, "first_step": first_step}))
'''


def ray_python(root: Path) -> Path:
    """The Ray virtualenv's python, created on first use: ray[train] and the project's torch."""
    import torch

    venv = root / "ray-venv"
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        wheels = ["--find-links", str(WHEELS)] if WHEELS.is_dir() else []
        subprocess.run([str(python), "-m", "pip", "install", "-q", *wheels, f"torch=={torch.__version__}",
                        f"ray[train]=={RAY_VERSION}", "scikit-learn", "safetensors"], check=True)
    return python


def _result(stdout: str) -> dict:
    line = next(l for l in reversed(stdout.splitlines()) if l.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def run_script(python: Path, code: str, env: dict, folder: Path) -> dict:
    """A driver script (Ray's or plain PyTorch's), run in `folder`: its wall, first step and epochs."""
    script = folder / "driver.py"
    script.write_text(code)
    began = time.time()
    proc = subprocess.run([str(python), str(script), json.dumps(JOB)], env=env, capture_output=True,
                          text=True, timeout=900, cwd=folder)
    wall = time.time() - began
    if proc.returncode:
        raise RuntimeError(f"{script} failed: {proc.stderr[-2000:]}")
    out = _result(proc.stdout)
    return {"wall_s": wall, "to_first_step_s": out["first_step"] - began, "epochs": out["epochs"]}


def run_zooid(home: Path, collective: str) -> dict:
    """One `python -m flows.train` command on `home` (fresh or as an earlier run left it)."""
    params = {**JOB, "target": "inline", "sync_period": 1, "collective": collective, "store": f"file://{home}/store"}
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update(ZOOID_HOME=str(home / "zooid"), PREFECT_HOME=str(home / "prefect"))
    run = run_train(params, home / "summary.json", env=env)
    summary = run.summary
    ledger = json.loads((home / "store" / ledger_key(summary["run_id"])).read_text())
    first = first_step_at(ledger)
    return {"wall_s": run.wall_s, "to_first_step_s": first - run.began if first else None,
            "epochs": _epochs(summary["epochs"]), "profile": summary["plan"].get("profile_sources")}


def _epochs(summary_epochs: list[dict]) -> list[dict]:
    """A Zooid run's epochs as the table reads them: seconds and validation accuracy."""
    return [{"seconds": e["seconds"], "val_accuracy": e["val_accuracy"]} for e in summary_epochs]


def first_step_at(ledger: dict | None) -> float | None:
    """When every worker had begun epoch 0: the latest of the ranks' first busy interval."""
    firsts = {}
    for r in (ledger or {}).get("rows", []):
        if r["kind"] == "worker" and r.get("status") == "busy" and r.get("epoch") == 0:
            firsts[r["rank"]] = min(firsts.get(r["rank"], r["start"]), r["start"])
    return max(firsts.values()) if firsts else None


STACK_RUN = r'''
import json, sys
from pathlib import Path
from deployments.stack import run_deployed
s = run_deployed(json.loads(sys.argv[1]), Path(sys.argv[2]), timeout_s=900)
print("RESULT " + json.dumps({k: s[k] for k in ("submitted_at", "flow_end_at", "ledger", "epochs")}))
'''
"""One deployment run on the stack at `argv[2]`: submitted (`train/local`), waited for, read back."""


def run_on_stack(stack_home: Path, store: Path) -> dict:
    """`train/local` submitted to the running stack with the job on `store` (fresh, or as an
    earlier run left it): submit to the flow run's end, submit to the first step."""
    params = {**JOB, "sync_period": 1, "collective": "ring", "store": f"file://{store}"}
    proc = subprocess.run([sys.executable, "-c", STACK_RUN, json.dumps(params), str(stack_home)],
                          capture_output=True, text=True, timeout=900, cwd=REPO)
    if proc.returncode:
        raise RuntimeError(f"stack run failed: {proc.stderr[-2000:]}")
    out = _result(proc.stdout)
    first, submitted = first_step_at(out["ledger"]), out["submitted_at"]
    return {"wall_s": (out["flow_end_at"] or submitted) - submitted,
            "to_first_step_s": first - submitted if first else None,
            "epochs": _epochs(out["epochs"])}


ROWS = ("Ray Train", "Zooid ring, first run", "Zooid ring, cached profile", "Zooid store, first run",
        "Zooid store, cached profile", "plain PyTorch, 1 process")
STACK_ROWS = ("Zooid on the running stack, first run", "Zooid on the running stack, cached profile")


def stack_rounds(folder: Path, rounds: int) -> list[dict[str, dict]]:
    """`rounds` pairs of deployment runs (fresh store, then the same store) on one local stack
    (`deployments.stack.up`, scratch home), started before and stopped after."""
    home, out = folder / "stack", []
    with local_stack(home):
        for k in range(rounds):
            store = folder / f"stack-store-{k}"
            out.append({row: run_on_stack(home, store) for row in STACK_ROWS})
            print(f"stack round {k}: " + ", ".join(f"{row} {r['to_first_step_s']:.1f} s to first step"
                                                   for row, r in out[-1].items()), flush=True)
    return out


def one_round(folder: Path, ray_py: Path, k: int) -> dict[str, dict]:
    out = {}
    ray_dir = folder / f"ray-{k}"
    ray_dir.mkdir()
    (ray_dir / "tmp").mkdir()
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(ray_dir), "PYTHONPATH": str(REPO),
           "RAY_USAGE_STATS_ENABLED": "0", "RAY_TMPDIR": str(ray_dir / "tmp"), "RAY_STORAGE": str(ray_dir / "runs"),
           "RAY_TRAIN_V2_ENABLED": "1", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": str(RAY_POLL_S),
           "OMP_NUM_THREADS": "1"}
    out["Ray Train"] = run_script(ray_py, RAY_DRIVER, env, ray_dir)
    for collective in ("ring", "store"):
        home = folder / f"zooid-{collective}-{k}"
        home.mkdir()
        out[f"Zooid {collective}, first run"] = run_zooid(home, collective)
        out[f"Zooid {collective}, cached profile"] = run_zooid(home, collective)
    plain_dir = folder / f"plain-{k}"
    plain_dir.mkdir()
    out["plain PyTorch, 1 process"] = run_script(Path(sys.executable), PLAIN,
                                                 {**os.environ, "PYTHONPATH": str(REPO)}, plain_dir)
    return out


def _s(x) -> str:
    return "-" if x is None else f"{x:.2f} s"


def render(rounds: list[dict[str, dict]], stack: list[dict[str, dict]]) -> str:
    stats = {}
    rounds = [{**r, **s} for r, s in zip(rounds, stack)] if stack else rounds
    rows = ROWS + (STACK_ROWS if stack else ())
    for row in rows:
        runs = [r[row] for r in rounds]
        stats[row] = {"wall": median(r["wall_s"] for r in runs), "first": median(r["to_first_step_s"] for r in runs),
                      "epochs": median(statistics.mean(e["seconds"] for e in r["epochs"][1:4]) for r in runs),
                      "acc": median(r["epochs"][-1]["val_accuracy"] for r in runs)}
    lines = ["| | whole command | to first step | epochs 1-3 (mean) | final accuracy |", "|---|---|---|---|---|"]
    for row in rows:
        s = stats[row]
        lines.append(f"| {row} | {_s(s['wall'])} | {_s(s['first'])} | {_s(s['epochs'])} | {s['acc']:.3f} |")
    ray = stats["Ray Train"]

    def goal(name: str, ratio: float | None, limit: float) -> str:
        verdict = "met" if ratio is not None and ratio <= limit else "not met"
        return f"- {name}: {ratio:.2f}x Ray's (goal at most {limit}x): **{verdict}**"

    lines += ["", "## Goals", "",
              goal("Whole command, first run (ring)", stats["Zooid ring, first run"]["wall"] / ray["wall"],
                   GOALS["first"]),
              goal("Whole command, cached profile (ring)", stats["Zooid ring, cached profile"]["wall"] / ray["wall"],
                   GOALS["cached"]),
              goal("Every-step epochs over ring (cached)", stats["Zooid ring, cached profile"]["epochs"]
                   / ray["epochs"], GOALS["ring"]),
              goal("Every-step epochs over the store (cached)", stats["Zooid store, cached profile"]["epochs"]
                   / ray["epochs"], GOALS["store"])]
    for row in STACK_ROWS if stack else ():
        first = stats[row]["first"]
        verdict = "met" if first is not None and first <= GOALS["submit_s"] else "not met"
        lines.append(f"- Submit to first step on a running stack ({row.rsplit(', ', 1)[1]}): {_s(first)} "
                     f"(goal at most {GOALS['submit_s']:g} s): **{verdict}**")
    lines += ["", "Per round (whole command / to first step / epochs 1-3; on the stack: submit to the flow "
              "run's end / submit to first step / epochs 1-3):", ""]
    for k, r in enumerate(rounds):
        lines.append(f"- round {k}: " + "; ".join(
            f"{row}: {r[row]['wall_s']:.1f} / {_s(r[row]['to_first_step_s'])} / "
            f"{statistics.mean(e['seconds'] for e in r[row]['epochs'][1:4]):.3f} s" for row in rows))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_peers", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder (Ray's virtualenv included)")
    parser.add_argument("--scratch", type=Path, help="the scratch folder (default: a new temporary one)")
    parser.add_argument("--no-stack", action="store_true", help="leave out the rows on a running local stack")
    args = parser.parse_args(argv)
    prov = provenance()
    with scratch("peers", keep=args.keep, folder=args.scratch) as folder:
        ray_py = ray_python(folder)
        rounds = []
        for k in range(args.rounds):
            rounds.append(one_round(folder, ray_py, k))
            print(f"round {k}: " + ", ".join(f"{row} {r['wall_s']:.1f} s" for row, r in rounds[-1].items()),
                  flush=True)
        stack = stack_rounds(folder, args.rounds) if not args.no_stack else []
        body = (f"Job: {json.dumps(JOB)}; every step averaged (Zooid `sync_period=1`, Ray DDP); "
                f"Ray {RAY_VERSION}, controller poll {RAY_POLL_S} s; {args.rounds} rounds, interleaved; "
                "medians over the rounds. Method: the module docstring of `benchmarks/bench_peers.py`.\n\n"
                + render(rounds, stack))
        write_result(args.out, TITLE, command_for("benchmarks.bench_peers", argv), prov, body)
        print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
