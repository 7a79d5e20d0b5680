"""Pre-start (Hydrozoa Sec. 4.3): when to launch the next epoch's workers, and the hidden/exposed split."""
from __future__ import annotations

import pytest

from planners.prestart import (PrestartError, decide_prestart, remaining_epoch_s, startup_estimate,
                               startup_split)


def test_startup_estimate_is_a_high_quantile_or_the_prior():
    assert startup_estimate([], prior_s=90.0) == 90.0
    assert startup_estimate([3.0, 4.0, 5.0, 30.0], quantile=0.9) == 30.0
    assert startup_estimate([3.0, 4.0, 5.0, 30.0], quantile=0.5) == 5.0


def test_remaining_time_from_progress_else_prediction():
    assert remaining_epoch_s(30.0, 100.0, progress=0.25) == pytest.approx(90.0)  # slower than predicted
    assert remaining_epoch_s(30.0, 100.0) == 70.0
    assert remaining_epoch_s(130.0, 100.0) == 0.0


def test_launch_when_remaining_covers_startup_plus_margin():
    early = decide_prestart(elapsed_s=10.0, predicted_epoch_s=100.0, startup_samples=[20.0, 25.0], margin_s=5.0)
    assert (early.launch_in_s, early.launch_now) == (60.0, False)  # 90 left - 25 start-up - 5 margin
    late = decide_prestart(elapsed_s=75.0, predicted_epoch_s=100.0, startup_samples=[20.0, 25.0], margin_s=5.0)
    assert late.launch_now and late.launch_in_s == 0.0


def test_split_hidden_exposed_idle():
    # Previous epoch ends at 100. Worker A: launched 70, ready 95 (all hidden, idle 5).
    # Worker B: launched 80, ready 110 (20 hidden, 10 exposed). Worker C: launched 100, ready 104.
    split = startup_split([(70.0, 95.0), (80.0, 110.0), (100.0, 104.0)], previous_end=100.0)
    assert split.to_dict() == {"hidden_s": 45.0, "exposed_s": 14.0, "idle_s": 5.0, "critical_exposed_s": 10.0}
    first = startup_split([(0.0, 7.0), (0.0, 9.0)], previous_end=None)
    assert (first.hidden_s, first.exposed_s, first.critical_exposed_s) == (0.0, 16.0, 9.0)


def test_bad_input_names_the_parameter():
    with pytest.raises(PrestartError, match="quantile"):
        startup_estimate([1.0], quantile=0.0)
    with pytest.raises(PrestartError, match="progress"):
        remaining_epoch_s(1.0, 10.0, progress=1.5)
    with pytest.raises(PrestartError, match="workers"):
        startup_split([(5.0, 4.0)], previous_end=None)


@pytest.mark.usefixtures("prefect_api")
def test_pre_started_workers_keys_are_not_cleared_under_them(tmp_path, monkeypatch):
    """Pre-started cold workers begin their epoch as soon as the last one's checkpoint is written,
    which may be before the coordinator has committed it and sent the next epoch: their epoch's
    sync keys are cleared before they are launched, never after (a slice deleted under a worker is
    posted again after a wait: `reposts`)."""
    import json

    from comm.store import open_store
    from comm.store_base import Store
    from coordinator.run.job import TrainJob
    from coordinator.workers.warm_prestart import PrestartWatch
    from core.keys import sync_prefix, worker_history_key
    from flows.train import train

    events, delete_prefix, launch_next = [], Store.delete_prefix, PrestartWatch.launch_next

    def deleting(self, prefix):
        events.append(("cleared", prefix))
        return delete_prefix(self, prefix)

    def launching(self):
        launch_next(self)
        events.append(("launched", sync_prefix(self.ctx.run_id, self.epoch + 1) + "/"))

    monkeypatch.setattr(Store, "delete_prefix", deleting)
    monkeypatch.setattr(PrestartWatch, "launch_next", launching)
    url = f"file://{tmp_path}/store"
    summary = train(TrainJob(model="digits_mlp", dataset="digits", workers=2, epochs=4, sync_period=4,
                             strategy="local_sgd", store=url, target="inline", warm=False, prestart=True))
    launched = [i for i, (what, _) in enumerate(events) if what == "launched"]
    assert launched and sum(e.prestarted for e in summary.epochs) == len(launched)
    for i in launched:
        prefix = events[i][1]
        assert ("cleared", prefix) in events[:i] and ("cleared", prefix) not in events[i:]
    store = open_store(url)  # the workers' own account: nothing posted twice
    history = worker_history_key(summary.run_id, 0, 0, 0).split("/history/")[0] + "/history/"
    records = [json.loads(store.get(key)) for key in store.list(history) if key.endswith(".json")]
    assert len(records) >= 8 and [rec["reposts"] for rec in records] == [0] * len(records)
