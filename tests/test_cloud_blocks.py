"""Cloud store blocks: URLs and worker environments carry no secret; the stores open and work."""
from __future__ import annotations

import json
import os
import uuid

import pytest

from blocks.cloud import ZooidRedisStore, ZooidS3Store
from deployments.bootstrap import with_variable_defaults
from tests.cloud_fixtures import template


def test_s3_store_block_opens_the_bucket_and_leaks_no_key(s3_server):
    from prefect_aws import AwsCredentials
    from prefect_aws.s3 import S3Bucket

    bucket = s3_server.create_bucket("zooid-blocks")
    creds = AwsCredentials(aws_access_key_id="testing", aws_secret_access_key="s3cr3t-key", region_name="us-east-1",
                           aws_client_parameters={"endpoint_url": s3_server.endpoint})
    block = ZooidS3Store(bucket=S3Bucket(bucket_name=bucket, credentials=creds), prefix="runs-test")
    assert block.url() == f"s3://{bucket}/runs-test?endpoint={s3_server.endpoint}"
    assert "s3cr3t" not in block.url() + json.dumps(block.worker_environment())
    assert "s3cr3t" not in repr(block)
    store = block.open()
    try:
        store.put("runs/z1/probe/x", b"\x00\x01")
        assert store.get("runs/z1/probe/x") == b"\x00\x01"
    finally:
        store.close()
    # the key reached boto3 as an argument: nothing of it is in this process's environment
    assert not any("s3cr3t" in v for v in os.environ.values())


def test_zooid_store_block_hands_its_keys_to_boto3_not_the_environment(s3_server):
    from pydantic import SecretStr

    from blocks.store_refs import ZooidStore

    bucket = s3_server.create_bucket("zooid-store-block")
    block = ZooidStore(url=f"s3://{bucket}/p", aws_access_key_id="AKIAZOOIDTEST",
                       aws_secret_access_key=SecretStr("s3cr3t-two"), region_name="us-east-1",
                       endpoint_url=s3_server.endpoint)
    store = block.open()
    try:
        store.put("runs/z3/probe/x", b"ok")
        assert store.get("runs/z3/probe/x") == b"ok"
        assert store.client._request_signer._credentials.access_key == "AKIAZOOIDTEST"
    finally:
        store.close()
    assert not any("s3cr3t" in v or v == "AKIAZOOIDTEST" for v in os.environ.values())


def test_redis_store_block_url_has_no_password(redis_server):
    from prefect_redis.blocks import RedisDatabase

    block = ZooidRedisStore(database=RedisDatabase(host="127.0.0.1", port=redis_server.port, db=0))
    assert block.url() == f"redis://127.0.0.1:{redis_server.port}/0"
    secret = ZooidRedisStore(database=RedisDatabase(host="h", port=1, password="p4ss"))
    assert "p4ss" not in secret.url() + repr(secret)
    store = block.open()
    try:
        store.put("runs/z2/probe/y", b"abc")
        assert store.get("runs/z2/probe/y") == b"abc"
    finally:
        store.close()


def test_pool_defaults_point_at_the_cloud_account():
    base = template("ecs")
    before = json.dumps(base, sort_keys=True)
    out = with_variable_defaults(base, {"cluster": "zooid", "aws_credentials": {
        "$ref": {"block_document_id": "0f0e"}}})
    props = out["variables"]["properties"]
    assert props["cluster"]["default"] == "zooid"
    assert props["aws_credentials"]["default"] == {"$ref": {"block_document_id": "0f0e"}}
    assert json.dumps(base, sort_keys=True) == before  # the input is not mutated
    with pytest.raises(ValueError, match="defaults"):
        with_variable_defaults(template("ecs"), {"resource_group_name": "rg"})


# --- a whole run on a secret store block -------------------------------------------------

