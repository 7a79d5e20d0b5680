"""Where a resume goes on: the history's last epoch names the checkpoint, and pruning waits for
the history's write, so a coordinator killed at any point between the two steps resumes from a
checkpoint that is there (`coordinator.workers.retention`, `coordinator.run.resume`)."""
from __future__ import annotations

import json
from types import SimpleNamespace

from comm.store import DirectoryStore
from coordinator.run.context import RunState
from coordinator.run.resume import find_resume_point, write_history
from coordinator.workers.retention import commit_checkpoint, retire_checkpoints
from core.epoch_summary import EpochSummary
from core.keys import checkpoint_key, init_checkpoint_key, run_doc_key
from engine.checkpoint import initial_checkpoint

RUN = "ret"
JOB = {"model": "digits_mlp", "dataset": "digits", "batch_size": 8, "optimizer": "sgd", "seed": 0}


def _ctx(store):
    job = SimpleNamespace(target_loss=None, target_accuracy=None, keep_checkpoints=1, sync_dtype="float32",
                          lr=0.1, workers=2, **JOB)
    return SimpleNamespace(run_id=RUN, job=job, state=RunState(), store_ref="file://x",
                           open_durable=lambda: store, open_store=lambda: store)


def test_a_kill_between_the_checkpoint_and_the_history_resumes_from_a_checkpoint_that_is_there(tmp_path):
    store = DirectoryStore(tmp_path / "store")
    store.close = lambda: None
    ctx = _ctx(store)
    initial_checkpoint(store, init_checkpoint_key(RUN), "digits_mlp", "sgd", lr=0.1)
    store.put(run_doc_key(RUN), json.dumps({"job": JOB, "plan": {}}).encode())
    blob = store.get(init_checkpoint_key(RUN))
    history = []
    assert find_resume_point(ctx, required=True).init_key == init_checkpoint_key(RUN)
    for epoch in range(3):
        store.put(checkpoint_key(RUN, epoch), blob)  # rank 0's epoch checkpoint
        summary = EpochSummary(epoch=epoch, workers=2, train_loss=1.0, seconds=1.0,
                               checkpoint_key=checkpoint_key(RUN, epoch))
        commit_checkpoint(ctx, summary)
        # killed here: the epoch is not in the history, so it is trained again, from the last
        # checkpoint the history names, which keep_checkpoints=1 has not pruned yet
        point = find_resume_point(ctx, required=True)
        want = checkpoint_key(RUN, epoch - 1) if epoch else init_checkpoint_key(RUN)
        assert (point.next_epoch, point.init_key) == (epoch, want)
        assert store.exists(point.init_key)
        history.append(summary)
        write_history(store, RUN, history)
        # killed here: the epoch is done and its checkpoint is the one to go on from
        point = find_resume_point(ctx, required=True)
        assert (point.next_epoch, point.init_key) == (epoch + 1, checkpoint_key(RUN, epoch))
        retire_checkpoints(ctx, summary)
        assert store.exists(checkpoint_key(RUN, epoch))
        assert [k for k in store.list(f"runs/{RUN}/ckpt/") if "epoch-" in k] == [checkpoint_key(RUN, epoch)]
