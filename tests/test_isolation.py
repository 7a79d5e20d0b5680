"""Three runs at once on one store and one Prefect API never see each other's keys or
workers, and the global paid-worker limit caps how many workers run at once."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("prefect_api")
ROOT = Path(__file__).resolve().parent.parent


def _described(by_run: dict[str, list[int]], runs: list[str]) -> str:
    """Each run's worker processes as `ps` shows them (what a count over the limit counted)."""
    pids = [str(pid) for r in runs for pid in by_run.get(r, [])]
    shown = subprocess.run(["ps", "-o", "pid,ppid,pgid,comm,etimes,args", "-p", ",".join(pids)],
                           capture_output=True, text=True).stdout
    return f"{len(pids)} workers alive: {({r: by_run.get(r, []) for r in runs})}\n{shown}"


def _max_overlap(intervals: list[tuple[float, float]]) -> int:
    events = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    most = now = 0
    for _, delta in events:
        now += delta
        most = max(most, now)
    return most


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_three_concurrent_runs_are_isolated_and_capped(tmp_path):
    """Each run's rank 0 is held at its first step until the test releases it, so workers stay
    up: the test waits until the limit's 4 slots are all taken (a run that did not take slots
    never fills them: the test times out) and sees then that 4 worker processes are alive for
    6 wanted, at most 2 runs held; then it releases every run."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    from comm.store_dir import DirectoryStore
    from coordinator.workers.launchers import PAID_WORKERS_LIMIT
    from coordinator.workers.sweep import sweep_run, workers_by_run
    from deployments.bootstrap import ensure_concurrency_limit

    with get_client(sync_client=True) as client:  # another test of the session may have made it: resize it
        ensure_concurrency_limit(client, 4)
    store = tmp_path / "store"
    runs_dir = store / "runs"

    def runs() -> list[str]:
        return [p.name for p in runs_dir.iterdir() if p.is_dir() and p.name != "cache"] if runs_dir.exists() else []

    def held() -> set[str]:
        return {r for r in runs() if list((runs_dir / r / "faults").glob("held-*.json"))}

    procs = []
    try:
        env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(),
               "ZOOID_CHAOS": "hold_worker:epoch=0:rank=0:step=1:until=release"}
        logs = [tmp_path / f"coordinator{i}.log" for i in range(3)]
        for i in range(3):
            with open(logs[i], "wb") as err:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "flows.train", "--param", f"store=file://{store}",
                     "--param", "workers=2", "--param", "epochs=1", "--param", "batch_size=32",
                     "--param", "strategy=local_sgd", "--summary-out", str(tmp_path / f"s{i}.json")],
                    cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err))
        with get_client(sync_client=True) as client:
            # the event: a run is held, every slot of the limit is taken and its 4 workers are up;
            # 3 runs of 2 want 6 workers, and never more than 4 are alive
            while True:
                by_run = workers_by_run()  # one reading of /proc: the runs' workers at one moment
                alive = sum(len(by_run.get(r, [])) for r in runs())
                assert alive <= 4, _described(by_run, runs())
                slots = client.read_global_concurrency_limit_by_name(PAID_WORKERS_LIMIT).active_slots
                if held() and slots == 4 and alive == 4:
                    break
                assert all(p.poll() is None for p in procs), [log.read_text()[-2000:] for log in logs]
                time.sleep(0.2)
            assert 1 <= len(held()) <= 2  # at most two runs have both their workers
        store_client = DirectoryStore(store)
        while any(p.poll() is None for p in procs):  # release every run, those still waiting too
            for r in runs():
                if not store_client.exists(f"runs/{r}/release"):
                    store_client.put(f"runs/{r}/release", b"go")
            time.sleep(0.2)
        for p, log in zip(procs, logs):
            assert p.wait() == 0, log.read_text()[-2000:]
    finally:
        for p in procs:  # a failed check leaves held runs behind: stop them and their workers
            if p.poll() is None:
                p.kill()
                p.wait()
        for r in runs():
            sweep_run(r)
        with get_client(sync_client=True) as client:
            client.delete_global_concurrency_limit_by_name(PAID_WORKERS_LIMIT)

    summaries = [json.loads((tmp_path / f"s{i}.json").read_text()) for i in range(3)]
    run_ids = {s["run_id"] for s in summaries}
    assert len(run_ids) == 3
    # the same job and seed in isolation gives the same model: nobody read another run's slices
    assert len({s["final_loss"] for s in summaries}) == 1
    intervals = []
    for s in summaries:
        run = store / "runs" / s["run_id"]
        ledger = json.loads((run / "cost.json").read_text())
        assert {r["run_id"] for r in ledger["rows"]} == {s["run_id"]}
        lives = {}  # a warm worker's rows (start-up, idle, busy) cover its life: one interval each
        for r in ledger["rows"]:
            if r["kind"] == "worker":
                start, stop = lives.get(r["worker"], (r["start"], r["stop"]))
                lives[r["worker"]] = (min(start, r["start"]), max(stop, r["stop"]))
        assert len(lives) == 2
        intervals += list(lives.values())
        # every key a run wrote lives under its own prefix, and its scratch is gone
        assert not (run / "sync").exists() or not any((run / "sync").rglob("*.*"))
    assert sorted(p.name for p in (store / "runs").iterdir() if p.name != "cache") == sorted(run_ids)
    assert _max_overlap(intervals) == 4  # reached while the runs were held, and never passed
