"""Cloud store blocks: URLs and worker environments carry no secret; the stores open and work."""
from __future__ import annotations

import json
import os

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

    from blocks.store import ZooidStore

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


@pytest.mark.usefixtures("prefect_api")
def test_a_run_on_a_secret_store_block_leaks_the_secret_nowhere(s3_server, tmp_path, monkeypatch):
    """A whole run whose store is a saved block with an AWS secret key: the secret reaches no
    environment (the coordinator's, a worker's), no flow or task log, no artifact, no worker
    log file and nothing the run wrote to its store; the run worked through the block."""
    import asyncio

    from pydantic import SecretStr

    from blocks.store import ZooidStore
    from comm.store_dir import zooid_home
    from flows.train import train
    from tasks.job import TrainJob

    secret, key_id = "s3cr3t-Zooid-9f31c", "AKIAZOOIDRUN"
    monkeypatch.setenv("ZOOID_HOME", str(tmp_path / "home"))
    bucket = s3_server.create_bucket("zooid-secret-run")
    ZooidStore(url=f"s3://{bucket}/runs", aws_access_key_id=key_id, aws_secret_access_key=SecretStr(secret),
               region_name="us-east-1", endpoint_url=s3_server.endpoint).save("secret-run-store", overwrite=True)
    summary = train(TrainJob(workers=2, epochs=1, batch_size=64, store="secret-run-store", warm=False))
    assert summary.status == "completed" and summary.total_cost_usd > 0

    async def logs_and_artifacts() -> str:
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import LogFilter

        async with get_client() as client:
            logs = await client.read_logs(log_filter=LogFilter(), limit=200)
            artifacts = await client.read_artifacts(limit=200)
            runs = await client.read_flow_runs(limit=200)
        return "\n".join([l.message for l in logs] + [json.dumps(a.data, default=str) + str(a.description)
                                                      for a in artifacts] + [json.dumps(r.parameters) for r in runs])

    seen = asyncio.run(logs_and_artifacts())
    assert summary.run_id in seen  # the logs and artifacts of this run were read
    files = [p.read_text(errors="replace") for p in (zooid_home() / "logs" / summary.run_id).glob("*.log")]
    assert files  # the workers' own logs
    s3 = s3_server.client()
    written = [s3.get_object(Bucket=bucket, Key=o["Key"])["Body"].read().decode(errors="replace")
               for o in s3.list_objects_v2(Bucket=bucket).get("Contents", []) if o["Key"].endswith(".json")]
    assert written  # the ledger, history and summary
    for text in [seen, *files, *written, *os.environ.values()]:
        assert secret not in text and key_id not in text
