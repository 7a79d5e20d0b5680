"""Every store client counts its requests by kind with the bytes they moved (`Store.ops`,
issue #45), and the counts equal the store's own: moto's request recording and Azurite's
access log, request for request, a waiting get's misses and a multipart upload included."""
from __future__ import annotations

import dataclasses
import threading

import pytest

from comm.store_base import process_ops, store_where
from comm.store_dir import DirectoryStore
from core.store_ops import StoreOps, grouped_json, grouped_total, total
from tests.store_logs import LoggingAzurite, RecordingS3


def _workload(store, big: int, wait: bool = True) -> None:
    """Every operation of the Store interface once or more: a small and a `big` put, reads, a
    miss, a get that waits for a peer's put (`wait`: and misses until it lands, as often as it
    happens to), a head, a listing, deletes."""
    store.put("runs/r/a", b"x" * 100)
    store.put("runs/r/big", b"y" * big)
    assert store.get("runs/r/a") == b"x" * 100
    assert len(store.get("runs/r/big")) == big
    with pytest.raises(KeyError):
        store.get("runs/r/absent")
    assert store.exists("runs/r/a") and not store.exists("runs/r/none")
    landed = threading.Event()

    def later():
        landed.wait(5)
        store.put("runs/r/late", b"z" * 10, scratch=True)

    peer = threading.Thread(target=later)
    peer.start()
    store.poll_first_s = 0.01
    for _ in range(3):  # at least three misses before the peer writes
        with pytest.raises(KeyError):
            store.get("runs/r/late")
    landed.set()
    if not wait:
        peer.join()
    assert store.get("runs/r/late", timeout=10) == b"z" * 10
    peer.join()
    assert store.list("runs/r/") == ["runs/r/a", "runs/r/big", "runs/r/late"]
    store.delete("runs/r/a")
    assert store.delete_prefix("runs/r/") == 2


def _requests(ops: StoreOps) -> StoreOps:
    """The request counts alone, a miss as the GET it is (the logs count requests, not bytes)."""
    return dataclasses.replace(ops, get=ops.get + ops.miss, miss=0, bytes_in=0, bytes_out=0)


def test_store_ops_add_and_subtract_by_field():
    a = StoreOps(put=2, get=3, bytes_in=10)
    b = StoreOps(get=1, list=1, delete=4, bytes_out=7)
    assert a + b == StoreOps(put=2, get=4, list=1, delete=4, bytes_in=10, bytes_out=7)
    assert (a + b) - b == a
    assert (a + b).requests == 11 and StoreOps(get=2, miss=3).requests == 5
    assert StoreOps.from_dict((a + b).to_dict()) == a + b
    assert total([a, b.to_dict()]) == a + b
    assert not StoreOps() and StoreOps.from_dict(None) == StoreOps()


def test_directory_store_counts_every_operation(tmp_path):
    before = process_ops()
    store = DirectoryStore(tmp_path / "s")
    _workload(store, big=5000, wait=False)
    ops = store.ops
    # 3 puts (a, big, the peer's late); gets: a, big, the late one at once (the peer wrote
    # first); misses: the absent key, and three of the late one before the peer wrote
    assert (ops.put, ops.head, ops.list, ops.delete) == (3, 2, 2, 1 + 2)
    assert ops.get == 2 + 1 and ops.miss == 1 + 3
    assert ops.bytes_in == 100 + 5000 + 10 and ops.bytes_out == 100 + 5000 + 10
    assert process_ops()["file://"] - before.get("file://", StoreOps()) == ops  # the process's total
    assert store.where == "file://"


def test_where_names_a_store_without_path_or_credentials():
    assert store_where("s3://bucket/runs/x?endpoint=http://127.0.0.1:9000") == "s3://bucket"
    assert store_where("redis://:secret@10.0.0.5:6380/0") == "redis://10.0.0.5:6380"
    assert store_where("/tmp/store") == store_where("file:///var/store") == "file://"
    assert store_where("az://container/prefix") == "az://container"
    assert grouped_total([{"file://": StoreOps(put=1)}, {"file://": {"put": 2}, "s3://b": {"get": 1}}]) == {
        "file://": StoreOps(put=3), "s3://b": StoreOps(get=1)}
    assert grouped_json({"s3://b": StoreOps(), "file://": StoreOps(put=1)}) == {"file://": StoreOps(put=1).to_dict()}


@pytest.fixture(scope="module")
def recording_s3(tmp_path_factory):
    server = RecordingS3(tmp_path_factory.mktemp("moto"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_s3_counts_equal_moto_recording(recording_s3):
    from comm.store_s3 import S3Store

    bucket = recording_s3.create_bucket("zooid-bill")
    recording_s3.reset()
    store = S3Store(bucket, "pre", endpoint=recording_s3.endpoint, multipart_threshold=5 * 1024 * 1024)
    big = 17 * 1024 * 1024  # multipart: create, two 16 MiB parts (the second short), complete
    _workload(store, big=big)
    ops = store.ops
    assert _requests(ops) == recording_s3.ops(bucket)
    assert ops.put == 2 + (2 + 2) and ops.list == 2 and ops.delete == 1 + 1
    assert ops.bytes_in == 100 + big + 10


def test_s3_list_pages_counted(recording_s3):
    from comm.store_s3 import S3Store

    bucket = recording_s3.create_bucket("zooid-pages")
    store = S3Store(bucket, "", endpoint=recording_s3.endpoint)
    for i in range(1001):  # two pages
        store.put(f"runs/p/{i:05d}", b"")
    recording_s3.reset()
    before = store.ops
    assert len(store.list("runs/p/")) == 1001
    assert store.delete_prefix("runs/p/") == 1001
    assert _requests(store.ops - before) == StoreOps(list=2 + 2, delete=2) == recording_s3.ops(bucket)


@pytest.fixture(scope="module")
def logging_azurite(tmp_path_factory):
    server = LoggingAzurite(tmp_path_factory.mktemp("azurite-log"))
    try:
        server.start()
    except FileNotFoundError:
        pytest.skip("Azurite is not installed (make azurite)")
    try:
        yield server
    finally:
        server.stop()


def test_azure_counts_equal_azurite_access_log(logging_azurite):
    from comm.store_azure import AzureBlobStore

    container = logging_azurite.create_container("zooid-bill")
    logging_azurite.reset()
    store = AzureBlobStore(container, "pre", connection_string=logging_azurite.connection_string(),
                           single_put_bytes=4 * 1024 * 1024)
    big = 9 * 1024 * 1024  # staged: two 8 MiB blocks and the block list; read back in one GET
    _workload(store, big=big)
    ops = store.ops
    assert _requests(ops) == logging_azurite.ops(container)
    assert ops.put == 2 + (2 + 1) and ops.list == 2 and ops.delete == 1 + 1
