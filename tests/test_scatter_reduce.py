"""Pipelined and plain scatter-reduce through real stores: directory, redis-server, moto S3.

Ranks are threads, each with its own store client, as separate workers would be.
"""
from __future__ import annotations

import threading
import uuid

import pytest
import torch

from comm.bandwidth import TransferStats
from comm.collectives import release_group
from comm.scatter_reduce import allreduce_for, pipelined_allreduce_mean, pipelined_allreduce_sum, plain_allreduce_mean
from comm.store import open_store
from core.errors import StoreTimeout, ZooidValueError


@pytest.fixture(params=["dir", "redis", "s3"])
def store_url(request, tmp_path, monkeypatch):
    """A URL of a fresh store of each kind; every rank opens its own client on it."""
    if request.param == "dir":
        return (tmp_path / "store").as_uri()
    if request.param == "redis":
        return request.getfixturevalue("redis_server").url
    s3 = request.getfixturevalue("s3_server")
    monkeypatch.setenv("ZOOID_S3_ENDPOINT", s3.endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)
    return f"s3://{s3.create_bucket('zooid-sr')}/t{uuid.uuid4().hex[:8]}"


def contributions(world: int) -> list[dict[str, torch.Tensor]]:
    """Per rank: uneven shapes, two dtypes, and a tensor with fewer elements than ranks."""
    g = torch.Generator().manual_seed(world)
    return [{"w": torch.randn(7, 3, generator=g, dtype=torch.float64),
             "b": torch.randn(5, generator=g, dtype=torch.float64),
             "tiny": torch.randn(1, generator=g, dtype=torch.float64),
             "h": torch.randn(11, generator=g).float()} for _ in range(world)]


def run_ranks(world: int, work) -> list:
    """Run `work(rank)` on `world` threads; return the results in rank order, re-raising."""
    results, errors = [None] * world, []

    def body(rank):
        try:
            results[rank] = work(rank)
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return results


def reduce_all(url: str, world: int, fn, prefix: str, data=None, **kw):
    data = data or contributions(world)

    def work(rank):
        store = open_store(url)
        try:
            return fn(store, prefix, rank, world, data[rank], 20.0, **kw)
        finally:
            store.close()

    return data, run_ranks(world, work)


@pytest.mark.parametrize("world", range(1, 9))
def test_pipelined_mean_equals_stacked_mean_on_every_store(store_url, world):
    data, outs = reduce_all(store_url, world, pipelined_allreduce_mean, f"runs/t/sync/m{world}")
    for name in data[0]:
        want = torch.stack([d[name] for d in data]).mean(0)
        for out in outs:
            assert out[name].dtype == want.dtype and out[name].shape == want.shape
            torch.testing.assert_close(out[name], want, rtol=1e-6 if name == "h" else 1e-12, atol=0)
            # Every rank holds the same bits, so replicas never drift apart.
            assert torch.equal(out[name], outs[0][name])


@pytest.mark.parametrize("world", [1, 3, 8])
def test_pipelined_sum_equals_stacked_sum(store_url, world):
    data, outs = reduce_all(store_url, world, pipelined_allreduce_sum, f"runs/t/sync/s{world}")
    for name in data[0]:
        want = torch.stack([d[name] for d in data]).sum(0)
        for out in outs:
            torch.testing.assert_close(out[name], want, rtol=1e-6 if name == "h" else 1e-12, atol=0)


@pytest.mark.parametrize("world", [3, 8])
def test_pipelined_and_plain_give_the_same_bits(tmp_path, world):
    url = (tmp_path / "store").as_uri()
    data = contributions(world)
    _, piped = reduce_all(url, world, pipelined_allreduce_mean, "runs/t/a", data)
    _, plain = reduce_all(url, world, plain_allreduce_mean, "runs/t/b", data)
    for a, b in zip(piped, plain):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_each_rank_uploads_one_model_size_and_downloads_2_n_minus_1_slices(tmp_path):
    """Up: n-1 pieces of others' slices plus the reduced own slice; down: n-1 pieces of
    the own slice plus n-1 reduced slices."""
    url, world = (tmp_path / "store").as_uri(), 4
    data = [{"x": torch.ones(4000, dtype=torch.float64) * r} for r in range(world)]
    stats = [TransferStats() for _ in range(world)]

    def work(rank):
        store = open_store(url)
        return pipelined_allreduce_mean(store, "runs/t/bytes", rank, world, data[rank], 20.0,
                                        stats=stats[rank])

    outs = run_ranks(world, work)
    assert torch.equal(outs[2]["x"], torch.full((4000,), 1.5, dtype=torch.float64))
    payload = 4000 * 8 // world  # one slice, without the small safetensors header
    for s in stats:
        assert s.calls == 1
        assert world * payload <= s.bytes_up <= world * (payload + 256)
        down = 2 * (world - 1)
        assert down * payload <= s.bytes_down <= down * (payload + 256)


