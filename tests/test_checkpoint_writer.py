"""Sync checkpoints are put behind the training thread (`engine.checkpoint.CheckpointWriter`):
the state written is the state at `write`, a failed put reaches the caller, and a Local-SGD
rank 0 goes on with round r + 1 while checkpoint r is in flight but posts nothing for round
r + 2 before it is in the store. Their cadence
(`engine.local_sgd_epoch.CheckpointCadence`): by rounds, or by seconds on a clock the test
sets (an every-step epoch, over the ring and over the store). Events order the steps; an `Event.wait` timeout only
keeps a broken build from hanging."""
from __future__ import annotations

import threading

import pytest
import torch

import engine.local_sgd_epoch as local_sgd_epoch
from core.keys import sync_checkpoint_key, sync_prefix
from core.specs import SyncSpec
from engine.checkpoint import CheckpointWriter, load_checkpoint, read_checkpoint_meta
from engine.local_sgd_epoch import CheckpointCadence
from engine.models import build_model
from engine.optimizers import build_optimizer
from tests.memory_store import MemoryStore
from tests.test_gradient_buckets import STEPS, run_threads, specs, stage

HANG_S = 60.0


class HookedStore(MemoryStore):
    """A view of a shared MemoryStore that calls `before_put(key)` before each put lands and
    `after_put(key)` after."""

    def __init__(self, shared: MemoryStore, before_put=lambda key: None, after_put=lambda key: None):
        super().__init__()
        self._data, self._lock = shared._data, shared._lock
        self.before_put, self.after_put = before_put, after_put

    def _write(self, key: str, data: bytes) -> None:
        self.before_put(key)
        super()._write(key, data)
        self.after_put(key)


def test_the_write_returns_at_once_and_stores_the_state_it_was_given():
    shared, entered, release, order = MemoryStore(), threading.Event(), threading.Event(), []

    def hold(key):
        entered.set()
        assert release.wait(HANG_S)

    store = HookedStore(shared, before_put=hold, after_put=lambda key: order.append("put"))
    model = build_model("digits_mlp", 0)
    optimizer = build_optimizer("momentum", model, 0.1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    writer = CheckpointWriter(store)
    writer.write("ckpt", model, optimizer, {"step": 3}, then=lambda: order.append("then"))
    assert entered.wait(HANG_S)
    assert not shared.exists("ckpt")  # the put is held, the caller already has control back
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # training goes on
    release.set()
    writer.wait()
    assert order == ["put", "then"]
    restored = build_model("digits_mlp", 1)
    meta = load_checkpoint(shared, "ckpt", restored)
    assert meta["step"] == 3
    for k, v in restored.state_dict().items():
        assert torch.equal(v, before[k])


def test_a_failed_put_is_raised_by_the_next_wait_and_only_once():
    def fail(key):
        raise OSError("disk full")

    writer = CheckpointWriter(HookedStore(MemoryStore(), before_put=fail))
    writer.write("ckpt", build_model("digits_mlp", 0), None, {})
    with pytest.raises(OSError, match="disk full"):
        writer.wait()
    writer.wait()


@pytest.mark.parametrize("every_step", ["gradients", "parameters"])
def test_rank_0_posts_round_r_plus_2_only_once_checkpoint_r_is_stored(every_step, monkeypatch):
    """Checkpoint 0's put is held until rank 0 either posts for round 2 (the fault) or waits
    for the writer (the protocol); then it lands. Round 1 goes on meanwhile, round 2 after."""
    shared, run_id = MemoryStore(), "zckptw"
    stage(shared, run_id, "momentum")
    group, ckpt = sync_prefix(run_id, 0), sync_checkpoint_key(run_id, 0)
    put_held, rank0_moved_on, events = threading.Event(), threading.Event(), []
    wait = CheckpointWriter.wait

    def waiting(writer):
        if put_held.is_set():
            rank0_moved_on.set()
        wait(writer)

    monkeypatch.setattr(CheckpointWriter, "wait", waiting)

    def rank0_before(key):
        if key == ckpt and ("stored", ckpt) not in events:
            put_held.set()
            assert rank0_moved_on.wait(HANG_S)
        for r in (1, 2):
            if key.startswith(f"{group}/r{r}/") and ("post", r) not in events:
                events.append(("post", r))
                if r == 2:
                    rank0_moved_on.set()

    def rank0_after(key):
        if key == ckpt and ("stored", ckpt) not in events:
            events.append(("stored", ckpt))

    stores = [HookedStore(shared, rank0_before, rank0_after), shared]
    worker_specs = specs(shared, run_id, "momentum", SyncSpec(collective="plain", every_step=every_step, checkpoint_s=0.0))
    run_threads(shared, worker_specs, stores)
    assert events == [("post", 1), ("stored", ckpt), ("post", 2)]


class ListClock:
    """A clock the test sets: `now` seconds."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_cadence_by_rounds_and_by_seconds():
    by_rounds = CheckpointCadence(3, steps=8)
    assert [r for r in range(8) if by_rounds.due(r, r + 1)] == [2, 5, 7]  # every 3rd and the last
    assert not any(CheckpointCadence(0, steps=8).due(r, r + 1) for r in range(8))

    clock = ListClock()
    by_seconds = CheckpointCadence(1, steps=10, min_s=1.0, clock=clock)
    due = []
    for r, now in enumerate([0.2, 0.9, 1.0, 1.5, 1.9, 2.1, 2.2, 3.5, 3.6, 3.7]):
        clock.now = now
        if by_seconds.due(r, r + 1):
            due.append(r)
            by_seconds.written(r)
        clock.now += 5.0  # asked again later in the same round: the answer stands
        assert by_seconds.due(r, r + 1) == (r in due)
    assert due == [2, 5, 7, 9]  # each the first round 1 s after the one before; the last round always

    clock.now = 0.0  # the clock stands still: due every 4th round after the last written, by rounds kept
    by_rounds_kept = CheckpointCadence(1, steps=10, min_s=1.0, clock=clock, max_rounds=4)
    due = [r for r in range(10) if by_rounds_kept.due(r, r + 1) and by_rounds_kept.written(r) is None]
    assert due == [3, 7, 9]


@pytest.mark.parametrize("collective", ["ring", "plain"])
def test_an_every_step_epoch_checkpoints_by_the_clock_not_per_step(monkeypatch, collective):
    shared, run_id = MemoryStore(), "zcadence"
    stage(shared, run_id, "momentum")
    ckpt, steps_written = sync_checkpoint_key(run_id, 0), []
    monkeypatch.setattr(local_sgd_epoch, "checkpoint_clock", lambda: 0.0)  # no second ever passes

    def record(key):
        if key == ckpt:
            steps_written.append(read_checkpoint_meta(shared, ckpt)["step"])

    stores = [HookedStore(shared, after_put=record), shared]
    sync = SyncSpec(collective=collective, ring_timeout_s=20.0)
    run_threads(shared, specs(shared, run_id, "momentum", sync), stores)
    assert steps_written == [STEPS]  # the last round's only
