"""The local stack's container half: what `target=docker` needs beside the Prefect server and
the process pool.

- the container engine's Docker API (`deployments.engine`: podman's socket, or the engine
  already at `DOCKER_HOST`);
- the worker image (`deployments.images`: built offline, rebuilt only when its inputs change);
- an S3 server (moto in server mode, on 127.0.0.1) and a `Zooid Store` block for it, so the
  containers reach the store over the network as on a cloud, with the block's keys; an
  `s3-bucket` block on the same server is the containers' result storage (a cold worker's
  result is read back from there, as on ECS);
- the `zooid-docker` pool (its template's default image is the one just built), the
  `worker/docker` and `train/docker` deployments, and a Prefect Docker worker polling the pool.

Every process starts in a session of its own; the stack's `down` stops them by pid.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from deployments import engine
from deployments.images import worker_image
from deployments.server import ROOT, bin_path, free_port, spawn, stop_groups

POOL = "zooid-docker"
STORE_BLOCK = "zooid-docker-s3"
RESULTS_BLOCK = "zooid-docker-results"
BUCKET = "zooid"
S3_KEYS = {"aws_access_key_id": "zooid-local", "aws_secret_access_key": "zooid-local-secret"}
"""moto accepts any key; these live in the store block only, never in an environment."""


def docker_host(home: Path) -> str:
    """The engine the stack's processes talk to: `DOCKER_HOST` when set, else the project's socket."""
    return os.environ.get("DOCKER_HOST") or engine.docker_host(home)


def _wait_port(port: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"nothing answered on 127.0.0.1:{port} in {timeout_s:.0f} s")


def start_s3(home: Path) -> tuple[int, str]:
    """moto's S3 API on a free 127.0.0.1 port, in a session of its own: (pid, endpoint)."""
    port = free_port(0)
    pid = spawn([bin_path("moto_server"), "-H", "127.0.0.1", "-p", str(port)], {}, home / "logs" / "s3.log")
    _wait_port(port)
    return pid, f"http://127.0.0.1:{port}"


def save_store_block(endpoint: str) -> str:
    """Create the bucket, save the `Zooid Store` block the docker target's runs use and the
    containers' result storage block; the store block's name."""
    import boto3
    from prefect_aws import AwsCredentials, S3Bucket
    from prefect_aws.client_parameters import AwsClientParameters

    # blocks.store_refs imports Prefect, which reads its settings when first imported: not at this
    # module's import, which deployments.stack makes before the stack's environment is set
    from blocks.store_refs import ZooidStore

    s3 = boto3.session.Session(region_name="us-east-1", **S3_KEYS).client("s3", endpoint_url=endpoint)
    try:
        s3.create_bucket(Bucket=BUCKET)
    except s3.exceptions.BucketAlreadyOwnedByYou:
        pass
    ZooidStore(url=f"s3://{BUCKET}/zooid", endpoint_url=endpoint, region_name="us-east-1",
               aws_access_key_id=S3_KEYS["aws_access_key_id"],
               aws_secret_access_key=S3_KEYS["aws_secret_access_key"]).save(STORE_BLOCK, overwrite=True)
    credentials = AwsCredentials(region_name="us-east-1", **S3_KEYS,
                                 aws_client_parameters=AwsClientParameters(endpoint_url=endpoint))
    S3Bucket(bucket_name=BUCKET, bucket_folder="prefect-results", credentials=credentials).save(
        RESULTS_BLOCK, overwrite=True)
    return STORE_BLOCK


def container_env() -> dict[str, str]:
    """The pool's default environment for every container: a Prefect home of its own (not the
    host path the pool's worker has) and results on the S3 server, by block name."""
    return {"PREFECT_HOME": "/tmp/prefect", "PREFECT_LOCAL_STORAGE_PATH": "/tmp/prefect/storage",
            "PREFECT_DEFAULT_RESULT_STORAGE_BLOCK": f"s3-bucket/{RESULTS_BLOCK}"}


def up(home: Path, env: dict[str, str], api_url: str) -> dict:
    """Start the container half on the running stack at `api_url`; return its pids and facts."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    pids: dict[str, int] = {}
    url = env["DOCKER_HOST"]
    if url == engine.docker_host(home):
        started = engine.up(home)
        if started["started"]:
            pids["engine"] = started["pid"]
    elif not engine.ping(url):
        raise engine.EngineError("target", f"no container engine answers at DOCKER_HOST={url}")
    try:
        image = worker_image(home=home)
        pids["s3"], endpoint = start_s3(home)
        with temporary_settings(updates={PREFECT_API_URL: api_url}):
            store = save_store_block(endpoint)
        run = dict(env={**os.environ, **env}, cwd=ROOT, check=True, stdin=subprocess.DEVNULL)
        subprocess.run([sys.executable, "-m", "deployments.bootstrap", "--target", "docker", "--image", image,
                        *[f"--env={k}={v}" for k, v in container_env().items()]], stdout=subprocess.DEVNULL, **run)
        # both deployments named `docker` (train/docker, worker/docker)
        subprocess.run([bin_path("prefect"), "--no-prompt", "deploy", "--name", "docker"],
                       stdout=subprocess.DEVNULL, **run)
        pids["docker_worker"] = spawn([bin_path("prefect"), "worker", "start", "--pool", POOL, "--type", "docker"],
                                      env, home / "logs" / "docker-worker.log")
    except BaseException:
        stop_groups(list(pids.values()))
        raise
    return {"pids": pids, "image": image, "store": store, "s3_endpoint": endpoint, "docker_host": url}
