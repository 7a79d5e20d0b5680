"""The store allreduce: exact means and sums, measured traffic, cleanup, missing peers."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from comm.bandwidth import TransferStats
from comm.collectives import allreduce_mean, allreduce_sum, release_group
from core.errors import StoreTimeout, ZooidValueError
from tests.memory_store import MemoryStore

SHAPES = {"a": (3, 5), "b": (7,), "c": (1,), "d": (2, 3, 4), "e": ()}


def run_ranks(world, fn):
    """Run fn(rank) on `world` threads and return the results in rank order."""
    with ThreadPoolExecutor(world) as pool:
        return list(pool.map(fn, range(world)))


def rank_tensors(rank, dtype=torch.float64):
    g = torch.Generator().manual_seed(100 + rank)
    return {k: torch.randn(s, generator=g, dtype=dtype) for k, s in SHAPES.items()}


@pytest.mark.parametrize("world", range(1, 9))
def test_mean_equals_stacked_mean(world):
    store = MemoryStore()
    inputs = [rank_tensors(r) for r in range(world)]
    inputs = [{**t, "f32": t["a"].float() * 3} for t in inputs]  # a second dtype in the same call
    outs = run_ranks(world, lambda r: allreduce_mean(store, "runs/t/sync/r0", r, world, inputs[r], 10))
    for name in inputs[0]:
        expected = torch.stack([t[name] for t in inputs]).mean(0)
        for out in outs:
            assert out[name].dtype == inputs[0][name].dtype
            assert out[name].shape == inputs[0][name].shape
            # The reduction may vectorise in another order than on the whole stack: equal
            # to a few ulps, and bitwise equal on every rank.
            tol = 1e-14 if expected.dtype == torch.float64 else 1e-6
            torch.testing.assert_close(out[name], expected, rtol=tol, atol=tol)
            assert torch.equal(out[name], outs[0][name])


def test_sum_of_integers_and_measured_bytes():
    store, world = MemoryStore(), 3
    inputs = [{"n": torch.arange(10, dtype=torch.int64) * (r + 1)} for r in range(world)]
    stats = [TransferStats() for _ in range(world)]
    outs = run_ranks(world, lambda r: allreduce_sum(store, "runs/t/s", r, world, inputs[r], 10, stats=stats[r]))
    for out in outs:
        assert torch.equal(out["n"], torch.arange(10) * 6)
    # Every byte a rank reports uploading reached the store, and every upload is read once
    # (a part by its owner, a reduced slice by the world - 1 other ranks).
    assert sum(s.bytes_up for s in stats) == store.bytes_written
    assert all(s.calls == 1 and s.bytes_down > 0 for s in stats)


def test_rounds_clean_up_every_key():
    store, world = MemoryStore(), 4
    group = "runs/t/sync/e0"

    def rank(r):
        t = rank_tensors(r)
        for i in range(3):
            prev = f"{group}/r{i - 1}" if i else None
            t = allreduce_mean(store, f"{group}/r{i}", r, world, t, 10, previous_prefix=prev)
        release_group(store, group, r, world, 10)
        return t

    outs = run_ranks(world, rank)
    assert all(torch.equal(outs[0]["d"], o["d"]) for o in outs)
    assert store.list("runs/") == []


def test_missing_peer_times_out_naming_the_key():
    store = MemoryStore()
    with pytest.raises(StoreTimeout, match="runs/t/s/part-0-1"):
        allreduce_mean(store, "runs/t/s", 0, 2, rank_tensors(0), 0.2)


def test_world_of_one_is_a_no_op():
    store, t = MemoryStore(), rank_tensors(0)
    out = allreduce_mean(store, "runs/t/s", 0, 1, t, 1)
    assert out is t and store.puts == []


def test_mean_refuses_integer_tensors():
    with pytest.raises(ZooidValueError, match="tensors"):
        allreduce_mean(MemoryStore(), "runs/t/s", 0, 2, {"n": torch.arange(3)}, 1)
