"""The direct ring allreduce: exact means across processes, Local-SGD equal to the store
collective, and failures that raise instead of hanging."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from comm.bandwidth import TransferStats
from comm.ring_allreduce import RingError, RingTimeout, open_ring, ring_address_key, ring_bytes
from comm.scatter_reduce import allreduce_for
from comm.store_dir import DirectoryStore
from comm.tensor_codec import decode_tensors, encode_tensors
from core.errors import StoreTimeout, ZooidValueError
from core.specs import ComputeSpec, SyncSpec, WorkerResult, WorkerSpec
from engine.checkpoint import initial_checkpoint, load_checkpoint
from engine.datasets import publish_dataset
from engine.local_sgd_epoch import run_local_sgd_epoch
from engine.models import build_model
from engine.optimizers import build_optimizer
from tests.conftest import free_port, stop_process_group
from tests.forked_workers import start_worker

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
# Uneven on purpose: no size divides evenly by 3, two dtypes, a 0-d tensor.
SHAPES = {"a": (3, 5), "b": (7,), "c": (1,), "d": (2, 3, 4), "e": ()}
WORLDS = (1, 2, 3, 4)


def rank_tensors(rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s inputs: float64 tensors of SHAPES plus one float32 tensor."""
    g = torch.Generator().manual_seed(100 + rank)
    out = {k: torch.randn(s, generator=g, dtype=torch.float64) for k, s in SHAPES.items()}
    out["f32"] = torch.randn(11, generator=g, dtype=torch.float32)
    return out


def mean_rank_main(store_dir: str, rank: int) -> None:
    """One process: join the rings of every world in WORLDS that has this rank, one after
    the other, and post each mean and its byte count to the store."""
    store = DirectoryStore(store_dir)
    for world in WORLDS:
        if rank >= world:
            continue
        stats = TransferStats()
        with open_ring(store, f"runs/t/sync/w{world}", rank, world, timeout=30) as ring:
            out = ring.allreduce_mean(rank_tensors(rank), stats=stats)
        store.put(f"runs/t/out/w{world}/r{rank}", encode_tensors(out))
        store.put(f"runs/t/out/w{world}/stats{rank}", json.dumps([stats.bytes_up, stats.bytes_down, stats.calls]).encode())


