"""Interleaved 1F1B run by the executor: each of p stage workers holds v = 2 non-adjacent model
stages of `digits_cnn`, cut into p * v stages. Under plain SGD it trains the same weights as
GPipe over the same p * v stages (one per worker), alone and in hybrid D x p, with the same
losses, validation and one canonical full-model checkpoint that resumes under any schedule.
The planner's `auto` weighs interleaved beside 1F1B and GPipe. Float64, stage workers on
threads, each with its own client of one directory store (`test_pipeline_equivalence`).
"""
from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from comm.store import open_store
from comm.tensor_codec import decode_tensors, read_header
from core.errors import ZooidValueError
from core.keys import activation_prefix
from core.specs import ComputeSpec, StageSpec, SyncSpec, WorkerSpec
from engine.checkpoint import initial_checkpoint
from engine.datasets import publish_dataset
from engine.epoch_order import epoch_steps
from engine.pipeline_executor import iteration_schedule, pipeline_worker_specs, run_pipeline_worker
from tests.test_pipeline_equivalence import run_threads, weights

RUN = "il"
STEPS, BATCH, LR = 6, 32, 0.1
DATA, N = "synthetic:64:10:192:32", 192
"""STEPS steps of BATCH rows for one replica, 3 for two."""
CUTS = [2, 4, 8]
"""digits_cnn's 10 children as 4 model stages, each with parameters: [unflatten, conv],
[relu, conv], [relu, pool, flatten, linear], [relu, linear]."""


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    """A directory store with digits published and seeded initial checkpoints (SGD, momentum)."""
    url = (tmp_path_factory.mktemp("interleaved") / "store").as_uri()
    store = open_store(url)
    manifest = publish_dataset(store, RUN, DATA, subset_size=32)
    for optimizer in ("sgd", "momentum"):
        initial_checkpoint(store, f"runs/{RUN}/init-{optimizer}", "digits_cnn", optimizer, LR, seed=5)
    return url, manifest


def base_spec(url: str, out: str, *, epoch: int = 0, optimizer: str = "sgd", init: str = "",
              replicas: int = 1) -> WorkerSpec:
    return WorkerSpec(run_id=RUN, epoch=epoch, rank=0, world=1, store_url=url, model="digits_cnn",
                      dataset=DATA, steps=epoch_steps(N, replicas, BATCH), batch_size=BATCH, lr=LR, optimizer=optimizer,
                      sync_period=1, seed=5, init_key=init or f"runs/{RUN}/init-{optimizer}", out_key=out,
                      sync_timeout_s=30.0, compute=ComputeSpec(dtype="float64"))


def train(url: str, out: str, schedule: str, replicas: int = 1, *, microbatches: int = 4, cuts=CUTS, **kwargs):
    """One epoch of a pipeline (one replica) or hybrid (several) under `schedule`; interleaved
    with v = 2, the others with one model stage per worker."""
    specs = pipeline_worker_specs(base_spec(url, out, replicas=replicas, **kwargs), cuts=cuts,
                                  microbatches=microbatches, replicas=replicas, schedule=schedule,
                                  chunks=2 if schedule == "interleaved" else 1)
    return specs, run_threads(specs, run_pipeline_worker)


def assert_close_weights(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b) and a
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0.0, atol=1e-5)


def test_two_workers_with_two_chunks_train_gpipes_weights(staged):
    url, manifest = staged
    _, ref = train(url, f"runs/{RUN}/gpipe", "gpipe")
    specs, results = train(url, f"runs/{RUN}/interleaved", "interleaved")

    assert [(s.stage.index, s.rank, s.world, s.stage.chunks) for s in specs] == [(0, 0, 2, 2), (1, 1, 2, 2)]
    assert_close_weights(weights(url, f"runs/{RUN}/interleaved"), weights(url, f"runs/{RUN}/gpipe"))
    assert results[1].checkpoint_key == f"runs/{RUN}/interleaved"  # worker 1 holds the last model stage
    assert results[0].checkpoint_key == ""
    assert results[0].train_loss == results[1].train_loss == pytest.approx(ref[-1].train_loss, rel=1e-9)
    assert results[1].val_loss == pytest.approx(ref[-1].val_loss, rel=1e-9)
    assert results[1].val_accuracy == ref[-1].val_accuracy
    assert results[0].val_loss is None
    assert all(r.compute_s > 0 and r.samples == STEPS * BATCH for r in results)
    meta = json.loads(decode_tensors(open_store(url).get(f"runs/{RUN}/interleaved"))[1]["meta"])
    assert meta["cuts"] == CUTS and meta["chunks"] == 2 and meta["global_step"] == STEPS
    assert open_store(url).list(activation_prefix(RUN, 0)) == []


