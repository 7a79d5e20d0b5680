"""Store throughput: Zooid's stores next to the bare medium, measured in one run.

For 1 MB and 100 MB float32 tensors, times put and get through each store (directory,
Redis, S3 on moto, Azure Blob on Azurite) three ways, all in the same process and run:

- raw: the medium with nothing of Zooid (shutil copying bytes to and from a file; a bare
  redis-py SET/GET; a bare boto3 put_object/get_object; the Azure SDK's plain
  upload_blob/download_blob with its default settings),
- store: `Store.put` / `Store.get` of the same bytes (key checks, atomic write, chunking,
  multipart, accounting),
- store+codec: `encode_tensors` + put, and get + `decode_tensors` (what a worker does).

It starts its own redis-server, moto server and Azurite (`make azurite`) on free 127.0.0.1
ports and stops them. Writes a markdown table, the command and the commit measured to
`benchmarks/results/stores.md`.

    .venv/bin/python -m benchmarks.bench_stores [--repeats-small 50] [--repeats-large 3]
"""
from __future__ import annotations

import argparse
import io
import os
import shutil
import sys
from pathlib import Path

import torch

from benchmarks.harness.home import REPO, scratch
from benchmarks.harness.servers import moto_server, redis_server, start_server, stop_server
from benchmarks.harness.tables import median, rounds, table
from benchmarks.output import command_for, provenance, write_result
from comm.store import Store
from comm.store_azure import AzureBlobStore
from comm.store_dir import DirectoryStore
from comm.store_redis import RedisStore
from comm.store_s3 import S3Store
from comm.tensor_codec import decode_tensors, encode_tensors
from core.keys import run_key, run_prefix
from deployments.server import free_port

MB = 1_000_000
RESULTS = REPO / "benchmarks" / "results" / "stores.md"
SOURCES = ("comm", "core/errors.py", "core/keys.py", "core/object_requests.py", "core/polling.py", "core/process_start.py", "core/store_ops.py",
           "deployments/server.py", "deployments/prefect_db.py", "requirements.lock",
           "benchmarks/harness/servers.py", "benchmarks/harness/tables.py")
"""The code it measures (the stores against their servers): its results file is stale once one of these
changed since the commit the file names (`benchmarks.staleness`)."""
AZURITE = REPO / ".azurite" / "node_modules" / ".bin" / "azurite-blob"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


# --- measurements ------------------------------------------------------------------------

def raw_ops(medium: str, handle, data: bytes):
    """(put, get) closures that use the medium directly, with nothing of Zooid."""
    if medium == "directory":
        path = Path(handle) / "raw.bin"

        def put():
            with open(path, "wb") as f:
                shutil.copyfileobj(io.BytesIO(data), f, length=16 * 1024 * 1024)

        def get():
            out = io.BytesIO()
            with open(path, "rb") as f:
                shutil.copyfileobj(f, out, length=16 * 1024 * 1024)
            return out.getvalue()
    elif medium == "redis":
        def put():
            handle.set("raw", data)

        def get():
            return handle.get("raw")
    elif medium == "s3":
        client, bucket = handle

        def put():
            client.put_object(Bucket=bucket, Key="raw", Body=data)

        def get():
            return client.get_object(Bucket=bucket, Key="raw")["Body"].read()
    else:
        def put():
            handle.upload_blob("raw", data, overwrite=True)

        def get():
            return handle.download_blob("raw").readall()
    return put, get


