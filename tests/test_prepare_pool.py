"""`prepare/local` on the local stack for real: a files-of-arrays source cut in parallel by
`worker/local` flow runs on the `zooid-local` process pool, one per cut, each linked to its cut's
task run in the prepare's flow run; the shards equal the source rows."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from comm.store import open_store
from deployments.server import free_port
from engine.datasets import read_shards
from engine.shards import read_dataset_manifest

ROOT = Path(__file__).resolve().parent.parent


def write_source(root: Path) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(2)
    x, y = rng.standard_normal((90, 6)).astype(np.float32), rng.integers(0, 3, 90)
    (root / "train").mkdir(parents=True)
    (root / "val").mkdir()
    np.savez(root / "train" / "a.npz", x=x[:40], y=y[:40])
    np.savez_compressed(root / "train" / "b.npz", x=x[40:70], y=y[40:70])
    np.savez(root / "val" / "a.npz", x=x[70:], y=y[70:])
    return x, y


@pytest.mark.slow
def test_prepare_local_cuts_on_the_process_pool_as_worker_flow_runs(tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags, TaskRunFilter, TaskRunFilterFlowRunId
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from deployments.stack import wait_final

    x, y = write_source(tmp_path / "raw")
    bucket = tmp_path / "bucket"
    home = tmp_path / "zooid"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(ZOOID_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1")
    up = subprocess.run([sys.executable, "-m", "deployments.stack", "up", "--port", str(free_port(0))], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=600, check=False)
    try:
        assert up.returncode == 0, up.stdout[-2000:] + up.stderr[-2000:]
        assert "deployed prepare/local on pool zooid-local" in up.stdout
        api = json.loads((home / "stack.json").read_text())["api_url"]
        with temporary_settings(updates={PREFECT_API_URL: api}), get_client(sync_client=True) as client:
            flow_run = run_deployment("prepare/local", timeout=0, parameters={
                "dataset": f"arrays:{tmp_path / 'raw'}", "to": bucket.as_uri(), "subset_size": 16, "workers": 2})
            final = wait_final(client, flow_run.id, timeout_s=500)
            assert final.state.is_completed(), final.state.message
            assert final.parameters["target"] == "local"  # the deployment's own (prefect.yaml)
            cuts = client.read_task_runs(task_run_filter=TaskRunFilter(
                flow_run_id=TaskRunFilterFlowRunId(any_=[flow_run.id])))
            named = sorted(t.name for t in cuts if t.name.startswith("cut "))
            assert named == ["cut train shards 0-2", "cut train shards 3-4", "cut val shards 0-1"]
            workers = client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=["zooid-prepare"])))
            assert sorted(w.name for w in workers) == [f"prepare-{n.replace(' ', '-')}" for n in named]
            assert all(w.state.is_completed() for w in workers)
            assert len({w.infrastructure_pid for w in workers}) == 3  # a process of its own each
            deployment = client.read_deployment_by_name("worker/local")
            assert {w.deployment_id for w in workers} == {deployment.id}
    finally:
        subprocess.run([sys.executable, "-m", "deployments.stack", "down"], cwd=ROOT, env=env, capture_output=True,
                       timeout=120, check=False)
    with open_store(bucket.as_uri()) as store:
        manifest = read_dataset_manifest(store, "")
        assert (manifest.n_train, manifest.n_val, manifest.n_subsets, manifest.n_val_subsets) == (70, 20, 5, 2)
        tx, ty = read_shards(store, "", range(5), "train", manifest=manifest)
        vx, vy = read_shards(store, "", range(2), "val", manifest=manifest)
    assert torch.equal(tx, torch.from_numpy(x[:70])) and torch.equal(ty, torch.from_numpy(y[:70]))
    assert torch.equal(vx, torch.from_numpy(x[70:])) and torch.equal(vy, torch.from_numpy(y[70:]))