def test_one_worker_with_two_chunks_hands_over_in_memory(staged):
    """p = 1: both model stages on one worker, no transfers between them."""
    url, manifest = staged
    train(url, f"runs/{RUN}/gpipe-2", "gpipe", cuts=[4])
    specs, [result] = train(url, f"runs/{RUN}/interleaved-1", "interleaved", cuts=[4])
    assert len(specs) == 1 and result.checkpoint_key == f"runs/{RUN}/interleaved-1"
    assert result.upload_s == 0.0  # nothing crossed the store
    assert_close_weights(weights(url, f"runs/{RUN}/interleaved-1"), weights(url, f"runs/{RUN}/gpipe-2"))


def test_hybrid_two_replicas_of_two_workers_with_two_chunks_train_gpipes_weights(staged):
    url, manifest = staged
    _, ref = train(url, f"runs/{RUN}/hybrid-gpipe", "gpipe", 2)
    for sync in ("pipelined", "plain"):
        out = f"runs/{RUN}/hybrid-interleaved-{sync}"
        base = replace(base_spec(url, out, replicas=2), sync=SyncSpec(collective=sync))
        specs = pipeline_worker_specs(base, cuts=CUTS, microbatches=4, replicas=2,
                                      schedule="interleaved", chunks=2)
        assert [(s.stage.replica, s.stage.index, s.rank, s.world) for s in specs] == [
            (0, 0, 0, 4), (0, 1, 1, 4), (1, 0, 2, 4), (1, 1, 3, 4)]
        results = run_threads(specs, run_pipeline_worker)
        assert_close_weights(weights(url, out), weights(url, f"runs/{RUN}/hybrid-gpipe"))
        # each replica's loss is its own shard's; every chunk synced in its own group
        assert results[1].train_loss == pytest.approx(ref[3].train_loss, rel=1e-9)
        assert results[3].train_loss == pytest.approx(ref[7].train_loss, rel=1e-9)
        assert all(r.bytes_synced > 0 for r in results)
    store = open_store(url)
    assert store.list(activation_prefix(RUN, 0)) == []
    assert store.list(f"runs/{RUN}/sync/") == []


@pytest.mark.parametrize("first", ["interleaved", "gpipe"])
def test_resume_from_a_mid_run_checkpoint_under_interleaved(staged, first):
    """Epoch 0 writes the canonical checkpoint (momentum state included); epoch 1 under
    interleaved resumes from it, whichever schedule wrote it, and lands on GPipe's two epochs."""
    url, manifest = staged
    for e in range(2):
        init = f"runs/{RUN}/ref-e{e - 1}" if e else ""
        train(url, f"runs/{RUN}/ref-e{e}", "gpipe", epoch=e, optimizer="momentum", init=init)
    train(url, f"runs/{RUN}/{first}-e0", first, optimizer="momentum")
    _, results = train(url, f"runs/{RUN}/{first}-e1", "interleaved", epoch=1,
                       optimizer="momentum", init=f"runs/{RUN}/{first}-e0")

    ref_blob, mid_blob = (open_store(url).get(f"runs/{RUN}/{k}-e0") for k in ("ref", first))
    tensors, mid = decode_tensors(ref_blob)[0], decode_tensors(mid_blob)[0]
    # one format: the same tensors, weights and optimizer state under the full model's keys
    assert sorted(read_header(mid_blob)) == sorted(read_header(ref_blob))
    assert any(k.endswith(".momentum_buffer") for k in mid)
    for k in tensors:
        torch.testing.assert_close(mid[k], tensors[k], rtol=0.0, atol=1e-5)
    assert_close_weights(weights(url, f"runs/{RUN}/{first}-e1"), weights(url, f"runs/{RUN}/ref-e1"))
    meta = json.loads(decode_tensors(open_store(url).get(f"runs/{RUN}/{first}-e1"))[1]["meta"])
    assert meta["epoch"] == 1 and meta["global_step"] == 2 * STEPS
    assert results[1].val_accuracy is not None


