"""Workers in containers against workers as processes: start-up and warm per-epoch overhead,
the docker target beside the process pool, same job, same stack, same store, one run.

One local stack with its container half (`deployments.stack.up(docker=True)`, scratch home):
the Prefect server, the `zooid-local` process pool and the `zooid-docker` pool (prefect-docker's
worker on podman's Docker API), an S3 server and its store block. The same job runs
`--repeats` times on each target, alternating (local, docker, local, docker, ...): digits,
`digits_mlp`, Local-SGD once per epoch, 2 warm workers x batch 16, momentum, lr 0.05,
`--epochs` epochs, the S3 store for both (so the targets differ only in how a worker runs).

Per worker (a watcher reads the Prefect API, the engine and the store every 0.2 s while the
run goes on):
- launch -> ready: the worker flow run's creation (`run_deployment`, Prefect's clock) to the
  worker's `ready_at` (imports done, model built, waiting for commands; the worker's clock:
  the same host clock for processes and containers);
- container -> ready (docker): the engine's `Created` to `ready_at`;
- ready -> first step: to the `began_at` of the worker's first epoch command (after the
  profile and the plan, so this is waiting, not start-up).
Per epoch (epochs 1.., warm): overhead = wall - busy as in `bench_orchestration` (the
summary's `seconds` less the slowest worker's compute + sync). Goal: the docker target's
median warm overhead within 0.2 s of the process pool's.

    .venv/bin/python -m benchmarks.bench_containers [--epochs 4] [--repeats 2] [--out PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from pathlib import Path

from benchmarks.harness.home import scratch
from benchmarks.harness.overhead import DETAIL, epoch_rows, summarise_rows
from benchmarks.harness.stack import local_stack
from benchmarks.harness.tables import fmt, median, table
from benchmarks.harness.train import digits_job
from benchmarks.output import SOURCE, command_for, provenance, write_result
from core.keys import summary_key, warm_prefix

RESULTS = Path(__file__).resolve().parent / "results" / "containers.md"
SOURCES = (*SOURCE, "benchmarks/harness/stack.py", "benchmarks/harness/replicas.py",
           "benchmarks/harness/train.py", "benchmarks/harness/overhead.py", "benchmarks/harness/tables.py")
"""The code it measures (the whole project: train runs on the docker target and the process pool): its
results file is stale once one of these changed since the commit the file names
(`benchmarks.staleness`)."""
TITLE = "Workers in containers: docker target against the process pool"
GOAL_DELTA_S = 0.2
WORKERS = 2


class Watcher(threading.Thread):
    """Collects, while a run goes on, each worker flow run's creation, each container's
    creation and each warm worker's `ready_at` (its status key, deleted at teardown)."""

    def __init__(self, run_id: str, store_ref: str, every_s: float = 0.2):
        super().__init__(daemon=True)
        self.run_id, self.store_ref, self.every_s = run_id, store_ref, every_s
        self.flow_runs: dict[str, float] = {}  # worker name -> flow run created
        self.containers: dict[str, float] = {}  # worker name -> container Created
        self.ready: dict[str, float] = {}  # worker name -> ready_at
        self.first_step: dict[str, float] = {}  # worker name -> first epoch command's began_at
        self.stopped = threading.Event()

    def run(self) -> None:
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

        from blocks.store_refs import open_store_ref
        from clouds.docker import docker_client, run_containers
        from clouds.timestamps import epoch_seconds

        store = open_store_ref(self.store_ref)
        engine = docker_client() if os.environ.get("DOCKER_HOST") else None
        prefix = warm_prefix(self.run_id) + "/"
        try:
            with get_client(sync_client=True) as api:
                while not self.stopped.is_set():
                    for fr in api.read_flow_runs(flow_run_filter=FlowRunFilter(
                            tags=FlowRunFilterTags(all_=[f"zooid-run:{self.run_id}"]))):
                        name = fr.name.split("-warm-", 1)[-1]
                        self.flow_runs.setdefault(name, fr.created.timestamp())
                    if engine is not None:
                        for c in run_containers(engine, self.run_id):
                            labels = c.attrs["Config"]["Labels"] or {}
                            name = labels.get("io.prefect.flow-run-name", "").split("-warm-", 1)[-1]
                            self.containers.setdefault(name, epoch_seconds(c.attrs["Created"]))
                    for key in store.list(prefix):
                        worker = key[len(prefix):].split("/", 1)[0]
                        if key.endswith("/status.json") and worker not in self.ready:
                            doc = json.loads(store.get(key, timeout=5))
                            if doc.get("ready_at"):
                                self.ready[worker] = float(doc["ready_at"])
                        elif "/reply-" in key and worker not in self.first_step:
                            doc = json.loads(store.get(key, timeout=5))
                            if doc.get("result") and doc.get("began_at"):  # an epoch, not the profile
                                self.first_step[worker] = float(doc["began_at"])
                    self.stopped.wait(self.every_s)
        finally:
            store.close()
            if engine is not None:
                engine.close()


def run_once(target: str, params: dict, store_block: str, timeout_s: float = 900) -> dict:
    """One run of `params` on `target` through `train/local`; its summary and the watcher's times."""
    from prefect.deployments import run_deployment

    from blocks.store_block import block_ref
    from coordinator.run.context import run_id_for

    params = {**params, "target": target, "store": store_block}
    fr = run_deployment("train/local", parameters=params, timeout=0)
    watcher = Watcher(run_id_for(fr.id), block_ref(store_block))
    watcher.start()
    try:
        summary = _wait_summary(fr.id, block_ref(store_block), timeout_s)
    finally:
        watcher.stopped.set()
        watcher.join(10)
    workers = []
    for name, ready in watcher.ready.items():
        launched = watcher.flow_runs.get(name)
        created = watcher.containers.get(name)
        first = watcher.first_step.get(name)
        workers.append({"worker": name, "launch_to_ready_s": ready - launched if launched else None,
                        "container_to_ready_s": ready - created if created else None,
                        "ready_to_first_step_s": first - ready if first else None})
    return {"target": target, "summary": summary, "workers": workers}