def test_keys_are_cleaned_across_calls_and_by_release(tmp_path):
    url, world, group = (tmp_path / "store").as_uri(), 3, "runs/t/sync/stage0"

    def work(rank):
        store = open_store(url)
        previous = None
        for it in range(3):
            prefix = f"{group}/it{it}"
            pipelined_allreduce_mean(store, prefix, rank, world, {"g": torch.ones(10) * rank},
                                     20.0, previous_prefix=previous)
            previous = prefix
        release_group(store, group, rank, world, 20.0)

    run_ranks(world, work)
    assert open_store(url).list("runs/") == []


class ThreadClock:
    """`time` for the modules under test, one clock per thread (a rank): `sleep` moves the
    calling thread's clock, nothing really waits."""

    def __init__(self):
        self._local = threading.local()
        self.gate = None  # called before a sleep moves the clock: what must happen first

    def monotonic(self) -> float:
        return getattr(self._local, "now", 1000.0)

    perf_counter = monotonic

    def sleep(self, seconds: float) -> None:
        if self.gate is not None:
            self.gate()
        self._local.now = self.monotonic() + seconds


@pytest.fixture
def clock(monkeypatch) -> ThreadClock:
    import comm.bandwidth
    import comm.collectives
    import comm.scatter_reduce
    import comm.store_base

    fake = ThreadClock()
    for module in (comm.bandwidth, comm.collectives, comm.scatter_reduce, comm.store_base):
        monkeypatch.setattr(module, "time", fake)
    return fake


@pytest.mark.timeout(60)
def test_missing_peer_times_out_naming_the_key(tmp_path, clock):
    """Rank 2 of 3 never uploads: ranks 0 and 1 fail when their own 0.5 s are up (on a clock
    the test controls) instead of hanging."""
    url = (tmp_path / "store").as_uri()
    posted = [tmp_path / "store" / "runs/t/missing/part-1-0", tmp_path / "store" / "runs/t/missing/part-0-1"]

    def both_ranks_posted() -> None:  # no clock moves before ranks 0 and 1 have sent each other their parts
        while not all(p.exists() for p in posted):
            threading.Event().wait(0.005)

    clock.gate = both_ranks_posted

    def work(rank):
        store = open_store(url)
        began = clock.monotonic()
        with pytest.raises(StoreTimeout, match=r"runs/t/missing/part-\d-2"):
            pipelined_allreduce_mean(store, "runs/t/missing", rank, 3, {"g": torch.ones(6)}, 0.5)
        return clock.monotonic() - began

    # Each waited its 0.5 s for rank 2's part (rank 1 at most one first pause more, for rank 0's).
    assert run_ranks(2, work) == pytest.approx([0.5, 0.5], abs=0.005)


def test_bad_arguments_name_the_parameter(dir_store):
    with pytest.raises(ZooidValueError, match="rank"):
        pipelined_allreduce_mean(dir_store, "runs/t/x", 3, 2, {"g": torch.ones(2)}, 1.0)
    with pytest.raises(ZooidValueError, match="tensors"):
        pipelined_allreduce_mean(dir_store, "runs/t/x", 0, 2, {"g": torch.ones(2, dtype=torch.int64)}, 1.0)
    with pytest.raises(ZooidValueError, match="sync"):
        allreduce_for("ring")
    assert allreduce_for("pipelined", "sum") is pipelined_allreduce_sum


def test_a_relaunched_rank_replays_a_finished_call_from_the_posted_results(tmp_path, monkeypatch):
    """Rank 1 died after the call completed for everyone; its relaunch (replay=True) adopts
    the reduced slices instead of waiting for pieces nobody will post again."""
    url, world = (tmp_path / "store").as_uri(), 3
    data = contributions(world)
    _, outs = reduce_all(url, world, pipelined_allreduce_mean, "runs/t/replay", data)
    store = open_store(url)
    import comm.collectives
    import comm.store_base

    clock = ThreadClock()  # a wait for a key would move it; the replay reads what is posted
    monkeypatch.setattr(comm.collectives, "time", clock)
    monkeypatch.setattr(comm.store_base, "time", clock)
    again = pipelined_allreduce_mean(store, "runs/t/replay", 1, world, data[1], 5.0, replay=True)
    assert clock.monotonic() == 1000.0  # it never waited
    assert all(torch.equal(again[k], outs[1][k]) for k in again)
