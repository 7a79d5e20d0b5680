"""Store servers for a benchmark, on 127.0.0.1 and free ports, each in its own process group
and stopped by its pid, as the stack stops its own (`deployments.server.stop_groups`)."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from deployments.server import free_port, stop_groups

S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
"""The credentials and region a moto server takes (set in this process by `moto_server`)."""


def start_server(argv: list[str], port: int, log: Path) -> subprocess.Popen:
    """Start `argv` in its own session and wait until 127.0.0.1:`port` accepts connections."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"{argv[0]} exited; see {log}")
            time.sleep(0.05)
    stop_server(proc)
    raise RuntimeError(f"{argv[0]} did not listen on {port}; see {log}")


def stop_server(proc: subprocess.Popen) -> None:
    """Stop the server's process group by its pid."""
    if proc.poll() is None:
        stop_groups([proc.pid])
        proc.wait()


def redis_server(work: Path) -> tuple[subprocess.Popen, str]:
    """A `redis-server` without persistence, its files and log in `work`: (process, store URL)."""
    port = free_port(0)
    proc = start_server([shutil.which("redis-server") or "redis-server", "--bind", "127.0.0.1", "--port", str(port),
                         "--save", "", "--appendonly", "no", "--dir", str(work)], port, work / "redis.log")
    return proc, f"redis://127.0.0.1:{port}/0"


def moto_server(work: Path, bucket: str = "bench") -> tuple[subprocess.Popen, str]:
    """An S3 server (moto's `moto_server`, its log in `work`) with `bucket` created, and `S3_ENV`
    set in this process: (process, endpoint URL)."""
    import boto3  # only the benchmarks that serve S3 need it

    os.environ.update(S3_ENV)
    port = free_port(0)
    proc = start_server([str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(port)],
                        port, work / "moto.log")
    endpoint = f"http://127.0.0.1:{port}"
    try:
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
    except BaseException:
        stop_server(proc)
        raise
    return proc, endpoint