def start_python(code: str, log: Path) -> subprocess.Popen:
    """`python -c code` in the repository root, in its own process group, output to `log`."""
    with open(log, "wb") as out:
        return subprocess.Popen([PYTHON, "-c", code], cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def wait_all(procs: list[subprocess.Popen], logs: list[Path], timeout: float) -> None:
    """Wait for every process; stop the rest and fail with its log if one fails or hangs."""
    deadline = time.monotonic() + timeout
    try:
        for proc, log in zip(procs, logs):
            try:
                rc = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{log.name} still running after {timeout}s:\n{log.read_text()[-3000:]}")
            assert rc == 0, f"{log.name} exited {rc}:\n{log.read_text()[-3000:]}"
    finally:
        for proc in procs:
            stop_process_group(proc)


def test_ring_mean_equals_stacked_mean_for_worlds_1_to_4(tmp_path):
    store = DirectoryStore(tmp_path / "store")
    logs = [tmp_path / f"rank{r}.log" for r in range(max(WORLDS))]
    procs = [start_python(f"from tests.test_ring_allreduce import mean_rank_main; "
                          f"mean_rank_main({str(store.root)!r}, {r})", logs[r]) for r in range(max(WORLDS))]
    wait_all(procs, logs, timeout=60)
    for world in WORLDS:
        inputs = [rank_tensors(r) for r in range(world)]
        outs = [decode_tensors(store.get(f"runs/t/out/w{world}/r{r}"))[0] for r in range(world)]
        for name in inputs[0]:
            expected = torch.stack([t[name] for t in inputs]).mean(0)
            tol = 1e-14 if expected.dtype == torch.float64 else 1e-6
            for out in outs:
                assert out[name].dtype == expected.dtype and out[name].shape == expected.shape
                torch.testing.assert_close(out[name], expected, rtol=tol, atol=tol)
                # The ring reduces each chunk on one rank and passes it on: every rank
                # ends with the same bits, so the replicas cannot drift apart.
                assert torch.equal(out[name], outs[0][name])
        # Ring traffic per rank: 2 (n - 1) / n of each dtype's buffer, each way.
        f64 = 8 * sum(torch.Size(s).numel() for s in SHAPES.values())
        expected_bytes = ring_bytes(f64, world) + ring_bytes(4 * 11, world)
        for r in range(world):
            up, down, calls = json.loads(store.get(f"runs/t/out/w{world}/stats{r}"))
            assert (up, down) == (expected_bytes, expected_bytes)
            assert calls == (0 if world == 1 else 1)
    assert ring_bytes(1000, 4) == 1500 and ring_bytes(1000, 1) == 0


RING_DATA = "synthetic:64:10:80:16"
"""An epoch of 5 steps for 2 replicas of 8 rows."""


def local_sgd_fields(run_id: str, sync: SyncSpec) -> dict:
    return dict(run_id=run_id, epoch=0, world=2, model="digits_mlp", dataset=RING_DATA, steps=5,
                batch_size=8, lr=0.2, optimizer="sgd", sync_period=1, seed=1,
                init_key=f"runs/{run_id}/ckpt/init", out_key=f"runs/{run_id}/ckpt/e0",
                evaluate=False, sync_timeout_s=60.0, compute=ComputeSpec(dtype="float64"), sync=sync)


def test_local_sgd_with_ring_equals_local_sgd_with_store_collective(tmp_path):
    store = DirectoryStore(tmp_path / "store")
    for run_id in ("plain", "ring"):
        publish_dataset(store, run_id, RING_DATA, subset_size=16)
        initial_checkpoint(store, f"runs/{run_id}/ckpt/init", "digits_mlp", "sgd", lr=0.2, seed=1)

    # The store collective: replicas as threads in this process.
    plain = [WorkerSpec(rank=r, store_url=store.url, **local_sgd_fields("plain", SyncSpec()))
             for r in range(2)]
    threads = [threading.Thread(target=run_local_sgd_epoch, args=(s, store)) for s in plain]
    [t.start() for t in threads]
    [t.join(timeout=60) for t in threads]

    # The ring: replicas as worker processes, as the inline target starts them.
    ring_specs = [WorkerSpec(rank=r, store_url=store.url,
                             **local_sgd_fields("ring", SyncSpec(collective="ring"))) for r in range(2)]
    logs = [tmp_path / f"worker{r}.log" for r in range(2)]
    procs = [start_worker(spec, {**os.environ, "OMP_NUM_THREADS": "1"}, log) for spec, log in zip(ring_specs, logs)]
    wait_all(procs, logs, timeout=60)
    results = [WorkerResult.from_dict(json.loads(log.read_text().strip().splitlines()[-1])) for log in logs]

    weights = {}
    for run_id in ("plain", "ring"):
        model = build_model("digits_mlp", 1).double()
        load_checkpoint(store, f"runs/{run_id}/ckpt/e0", model, build_optimizer("sgd", model, 0.2))
        weights[run_id] = model.state_dict()
    start = build_model("digits_mlp", 1).double()
    load_checkpoint(store, "runs/ring/ckpt/init", start, build_optimizer("sgd", start, 0.2))
    for name, w in weights["plain"].items():
        assert weights["ring"][name].dtype == torch.float64
        torch.testing.assert_close(weights["ring"][name], w, rtol=1e-12, atol=1e-12)
        assert not torch.equal(w, start.state_dict()[name])  # it trained
    # Five syncs of the whole model, each moving 2 (n - 1) / n = 1 model each way.
    model_bytes = sum(p.numel() * 8 for p in start.parameters())
    assert [r.bytes_synced for r in results] == [2 * 5 * ring_bytes(model_bytes, 2)] * 2
    # Nothing left in the store: no sync keys, and the rendezvous address is gone.
    assert store.list("runs/ring/sync/") == [] and store.list("runs/plain/sync/") == []


@pytest.mark.timeout(120)
def test_missing_peer_times_out_with_a_clear_error(tmp_path):
    store = DirectoryStore(tmp_path / "store")
    with pytest.raises(RingTimeout, match="rank 0 of 2: ring rendezvous of runs/t/sync/e0 timed out"):
        open_ring(store, "runs/t/sync/e0", 0, 2, timeout=1.5)
    with pytest.raises(RingTimeout, match="runs/t/sync/e1/ring/addr; rank 0 of the ring is missing"):
        open_ring(store, "runs/t/sync/e1", 1, 2, timeout=0.5)
    assert issubclass(RingTimeout, StoreTimeout)  # exit status 3, retried by the coordinator


@pytest.mark.timeout(120)
def test_stale_address_is_skipped_until_rank_0_publishes(tmp_path, monkeypatch):
    """Rank 1 finds an earlier attempt's address, is refused, and reads the key again; rank 0
    opens its ring only after that refusal (an event), and the two meet on the new address."""
    import socket

    store = DirectoryStore(tmp_path / "store")
    group = "runs/t/sync/e0"
    stale_port = free_port()  # an earlier attempt's rank 0, long gone: nothing listens on it
    store.put(ring_address_key(group), json.dumps({"host": "127.0.0.1", "port": stale_port, "nonce": "old"}).encode())
    tries, refused, real_connect = [], threading.Event(), socket.create_connection

    def connect(address, *args, **kwargs):  # rank 1's plain connect before the TCPStore
        try:
            conn = real_connect(address, *args, **kwargs)
        except OSError:
            tries.append((address[1], "refused"))
            refused.set()
            raise
        tries.append((address[1], "connected"))
        return conn

    monkeypatch.setattr(socket, "create_connection", connect)
    results = {}

    def rank(r: int) -> None:
        if r == 0:
            assert refused.wait(60)  # rank 1 has met the stale address first
        with open_ring(store, group, r, 2, timeout=30) as ring:
            results[r] = ring.allreduce_mean({"x": torch.full((3,), float(r), dtype=torch.float64)})["x"]

    threads = [threading.Thread(target=rank, args=(r,)) for r in (1, 0)]
    [t.start() for t in threads]
    [t.join(timeout=90) for t in threads]
    assert [results[r].tolist() for r in (0, 1)] == [[0.5] * 3] * 2
    # The stale address was tried and refused (once or more) before the fresh one connected.
    assert tries[0] == (stale_port, "refused") and {t for t in tries if t[1] == "connected"}
    fresh = {port for port, outcome in tries if outcome == "connected"}
    assert stale_port not in fresh and tries[-1][1] == "connected"


@pytest.mark.timeout(180)
def test_a_peer_that_dies_fails_the_survivor_fast_instead_of_hanging(tmp_path):
    """The survivor's collective may wait 600 s; it fails at once with the peer's death (a
    RingError naming it, not the RingTimeout the wait would end in), well inside the test's
    timeout guard."""
    store = DirectoryStore(tmp_path / "store")
    group = "runs/t/sync/e0"
    log = tmp_path / "peer.log"
    # The peer joins the ring, then dies before the first sync.
    peer = start_python("import os; from comm.ring_allreduce import open_ring; "
                        "from comm.store_dir import DirectoryStore; "
                        f"open_ring(DirectoryStore({str(store.root)!r}), {group!r}, 1, 2, timeout=30); "
                        "os._exit(1)", log)
    try:
        ring = open_ring(store, group, 0, 2, timeout=60)
        assert peer.wait(timeout=30) == 1, log.read_text()
        with pytest.raises(RingError, match="rank 0 of 2: ring allreduce of runs/t/sync/e0 failed") as failure:
            ring.allreduce_mean({"x": torch.ones(1000, dtype=torch.float64)}, timeout=600)
        assert not isinstance(failure.value, RingTimeout), "the survivor waited for the timeout instead of failing"
        assert "a peer died or became unreachable" in str(failure.value)
        assert "epoch attempt fails" in str(failure.value)
        with pytest.raises(RingError, match="open a new one"):  # a broken ring stays broken
            ring.allreduce_mean({"x": torch.ones(3, dtype=torch.float64)})
    finally:
        stop_process_group(peer)


def test_store_signature_and_bad_settings(tmp_path):
    store = DirectoryStore(tmp_path / "store")
    with pytest.raises(ZooidValueError, match="ring: sync 'ring' needs the open RingGroup"):
        allreduce_for("ring", "mean")
    with pytest.raises(ZooidValueError, match="sync: unknown algorithm 'tree'"):
        allreduce_for("tree", "mean")
    with open_ring(store, "runs/t/sync/e0", 0, 1, timeout=1) as ring:
        assert ring.backend_name == "none"
        fn = allreduce_for("ring", "sum", ring=ring)
        x = {"x": torch.arange(3.0)}
        assert fn(store, "ignored", 0, 1, x, 1.0) is x  # a ring of one moves nothing
        with pytest.raises(ZooidValueError, match="rank: the ring was opened as rank 0 of 1"):
            fn(store, "ignored", 1, 2, x, 1.0)
    with pytest.raises(ZooidValueError, match="rank: must be in 0..1"):
        open_ring(store, "runs/t/sync/e0", 2, 2, timeout=1)
    with pytest.raises(ZooidValueError, match="timeout: must be seconds > 0"):
        open_ring(store, "runs/t/sync/e0", 0, 2, timeout=0)
    spec = WorkerSpec(rank=0, store_url=store.url,
                      **local_sgd_fields("bad", SyncSpec(collective="mpi")))
    with pytest.raises(ZooidValueError, match="sync.collective"):
        run_local_sgd_epoch(spec, store)
    for bad, field in (({"ring_host": 7}, "sync.ring_host"), ({"ring_timeout_s": -1}, "sync.ring_timeout_s")):
        with pytest.raises(ZooidValueError, match=field):
            SyncSpec(**bad)


@pytest.mark.gpu
def test_nccl_ring_mean_on_two_gpus(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs one GPU per rank; this machine has fewer than 2")
    store = DirectoryStore(tmp_path / "store")
    outs = {}

    def rank(r: int) -> None:
        with open_ring(store, "runs/t/sync/e0", r, 2, timeout=60, device=f"cuda:{r}") as ring:
            assert ring.backend_name == "nccl"
            tensors = {k: v.to(f"cuda:{r}") for k, v in rank_tensors(r).items()}
            outs[r] = {k: v.cpu() for k, v in ring.allreduce_mean(tensors).items()}

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    [t.start() for t in threads]
    [t.join(timeout=120) for t in threads]
    inputs = [rank_tensors(r) for r in range(2)]
    for name in inputs[0]:
        expected = torch.stack([t[name] for t in inputs]).mean(0)
        for r in range(2):
            torch.testing.assert_close(outs[r][name], expected)


@pytest.mark.timeout(120)
def test_a_peer_that_stops_calling_times_out(tmp_path, monkeypatch):
    import comm.socket_ring as transport

    store = DirectoryStore(tmp_path / "store")
    group, joined, done = "runs/t/sync/e0", threading.Event(), threading.Event()
    limits, real_allreduce = [], transport.allreduce_sum

    def allreduce_sum(links, rank, world, buf, deadline):  # the deadline the transport is given
        limits.append(deadline - time.monotonic())
        return real_allreduce(links, rank, world, buf, deadline)

    def idle_peer() -> None:  # alive and connected, but never reaches the collective
        with open_ring(store, group, 1, 2, timeout=30):
            joined.set()
            done.wait(60)

    peer = threading.Thread(target=idle_peer)
    peer.start()
    try:
        ring = open_ring(store, group, 0, 2, timeout=30)
        assert joined.wait(30) and ring.backend_name == "tcp"
        monkeypatch.setattr(transport, "allreduce_sum", allreduce_sum)
        with pytest.raises(RingTimeout, match="a peer did not reach the collective within 1.5s"):
            ring.allreduce_mean({"x": torch.ones(10, dtype=torch.float64)}, timeout=1.5)
        # the call's own timeout bounded the wait, not the ring's 30 s
        assert len(limits) == 1 and 0 < limits[0] <= 1.5
        with pytest.raises(RingError, match="timed out; open a new one"):
            ring.allreduce_mean({"x": torch.ones(3, dtype=torch.float64)})
    finally:
        done.set()
        peer.join(30)


def test_buckets_started_in_the_background_keep_their_order(tmp_path):
    """Calls started without waiting run on the ring's thread in the order started, a call
    run `now` waits for them first, and every mean is exact: three calls of different sizes
    per rank, the last run now."""
    store = DirectoryStore(tmp_path / "store")
    sizes, outs = (5, 70_001, 3), {}

    def rank(r: int) -> None:
        with open_ring(store, "runs/t/sync/e0", r, 2, timeout=30) as ring:
            calls = [ring.start_allreduce_mean({"x": torch.full((n,), float(r + k), dtype=torch.float64)},
                                               now=k == len(sizes) - 1) for k, n in enumerate(sizes)]
            outs[r] = [c.wait()["x"] for c in calls]

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    [t.start() for t in threads]
    [t.join(timeout=60) for t in threads]
    for r in range(2):
        assert [o.tolist() for o in outs[r]] == [[k + 0.5] * n for k, n in enumerate(sizes)]