def measure(medium: str, store: Store, raw_handle, size: int, repeats: int) -> dict:
    """Seconds per put and get: raw medium, store bytes, store with tensor codec."""
    tensor = torch.randn(size // 4)
    data = tensor.numpy().tobytes()
    raw_put, raw_get = raw_ops(medium, raw_handle, data)
    key = run_key("bench", str(size))
    # round-robin after a warm-up round (harness.tables.rounds), so a burst of load hits raw and store alike
    row = {name: median(t) for name, t in rounds({
        "raw_put": raw_put,
        "raw_get": raw_get,
        "store_put": lambda: store.put(key, data),
        "store_get": lambda: store.get(key),
        "codec_put": lambda: store.put(key, encode_tensors({"t": tensor})),
        "codec_get": lambda: decode_tensors(store.get(key)),
    }, repeats, warm_up=True).items()}
    assert torch.equal(decode_tensors(store.get(key))[0]["t"], tensor)
    store.delete_prefix(run_prefix("bench") + "/")
    return row


def throughput_table(rows: list[tuple[str, int, dict]]) -> str:
    """Markdown table of throughputs (MB/s) and ratios to the raw medium."""
    lines = table(["store", "size", "op", "raw MB/s", "store MB/s", "store / raw", "store+codec MB/s",
                   "store+codec / raw"])
    for medium, size, r in rows:
        for op in ("put", "get"):
            raw, st, co = (size / MB / r[f"{k}_{op}"] for k in ("raw", "store", "codec"))
            lines.append(f"| {medium} | {size // MB} MB | {op} | {raw:,.0f} | {st:,.0f} | "
                         f"{st / raw:.2f} | {co:,.0f} | {co / raw:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark and write benchmarks/results/stores.md."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats-small", type=int, default=50, help="repeats for 1 MB")
    parser.add_argument("--repeats-large", type=int, default=3, help="repeats for 100 MB")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    prov = provenance()

    import boto3
    import redis
    from azure.storage.blob import BlobServiceClient

    servers = []
    with scratch("stores") as work:
        try:
            redis_proc, redis_url = redis_server(work)
            servers.append(redis_proc)
            moto, endpoint = moto_server(work)
            servers.append(moto)
            s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
            azurite_port = free_port(0)
            servers.append(start_server([str(AZURITE), "--blobHost", "127.0.0.1", "--blobPort", str(azurite_port),
                                         "--location", str(work / "azurite"), "--skipApiVersionCheck",
                                         "--disableTelemetry", "--silent"], azurite_port, work / "azurite.log"))
            azure = (f"DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey={AZURITE_KEY};"
                     f"BlobEndpoint=http://127.0.0.1:{azurite_port}/devstoreaccount1;")
            container = BlobServiceClient.from_connection_string(azure).create_container("bench")
            media = [
                ("directory", DirectoryStore(work / "store"), work),
                ("redis", RedisStore(redis_url), redis.Redis.from_url(redis_url, socket_timeout=120)),
                ("s3 (moto)", S3Store("bench", "zooid", endpoint=endpoint), (s3, "bench")),
                ("azure blob (Azurite)", AzureBlobStore("bench", "zooid", connection_string=azure), container),
            ]
            rows = []
            for size, repeats in ((1 * MB, args.repeats_small), (100 * MB, args.repeats_large)):
                for medium, store, handle in media:
                    kind = medium.split()[0]
                    print(f"{medium} {size // MB} MB ...", file=sys.stderr, flush=True)
                    rows.append((medium, size, measure(kind, store, handle, size, repeats)))
        finally:
            for proc in servers:
                stop_server(proc)

    command = command_for("benchmarks.bench_stores", argv)
    text = "\n".join([
        f"Median of {args.repeats_small} (1 MB) / {args.repeats_large} (100 MB) interleaved "
        f"rounds after a warm-up, float32 tensors, all servers on 127.0.0.1 ({os.cpu_count()} cores, shared). "
        "raw = the medium alone (shutil file copy; bare redis-py SET/GET; bare boto3 "
        "put_object/get_object); store = `Store.put`/`get` of the same bytes; store+codec "
        "adds `encode_tensors`/`decode_tensors` (safetensors). The directory store fsyncs "
        "every durable put (the raw copy does not; scratch puts of activations and sync rounds "
        "skip it); the raw directory get copies twice (into a BytesIO, then out of it), the "
        "store reads once. S3 puts of 64 MB and more go multipart; Azure Blob puts of 64 MiB and more "
        "go as 8 MiB blocks staged 4 at a time and committed at once, its gets of more than 32 MiB in "
        "8 MiB ranges 4 at a time (the raw SDK calls: 4 MiB blocks, one at a time).",
        "",
        throughput_table(rows),
        "",
    ])
    write_result(args.out, "Store throughput: Zooid's stores next to the bare medium", command, prov, text,
                 detail="all servers on 127.0.0.1", echo=True)


if __name__ == "__main__":
    main()