@pytest.mark.parametrize("stage, field", [
    ({"index": 0, "cuts": CUTS, "microbatches": 4, "chunks": 3}, "stage.chunks"),
    ({"index": 2, "cuts": CUTS, "microbatches": 4, "chunks": 2, "schedule": "interleaved"}, "stage.index"),
    ({"index": 0, "cuts": CUTS, "microbatches": 4, "schedule": "interleaved"}, "chunks"),
    ({"index": 0, "cuts": CUTS, "microbatches": 3, "chunks": 2, "schedule": "interleaved"}, "microbatches"),
    ({"index": 0, "cuts": CUTS, "microbatches": 4, "chunks": 2}, "chunks"),  # gpipe puts one stage on a worker
    ({"index": 0, "cuts": CUTS, "microbatches": 4, "schedule": "zero-bubble"}, "stage.schedule"),
    ({"index": 0, "cuts": CUTS, "microbatches": 1, "chunks": 2, "actions": ["0F0 0B0", "1F0 1B0"]}, "schedule"),
    ({"index": 0, "cuts": CUTS, "microbatches": 1, "chunks": 2, "replicas": 2,
      "actions": ["0F0 2F0 2B0 0B0 2SYNC", "1F0 3F0 3B0 1B0 3SYNC 1SYNC"]}, "schedule"),
])
def test_bad_interleaved_settings_name_the_field(stage, field):
    """Refused before any worker starts (the last two: a schedule naming 2 of the 4 model
    stages, and replicas whose stage 0 would never sync)."""
    with pytest.raises(ZooidValueError) as info:
        iteration_schedule(StageSpec.from_dict(stage))
    assert info.value.field == field


def test_worker_specs_refuse_a_schedule_before_any_worker_starts():
    base = WorkerSpec(run_id=RUN, epoch=0, rank=0, world=1, store_url="file:///nowhere", model="digits_cnn",
                      dataset="digits", steps=1, batch_size=8, lr=LR, optimizer="sgd", seed=5,
                      init_key="i", out_key="o")
    with pytest.raises(ZooidValueError, match="^microbatches: must be a multiple of the 2"):
        pipeline_worker_specs(base, cuts=CUTS, microbatches=3, replicas=1,
                              schedule="interleaved", chunks=2)


# --- the planner ------------------------------------------------------------------------------

def _job_ctx(schedule: str, memory_gb: float = 2.0):
    from coordinator.run.job import TrainJob

    target = SimpleNamespace(worker_memory_gb=memory_gb)
    return SimpleNamespace(job=TrainJob(pipeline_schedule=schedule), resolved=SimpleNamespace(target=target))


def _profile(layers: int, activation_bytes: int = 1000) -> dict:
    return {"model": "m", "input_shape": [4], "batch_size": 8, "step_s": 1.0, "param_bytes": 10 * layers,
            "peak_rss_bytes": 0, "microbatch_size": 2,
            "layers": [{"name": str(i), "forward_s": 0.1, "backward_s": 0.2, "output_bytes": 100,
                        "param_bytes": 10, "activation_bytes": activation_bytes} for i in range(layers)]}


def _fake_predictions(monkeypatch, times: dict) -> list:
    """`with_schedule` answering `times[name]` (a ValueError: cannot predict), recording calls."""
    import coordinator.plan.planning

    calls = []

    def fake(x, plan, name, chunks=1):
        calls.append((name, chunks))
        if isinstance(times[name], Exception):
            raise times[name]
        cuts = tuple(range(plan.stages * chunks - 1))
        return replace(plan, pipeline_schedule=name, chunks=chunks, cuts=cuts, predicted_iteration_s=times[name])

    monkeypatch.setattr(coordinator.plan.planning, "with_schedule", fake)  # the name the planning module calls
    return calls


