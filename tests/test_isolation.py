"""Three runs at once on one store and one Prefect API never see each other's keys or
workers, and the global paid-worker limit caps how many workers run at once."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("prefect_api")
ROOT = Path(__file__).resolve().parent.parent


def _max_overlap(intervals: list[tuple[float, float]]) -> int:
    events = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    most = now = 0
    for _, delta in events:
        now += delta
        most = max(most, now)
    return most


def test_three_concurrent_runs_are_isolated_and_capped(tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    from deployments.bootstrap import ensure_concurrency_limit
    from tasks.launchers import PAID_WORKERS_LIMIT

    with get_client(sync_client=True) as client:  # another test of the session may have made it: resize it
        ensure_concurrency_limit(client, 4)
    try:
        store = tmp_path / "store"
        env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
        procs = [subprocess.Popen([sys.executable, "-m", "flows.train", "--param", f"store=file://{store}",
                                   "--param", "workers=2", "--param", "epochs=1", "--param", "batch_size=32", "--param", "strategy=local_sgd",
                                   "--summary-out", str(tmp_path / f"s{i}.json")],
                                  cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for i in range(3)]
        for p in procs:
            _, err = p.communicate(timeout=400)
            assert p.returncode == 0, err[-2000:]
    finally:
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
    assert sorted(p.name for p in (store / "runs").iterdir()) == sorted(run_ids)
    assert _max_overlap(intervals) <= 4