class KeyCheckingS3Proxy:
    """An HTTP proxy on 127.0.0.1 in front of moto that passes only requests signed (AWS
    SigV4, header or query) with `access_key_id` and answers any other 403
    InvalidAccessKeyId, as AWS would: moto itself takes any key. It counts both."""

    def __init__(self, upstream: str, access_key_id: str):
        import http.server
        import re
        import threading
        from urllib.parse import unquote, urlsplit

        self.access_key_id, self.accepted, self.refused = access_key_id, 0, []
        target = urlsplit(upstream)
        proxy = self
        credential = re.compile(r"Credential=([^/,\s]+)/")
        hop = {"connection", "keep-alive", "transfer-encoding", "expect", "proxy-connection"}

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _body(self) -> bytes:
                if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                    out = b""
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return out
                        out += self.rfile.read(size)
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _reply(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
                self.send_response(status)
                for name, value in headers:
                    if name.lower() not in hop and name.lower() != "content-length":
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)) if self.command != "HEAD" else
                                 dict((k.lower(), v) for k, v in headers).get("content-length", "0"))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _forward(self) -> None:
                import http.client

                body = self._body()
                found = credential.search(self.headers.get("Authorization", "")) or \
                    credential.search("Credential=" + unquote(self.path.partition("X-Amz-Credential=")[2]))
                key = found.group(1) if found else None
                if key != proxy.access_key_id:
                    proxy.refused.append(key)
                    error = (b"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>InvalidAccessKeyId</Code>"
                             b"<Message>The AWS Access Key Id you provided does not exist in our records.</Message></Error>")
                    self._reply(403, [("Content-Type", "application/xml")], error)
                    return
                proxy.accepted += 1
                conn = http.client.HTTPConnection(target.hostname, target.port, timeout=60)
                try:
                    conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                    for name, value in self.headers.items():
                        if name.lower() not in hop and name.lower() != "content-length":
                            conn.putheader(name, value)
                    conn.putheader("Content-Length", str(len(body)))
                    conn.endheaders(body)
                    answer = conn.getresponse()
                    data = answer.read()
                    self._reply(answer.status, answer.getheaders(), data)
                finally:
                    conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def find_leaks(evidence: dict[str, bytes], secrets: list[str]) -> list[str]:
    """The names of the pieces of evidence (a log, an artifact, a stored object, a worker's
    environment, ...) whose bytes contain any of `secrets`."""
    needles = [s.encode() for s in secrets]
    return sorted(name for name, data in evidence.items() if any(n in data for n in needles))


def run_evidence(run_id: str, bucket: str, s3_client, worker_envs: list[dict]) -> dict[str, bytes]:
    """Everything a run on a secret store leaves where others can read it, by name: this
    run's logs (every flow run of the run and its task runs, every page, every level that
    reached the API), its artifacts and flow and task run parameters, every object in its
    bucket (bytes, whatever the type), the workers' log files, the environment each worker
    was started with, and this process's environment."""
    import asyncio

    from comm.store_dir import zooid_home
    from coordinator.run.context import run_id_for

    async def from_api() -> dict[str, bytes]:
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import (ArtifactFilter, ArtifactFilterFlowRunId, FlowRunFilter,
                                                    LogFilter, LogFilterFlowRunId, LogFilterTaskRunId,
                                                    TaskRunFilter, TaskRunFilterFlowRunId)
        from prefect.client.schemas.sorting import LogSort

        async def pages(read, **kwargs) -> list:
            out, offset = [], 0
            while True:
                page = await read(limit=200, offset=offset, **kwargs)
                out += page
                if len(page) < 200:
                    return out
                offset += len(page)

        async with get_client() as client:
            flow_runs = [r for r in await pages(client.read_flow_runs)
                         if run_id_for(r.id) == run_id or run_id in json.dumps(r.parameters, default=str)]
            assert flow_runs, f"no flow run of {run_id}"
            ids = [r.id for r in flow_runs]
            children = await pages(client.read_flow_runs, flow_run_filter=FlowRunFilter(
                parent_flow_run_id={"any_": ids}))
            flow_runs += [r for r in children if r.id not in ids]
            ids = [r.id for r in flow_runs]
            task_runs = await pages(client.read_task_runs, task_run_filter=TaskRunFilter(
                flow_run_id=TaskRunFilterFlowRunId(any_=ids)))
            logs = await pages(client.read_logs, log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=ids)),
                               sort=LogSort.TIMESTAMP_ASC)
            if task_runs:
                logs += await pages(client.read_logs, log_filter=LogFilter(
                    task_run_id=LogFilterTaskRunId(any_=[t.id for t in task_runs])), sort=LogSort.TIMESTAMP_ASC)
            artifacts = await pages(client.read_artifacts, artifact_filter=ArtifactFilter(
                flow_run_id=ArtifactFilterFlowRunId(any_=ids)))
        out = {f"log {l.id} ({l.level})": l.message.encode() for l in logs}
        out.update({f"artifact {a.key or a.id}": (json.dumps(a.data, default=str) + str(a.description)).encode()
                    for a in artifacts})
        out.update({f"flow run {r.name}": json.dumps(r.parameters, default=str).encode() for r in flow_runs})
        out.update({f"task run {t.name}": (json.dumps(t.task_inputs, default=str) + str(t.state and t.state.message)
                                           ).encode() for t in task_runs})
        out["levels"] = ",".join(sorted({str(l.level) for l in logs})).encode()
        return out

    evidence = asyncio.run(from_api())
    paginator = s3_client.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=bucket):
        for o in page.get("Contents", []):
            evidence[f"object {o['Key']}"] = s3_client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
    for path in (zooid_home() / "logs" / run_id).glob("*"):
        if path.is_file():
            evidence[f"worker file {path.name}"] = path.read_bytes()
    for i, env in enumerate(worker_envs):
        evidence[f"worker {i} environment"] = "\n".join(f"{k}={v}" for k, v in env.items()).encode()
    evidence["coordinator environment"] = "\n".join(f"{k}={v}" for k, v in os.environ.items()).encode()
    return evidence