def test_auto_considers_interleaved_and_takes_it_when_fastest_and_fitting(monkeypatch):
    import coordinator.plan.planning
    from core.plan import Plan

    calls = _fake_predictions(monkeypatch, {"gpipe": 1.0, "1f1b": 1.0, "interleaved": 0.8})
    plan = Plan(strategy="pipeline", data_parallel=1, stages=2, cuts=(3,), microbatches=8, batch_size=16)
    chosen = coordinator.plan.planning.pick_schedule(_job_ctx("auto"), _profile(8), None, plan)
    assert (chosen.pipeline_schedule, chosen.chunks, len(chosen.cuts)) == ("interleaved", 2, 3)
    # listed by the stage-sized activation sets worker 0 holds: 1F1B 2, interleaved 2.5, GPipe 8
    assert calls == [("1f1b", 1), ("interleaved", 2), ("gpipe", 1)]
    assert [(a["pipeline_schedule"], a["fits"], a["chosen"]) for a in chosen.alternatives] == [
        ("1f1b", True, False), ("interleaved", True, True), ("gpipe", True, False)]


def test_auto_keeps_1f1b_within_one_percent_and_skips_interleaved_where_it_cannot_run(monkeypatch):
    import coordinator.plan.planning
    from core.plan import Plan

    calls = _fake_predictions(monkeypatch, {"gpipe": 1.0, "1f1b": 1.0, "interleaved": 0.995})
    plan = Plan(strategy="pipeline", data_parallel=1, stages=2, cuts=(3,), microbatches=8, batch_size=16)
    assert coordinator.plan.planning.pick_schedule(_job_ctx("auto"), _profile(8), None, plan).pipeline_schedule == "1f1b"
    for microbatches, layers in ((3, 8), (8, 3)):  # M not a multiple of p; fewer than p * v layers
        calls.clear()
        odd = replace(plan, microbatches=microbatches, batch_size=2 * microbatches)
        assert coordinator.plan.planning.pick_schedule(_job_ctx("auto"), _profile(layers), None, odd).pipeline_schedule == "1f1b"
        assert [name for name, _ in calls] == ["1f1b", "gpipe"]
    # a planner that cannot predict interleaved drops it from the comparison
    _fake_predictions(monkeypatch, {"gpipe": 1.0, "1f1b": 1.2, "interleaved": ValueError("chunks: no")})
    chosen = coordinator.plan.planning.pick_schedule(_job_ctx("auto"), _profile(8), None, plan)
    assert [a["pipeline_schedule"] for a in chosen.alternatives] == ["1f1b", "gpipe"]


def test_interleaved_that_does_not_fit_its_workers_is_not_chosen(monkeypatch):
    """Worker memory for interleaved: the activations its row holds at once over both chunks
    plus its chunks' parameters. 4 layers of 0.3 GB activations per micro-batch, M = 2:
    interleaved's worker 0 holds all 4 chunk sets (1.2 GB); 1F1B's stage 1 (layers 1-3 here)
    one set of 0.9 GB; GPipe's stage 1 two (1.8 GB)."""
    import coordinator.plan.planning
    from core.plan import Plan

    _fake_predictions(monkeypatch, {"gpipe": 1.0, "1f1b": 1.0, "interleaved": 0.5})
    plan = Plan(strategy="pipeline", data_parallel=1, stages=2, cuts=(0,), microbatches=2, batch_size=4)
    big = _profile(4, activation_bytes=int(0.3 * 2 ** 30))
    assert coordinator.plan.planning.pick_schedule(_job_ctx("auto", memory_gb=2.0), big, None, plan).pipeline_schedule == "interleaved"
    chosen = coordinator.plan.planning.pick_schedule(_job_ctx("auto", memory_gb=1.0), big, None, plan)
    assert [(a["pipeline_schedule"], a["fits"], a["chosen"]) for a in chosen.alternatives] == [
        ("1f1b", True, True), ("gpipe", False, False), ("interleaved", False, False)]
    with pytest.raises(ZooidValueError, match=r"^memory: .*interleaved: worker 0 \(model stages 0, 2\) needs "
                                              r"1\.20 GB \(activations 1\.20 GB\), worker has 0\.50 GB"):
        coordinator.plan.planning.pick_schedule(_job_ctx("auto", memory_gb=0.5), big, None, plan)


