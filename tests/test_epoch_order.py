"""The epoch's sample order and the replicas' batches (`engine.epoch_order`): a function of the
seed and epoch alone, every sample exactly once per epoch whatever the worker count, within an
epoch too."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from core.errors import ZooidValueError
from engine.epoch_order import (Phase, add_digests, epoch_order, epoch_steps, remaining, replica_batches,
                                sample_digest, shard_offsets)

ROWS = [64] * 30 + [17]  # a last short shard, as a prepare leaves it
N = sum(ROWS)


def _all_batches(order, phases, world, batch):
    return [replica_batches(order, phases, world, batch, r) for r in range(world)]


def _trained(per_rank, steps=None):
    return np.concatenate([np.empty(0, np.int64)] + [b for batches in per_rank for b in batches[:steps]])


def test_the_order_is_every_id_once_and_a_function_of_seed_and_epoch():
    a = epoch_order(ROWS, seed=3, epoch=1)
    assert sorted(a.tolist()) == list(range(N))
    assert np.array_equal(a, epoch_order(ROWS, seed=3, epoch=1))
    assert not np.array_equal(a, epoch_order(ROWS, seed=3, epoch=2))
    assert not np.array_equal(a, epoch_order(ROWS, seed=4, epoch=1))


def test_a_window_of_the_order_comes_from_its_window_of_shards():
    """Each shard's rows lie within one window's stretch of the order: a reader needs `window`
    shards at a time. One window for the whole dataset spreads them over it."""
    def spread(order):
        shard_of = np.searchsorted(shard_offsets(ROWS), order, side="right") - 1
        pos = np.arange(len(order))
        return max(int(np.ptp(pos[shard_of == s])) for s in range(len(ROWS)))

    assert spread(epoch_order(ROWS, seed=0, epoch=0, window=4)) < 4 * 64
    assert spread(epoch_order(ROWS, seed=0, epoch=0, window=len(ROWS))) > N // 2


@pytest.mark.parametrize("n,world,batch", [(N, 2, 32), (N, 4, 32), (N, 1, 32), (N, 3, 7), (10, 3, 4),
                                           (2 * 64 * 10 + 1, 2, 64), (2 * 64 * 10 + 3, 2, 64), (5, 5, 8),
                                           (129, 2, 64), (7, 3, 1)])
def test_every_id_once_in_equal_step_counts_of_non_empty_batches(n, world, batch):
    order = np.random.default_rng(n).permutation(n)
    per_rank = _all_batches(order, [], world, batch)
    steps = epoch_steps(n, world, batch)
    assert [len(b) for b in per_rank] == [steps] * world
    assert all(1 <= len(x) <= batch + 1 for batches in per_rank for x in batches)
    assert sorted(_trained(per_rank).tolist()) == sorted(order.tolist())
    full = n // (world * batch)
    # the full steps take contiguous spans of the order: each replica keeps to its shards
    for r in range(world):
        span = np.concatenate(per_rank[r][:full])[:full * batch] if full else np.empty(0)  # less a tail row
        assert np.array_equal(span, order[r * full * batch:(r + 1) * full * batch])


def test_step_counts_against_the_rule():
    assert epoch_steps(128, 2, 32) == 2  # no tail
    assert epoch_steps(130, 2, 32) == 3  # a tail of 2 = world: one more step
    assert epoch_steps(129, 2, 32) == 2  # a tail of 1 < world: into the last batches
    assert epoch_steps(3, 2, 32) == 1  # no full step: the tail is the step
    assert epoch_steps(0, 2, 32) == 0


def test_2_then_4_then_1_workers_each_epoch_sees_every_sample_once():
    for epoch, world in enumerate([2, 4, 1]):
        order = epoch_order(ROWS, seed=7, epoch=epoch)
        seen = np.bincount(_trained(_all_batches(order, [], world, 16)), minlength=N)
        assert (seen == 1).all()


@pytest.mark.parametrize("stops", [[(3, 5)], [(3, 0)], [(3, 5), (2, 4)], [(4, 1), (1, 3), (3, 2)]])
def test_a_stop_inside_the_epoch_then_another_world_trains_the_rest_once(stops):
    batch = 16
    order = epoch_order(ROWS, seed=1, epoch=0)
    phases, trained = [], []
    for world, steps in stops:
        per_rank = _all_batches(order, phases, world, batch)
        trained.append(_trained(per_rank, steps))
        phases.append(Phase(world, batch, steps))
    last = _all_batches(order, phases, 2, batch)  # the remainder with 2 workers
    trained.append(_trained(last))
    seen = np.bincount(np.concatenate(trained), minlength=N)
    assert (seen == 1).all()
    assert len(remaining(order, phases + [Phase(2, batch, len(last[0]))])) == 0


def test_the_same_world_after_a_stop_continues_the_same_batches():
    """A relaunch with the world it had trains exactly the batches the stopped replicas had left."""
    order = epoch_order(ROWS, seed=2, epoch=3)
    before = _all_batches(order, [], 3, 16)
    after = _all_batches(order, [Phase(3, 16, 4)], 3, 16)
    # the remainder is re-cut over the concatenated rest, so per-replica sets differ; the union is equal
    assert sorted(_trained(after).tolist()) == sorted(np.concatenate([b for r in before for b in r[4:]]).tolist())


def test_phases_round_trip_and_refusals():
    p = Phase(3, 16, 5)
    assert Phase.from_dict(p.to_dict()) == p
    with pytest.raises(ZooidValueError, match="^world"):
        Phase(0, 16, 0)
    with pytest.raises(ZooidValueError, match="^steps"):
        remaining(np.arange(100), [Phase(2, 10, 6)])  # 5 steps only
    with pytest.raises(ZooidValueError, match="^workers"):
        replica_batches(np.arange(3), [], 4, 8, 0)
    with pytest.raises(ZooidValueError, match="^rank"):
        replica_batches(np.arange(30), [], 2, 8, 2)
    with pytest.raises(ZooidValueError, match="^window"):
        epoch_order(ROWS, 0, 0, window=0)


def test_digests_add_up_exactly_when_every_id_is_trained_once():
    order = epoch_order(ROWS, seed=5, epoch=0)
    per_rank = _all_batches(order, [], 3, 16)
    whole = sample_digest(np.arange(N))
    parts = [sample_digest(np.concatenate(b)) for b in per_rank]
    assert add_digests(*parts) == whole
    repeated = np.concatenate([np.arange(N - 1), [0]])  # one id twice, one missing: the same count
    assert sample_digest(repeated) != whole
    assert all(sample_digest(np.array(list(c))) != sample_digest(np.array([0, 1]))
               for c in itertools.combinations(range(2, 6), 2))