@pytest.fixture
def secret_run(s3_server, tmp_path, monkeypatch):
    """`run(plant=None)`: a whole run on a saved ZooidStore block holding an AWS key pair,
    through an S3 endpoint that refuses every other key, with INFO logs sent to the API
    (the suite logs at WARNING), the environment of every worker recorded; returns the
    summary and the run's evidence. `plant(secret, key_id)` may plant a leak first."""
    import logging
    import subprocess

    from pydantic import SecretStr

    from blocks.store_refs import ZooidStore

    secret, key_id = "s3cr3t-Zooid-9f31c", "AKIAZOOIDRUN"
    monkeypatch.setenv("ZOOID_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PREFECT_LOGGING_LEVEL", "INFO")  # the workers' Prefect loggers
    prefect_logger = logging.getLogger("prefect")  # the coordinator's flow and task run loggers inherit it
    level = prefect_logger.level
    prefect_logger.setLevel(logging.INFO)
    bucket = s3_server.create_bucket(f"zooid-secret-{uuid.uuid4().hex[:12]}")
    proxy = KeyCheckingS3Proxy(s3_server.endpoint, key_id)
    worker_envs: list[dict] = []

    class RecordingPopen(subprocess.Popen):  # the environment each worker process starts with
        def __init__(self, args, *rest, **kwargs):
            if "--spec-json" in list(args):
                worker_envs.append(dict(kwargs.get("env") or os.environ))
            super().__init__(args, *rest, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", RecordingPopen)
    from coordinator.workers.worker_forks import WorkerForks

    real_start = WorkerForks.start

    def recording_start(self, argv, env, log):  # a worker forked ready-imported: the environment it is given
        worker_envs.append(dict(env))
        return real_start(self, argv, env, log)

    monkeypatch.setattr(WorkerForks, "start", recording_start)

    def run(plant=None):
        from prefect.logging.handlers import APILogHandler

        from coordinator.run.job import TrainJob
        from flows.train import train

        ZooidStore(url=f"s3://{bucket}/runs", aws_access_key_id=key_id, aws_secret_access_key=SecretStr(secret),
                   region_name="us-east-1", endpoint_url=proxy.endpoint).save("secret-run-store", overwrite=True)
        if plant is not None:
            plant(secret, key_id)
        summary = train(TrainJob(workers=2, epochs=1, batch_size=64, store="secret-run-store", warm=False))
        APILogHandler().flush()  # the run's last log lines reach the API before they are read
        return summary, run_evidence(summary.run_id, bucket, s3_server.client(), worker_envs)

    run.secrets, run.proxy, run.worker_envs = [secret, key_id], proxy, worker_envs
    try:
        yield run
    finally:
        prefect_logger.setLevel(level)
        proxy.close()


def test_the_s3_proxy_refuses_any_key_but_the_blocks(s3_server):
    import boto3
    from botocore.exceptions import ClientError

    bucket = s3_server.create_bucket("zooid-proxy-check")
    proxy = KeyCheckingS3Proxy(s3_server.endpoint, "AKIAGOOD")
    try:
        def client(key_id):
            return boto3.client("s3", endpoint_url=proxy.endpoint, region_name="us-east-1",
                                aws_access_key_id=key_id, aws_secret_access_key="x")

        client("AKIAGOOD").put_object(Bucket=bucket, Key="k", Body=b"\x00" * 3_000_000)
        assert client("AKIAGOOD").get_object(Bucket=bucket, Key="k")["Body"].read() == b"\x00" * 3_000_000
        with pytest.raises(ClientError, match="InvalidAccessKeyId"):
            client("testing").get_object(Bucket=bucket, Key="k")
        assert proxy.accepted == 2 and proxy.refused == ["testing"]
    finally:
        proxy.close()


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_api")
@pytest.mark.timeout(600)
def test_a_run_on_a_secret_store_block_leaks_the_secret_nowhere(secret_run):
    """A whole run whose store is a saved block with an AWS key pair: the S3 endpoint takes
    no other key, so the run worked through the block's credentials; and neither the secret
    nor the key id is in any of the run's logs (read at INFO), artifacts, run parameters,
    stored objects (binary too), worker log files or environments, or this process's."""
    summary, evidence = secret_run()
    assert summary.status == "completed" and summary.total_cost_usd > 0
    # the block's key signed every request (the run could not have worked otherwise)
    assert secret_run.proxy.accepted > 0 and secret_run.proxy.refused == []
    # what was read is this run's own, at INFO
    assert "20" in evidence["levels"].decode().split(","), evidence["levels"]
    assert any(summary.run_id.encode() in v for k, v in evidence.items() if k.startswith(("log", "artifact")))
    assert any(k.startswith("object ") and not k.endswith(".json") for k in evidence)  # binary objects too
    assert len(secret_run.worker_envs) >= 2 and any(k.startswith("worker file") for k in evidence)
    assert find_leaks(evidence, secret_run.secrets) == []


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_api")
@pytest.mark.timeout(600)
def test_the_leak_check_catches_planted_leaks(secret_run, monkeypatch):
    """The same run with three leaks planted: an INFO line in the flow run's log, the key
    inside a binary object of the run, and the secret in the workers' environment. The
    check names each of them."""
    import coordinator.workers.launchers
    import flows.train

    def plant(secret, key_id):
        real_guardrail, real_init = flows.train.guardrail, coordinator.workers.launchers.InlineLauncher.__init__

        def guardrail(job, ctx, plan, history):
            from prefect import get_run_logger

            from blocks.store_refs import ZooidStore

            get_run_logger().info("connecting with %s", secret)
            store = ZooidStore.load("secret-run-store").open()
            try:
                store.put(f"runs/{ctx.run_id}/planted/blob.bin", b"\x00\x89PNG\xff" + key_id.encode() + b"\x00\x01")
            finally:
                store.close()
            return real_guardrail(job, ctx, plan, history)

        def launcher_init(self, run_id, log_dir, env=None, forks=None):
            real_init(self, run_id, log_dir, env={**(env or {}), "ZOOID_PLANTED": secret}, forks=forks)

        monkeypatch.setattr(flows.train, "guardrail", guardrail)
        monkeypatch.setattr(coordinator.workers.launchers.InlineLauncher, "__init__", launcher_init)

    summary, evidence = secret_run(plant)
    assert summary.status == "completed"
    leaks = find_leaks(evidence, secret_run.secrets)
    assert any(k.startswith("log ") and "(20)" in k for k in leaks), leaks
    assert any(k.startswith("object ") and k.endswith("/planted/blob.bin") for k in leaks), leaks
    assert any(k.startswith("worker ") and k.endswith(" environment") for k in leaks), leaks
    assert "coordinator environment" not in leaks