def test_with_schedule_cuts_the_model_into_p_times_v_stages_with_parameters(monkeypatch):
    import planners.strategy
    from core.plan import Plan
    from planners.strategy import StrategyInputs, with_schedule

    monkeypatch.setattr(planners.strategy, "predicted", lambda x, plan: plan)
    layers = tuple({"forward_s": f, "backward_s": 2 * f, "output_bytes": 100.0, "param_bytes": p}
                   for f, p in [(0.1, 10), (0.01, 0), (0.1, 10), (0.3, 10), (0.01, 0), (0.1, 10), (0.1, 10)])
    x = StrategyInputs(layers=layers, profile_batch=4, step_s=1.0, param_bytes=50.0, optimizer_copies=0,
                       n_train=64, batch_size=8, workers=2, stages=2, microbatches=4, sync_period=1,
                       bandwidth=1e9, latency=1e-3, offer="", price_per_worker_s=0.0)
    plan = Plan(strategy="pipeline", data_parallel=1, stages=2, cuts=(2,), microbatches=4, batch_size=8)
    il = with_schedule(x, plan, "interleaved", chunks=2)
    assert (il.pipeline_schedule, il.chunks, len(il.cuts)) == ("interleaved", 2, 3)
    # every model stage ends on a layer with parameters (layers 1 and 4 have none)
    assert all(layers[c]["param_bytes"] > 0 for c in il.cuts) and list(il.cuts) == sorted(set(il.cuts))
    assert with_schedule(x, plan, "1f1b") == replace(plan, pipeline_schedule="1f1b")
    with pytest.raises(ValueError, match="need 6 layers with parameters, the model has 5"):
        with_schedule(x, replace(plan, stages=3, microbatches=6, batch_size=12), "interleaved", chunks=2)
    with pytest.raises(ValueError, match="multiple of the 2 workers"):
        with_schedule(x, replace(plan, microbatches=3, batch_size=9), "interleaved", chunks=2)


def test_the_time_model_replays_interleaved_per_worker_with_a_smaller_bubble():
    from planners.pipeline_time import TransferCosts, pipeline_iteration

    free = TransferCosts(0.0, 1e30, 0.0, 1e30, 0.0)
    stage = {"forward_s": 1.0, "backward_s": 2.0, "out_bytes": 0.0, "param_bytes": 1.0}
    one_f_one_b = pipeline_iteration([stage] * 2, 4, free, schedule="1f1b")
    halves = [{**stage, "forward_s": 0.5, "backward_s": 1.0}] * 4  # the same model in 4 chunks
    interleaved = pipeline_iteration(halves, 4, free, schedule="interleaved", chunks=2)
    assert len(interleaved.bubble) == 2  # one timeline per worker
    # ideal bubbles: 1F1B (p - 1)/(M + p - 1) = 1/5, interleaved (p - 1)/(v M + p - 1) = 1/9
    assert one_f_one_b.period_s == pytest.approx(4 * 3.0 / (1 - 1 / 5))
    assert interleaved.period_s == pytest.approx(4 * 3.0 / (1 - 1 / 9))
    with pytest.raises(ValueError, match="chunks"):
        pipeline_iteration(halves, 4, free, schedule="interleaved", chunks=3)


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_api")
def test_an_interleaved_job_runs_through_the_flow(tmp_path):
    from coordinator.run.job import TrainJob
    from flows.train import train

    summary = train(TrainJob(model="digits_cnn", strategy="pipeline", stages=2, microbatches=4,
                             pipeline_schedule="interleaved", epochs=2, workers=2,
                             store=f"file://{tmp_path}/store"))
    assert summary.status == "completed"
    assert (summary.plan["pipeline_schedule"], summary.plan["chunks"], summary.plan["workers"]) == ("interleaved", 2, 2)
    assert len(summary.plan["cuts"]) == 3  # 2 workers x 2 chunks = 4 model stages
    assert all(e.workers == 2 for e in summary.epochs) and summary.epochs[-1].val_accuracy > 0.5