def _wait_summary(flow_run_id, store_ref: str, timeout_s: float) -> dict:
    from prefect.client.orchestration import get_client

    from blocks.store_refs import open_store_ref
    from coordinator.run.context import run_id_for
    from deployments.stack import wait_final

    with get_client(sync_client=True) as api:
        fr = wait_final(api, flow_run_id, timeout_s, poll_s=0.2)
    if not fr.state.is_completed():
        raise RuntimeError(f"run {flow_run_id} ended {fr.state.type.value}: {fr.state.message}")
    store = open_store_ref(store_ref)
    try:
        return json.loads(store.get(summary_key(run_id_for(flow_run_id)), timeout=30))
    finally:
        store.close()


def render(runs: list[dict], image: dict, epochs: int) -> str:
    """The markdown below the header: the goal, medians per target, every run's epochs."""
    by_target: dict[str, dict] = {}
    for run in runs:
        agg = by_target.setdefault(run["target"], {"over": [], "wall": [], "epoch0": [], "launch": [],
                                                   "container": [], "first": [], "acc": []})
        s = summarise_rows(epoch_rows(run["target"], "warm", run["summary"]))
        agg["over"] += [r["overhead_s"] for r in epoch_rows(run["target"], "warm", run["summary"]) if r["epoch"] >= 1]
        agg["wall"].append(s["wall_s"])
        agg["epoch0"].append(s["epoch0_overhead_s"])
        agg["acc"].append(run["summary"].get("final_accuracy"))
        for w in run["workers"]:
            agg["launch"].append(w["launch_to_ready_s"])
            agg["container"].append(w["container_to_ready_s"])
            agg["first"].append(w["ready_to_first_step_s"])
    local, docker = by_target.get("local", {}), by_target.get("docker", {})
    delta = (median(docker.get("over", [])) - median(local.get("over", []))
             if median(docker.get("over", [])) is not None and median(local.get("over", [])) is not None else None)
    met = delta is not None and delta <= GOAL_DELTA_S
    lines = [f"Job: digits, `digits_mlp`, Local-SGD once per epoch, {WORKERS} warm workers x batch 16, momentum, "
             f"lr 0.05, {epochs} epochs, the stack's S3 store (moto, 127.0.0.1) on both targets; runs alternate "
             "local, docker. local = the `zooid-local` process pool (a worker is a process); docker = the "
             "`zooid-docker` pool (a worker is a container of the worker image on podman's Docker API, host "
             f"network, 1 vCPU quota each). Image `{image.get('image')}`, {image.get('size', '?')}.", "",
             f"**Goal: docker's median warm per-epoch overhead within {GOAL_DELTA_S} s of the process pool's: "
             f"{'met' if met else 'not met'}** (docker - local = {fmt(delta, '{:+.2f}')} s).", "",
             *table(["target", "runs", "launch -> ready (s)", "container -> ready (s)", "ready -> first epoch (s)",
                     "epoch 0 overhead (s)", "warm overhead, epochs 1.. (s)", "epoch wall (s)", "final accuracy"])]
    for name in ("local", "docker"):
        a = by_target.get(name)
        if not a:
            continue
        lines.append(f"| {name} | {len(a['wall'])} | {fmt(median(a['launch']))} | {fmt(median(a['container']))} | "
                     f"{fmt(median(a['first']))} | {fmt(median(a['epoch0']))} | {fmt(median(a['over']), '{:.3f}')} | "
                     f"{fmt(median(a['wall']))} | {fmt(median(a['acc']), '{:.3f}')} |")
    lines += ["", "Medians over workers (start-up) and over epochs 1.. of every run (overhead). launch -> ready: "
              "the worker flow run's creation to the worker's `ready_at` (imports, model, data); container -> "
              "ready: the engine's `Created` to `ready_at`; ready -> first epoch: waiting while rank 0 profiles "
              "and the coordinator plans. Overhead = the summary's `seconds` less the slowest worker's compute + "
              "sync (`critical_busy_s`).", "", "Per run:", "",
              *table(["target", "run", "epoch", "wall (s)", "busy (s)", "overhead (s)"])]
    for i, run in enumerate(runs):
        for r in epoch_rows(run["target"], "warm", run["summary"]):
            lines.append(f"| {run['target']} | {i} | {r['epoch']} | {r['wall_s']:.2f} | {r['busy_s']:.2f} | "
                         f"{r['overhead_s']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_containers", description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    from deployments.images import ensure_image

    prov = provenance()
    runs = []
    with scratch("containers", home=True) as home, local_stack(home, docker=True) as state:
        image = ensure_image(home=home)  # the stack's image (a no-op check): its reference and size
        params = digits_job(WORKERS, args.epochs, True)
        for i in range(args.repeats):
            for target in ("local", "docker"):
                run = run_once(target, params, state["docker"]["store"])
                runs.append(run)
                print(f"{target} run {i}: overhead {[round(r['overhead_s'], 3) for r in epoch_rows(target, 'warm', run['summary'])]}, "
                      f"workers {run['workers']}", flush=True)
    write_result(args.out, TITLE, command_for("benchmarks.bench_containers", argv), prov, render(runs, image, args.epochs), detail=DETAIL,
                 echo=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
