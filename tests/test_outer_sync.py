"""The outer optimizer (K-AVG, DiLoCo) and compressed syncs of Local-SGD, against a
one-process reference written here from the mathematics, through a real directory store."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F

from comm.collectives import allreduce_mean
from comm.compression import Compressor, decode_flat, encode_flat, pending, residual_for
from comm.scatter_reduce import pipelined_allreduce_mean
from comm.store_dir import DirectoryStore
from comm.tensor_codec import encode_tensors
from core.errors import ZooidValueError
from core.outer_sync import INT8_BLOCK
from core.specs import ComputeSpec, SyncSpec, WorkerSpec
from engine.checkpoint import initial_checkpoint, load_checkpoint, read_checkpoint_meta
from engine.datasets import publish_dataset
from engine.epoch_order import epoch_steps
from engine.local_sgd_epoch import run_local_sgd_epoch
from engine.models import build_model
from engine.optimizers import build_optimizer, optimizer_state_tensors
from engine.residuals import read_residual
from tests.epoch_data import replica_rows
from tests.memory_store import Died, DyingStore, MemoryStore

MODEL, OPT, LR, SEED, BATCH = "digits_mlp", "momentum", 0.05, 4, 16
DATA, N = "synthetic:64:10:224:32", 224
"""7 steps an epoch for 2 replicas of BATCH rows (STEPS)."""


def stage(store, run_id, world, epochs):
    """Publish the data and an initial checkpoint; return each epoch's world."""
    publish_dataset(store, run_id, DATA, subset_size=32)
    initial_checkpoint(store, f"runs/{run_id}/ckpt/init", MODEL, OPT, lr=LR, seed=SEED)
    return [world] * epochs


def run_engine(store, run_id, worlds, period, sync=None):
    """Epochs of threads through the engine (epoch e with `worlds[e]` replicas), each from the
    previous epoch's checkpoint; returns the per-epoch results (by rank)."""
    init, out = f"runs/{run_id}/ckpt/init", []
    for epoch, world in enumerate(worlds):
        specs = [WorkerSpec(run_id=run_id, epoch=epoch, rank=r, world=world, store_url=store.url,
                            model=MODEL, dataset=DATA, steps=epoch_steps(N, world, BATCH),
                            batch_size=BATCH, lr=LR, optimizer=OPT, sync_period=period, seed=SEED,
                            init_key=init, out_key=f"runs/{run_id}/ckpt/e{epoch}", evaluate=False,
                            sync_timeout_s=60, compute=ComputeSpec(dtype="float64"), sync=sync or SyncSpec())
                 for r in range(world)]
        with ThreadPoolExecutor(world) as pool:
            out.append(list(pool.map(lambda s: run_local_sgd_epoch(s, store), specs)))
        init = f"runs/{run_id}/ckpt/e{epoch}"
    return out


def load(store, key):
    """(model state, optimizer state, outer tensors, meta) of a checkpoint."""
    model = build_model(MODEL, 0).double()
    opt = build_optimizer(OPT, model, LR)
    extra: dict = {}
    meta = load_checkpoint(store, key, model, opt, extra=extra)
    return model.state_dict(), optimizer_state_tensors(model, opt), extra, meta


def reference(store, run_id, worlds, period, outer="average", outer_lr=1.0, mu=0.0):
    """W replicas in one process: k inner steps each, then the outer step written from the
    papers: mean of the replicas (K-AVG), or Δ = θ_g − mean, m = μ m + Δ,
    θ_g −= η (Δ + μ m) (DiLoCo); buffers and the inner optimizer's state averaged. Each
    replica's batches come from the same sampler as the engine's (`tests.epoch_data`)."""
    world = worlds[0]
    models = [build_model(MODEL, 0).double() for _ in range(world)]
    opts = [build_optimizer(OPT, m, LR) for m in models]
    for m, o in zip(models, opts):
        load_checkpoint(store, f"runs/{run_id}/ckpt/init", m, o)
    theta = {n: p.detach().clone() for n, p in models[0].named_parameters()}
    momentum: dict = {}

    def sync():
        with torch.no_grad():
            params = [dict(m.named_parameters()) for m in models]
            for n in theta:
                mean = torch.stack([p[n] for p in params]).mean(0)
                if outer == "nesterov":
                    delta = theta[n] - mean
                    momentum[n] = mu * momentum[n] + delta if n in momentum else delta.clone()
                    mean = theta[n] - outer_lr * (delta + mu * momentum[n])
                for p in params:
                    p[n].copy_(mean)
                theta[n] = mean.clone()
            states = [optimizer_state_tensors(m, o) for m, o in zip(models, opts)]
            for n in states[0]:
                mean = torch.stack([s[n] for s in states]).mean(0)
                for s in states:
                    s[n].copy_(mean)

    for epoch in range(len(worlds)):
        batches = replica_rows(store, run_id, world, BATCH, seed=SEED, epoch=epoch)
        steps = len(batches[0])
        for step, parts in enumerate(zip(*batches), start=1):
            for (x, y), m, o in zip(parts, models, opts):
                loss = F.cross_entropy(m(x.double()), y)
                o.zero_grad(set_to_none=True)
                loss.backward()
                o.step()
            if step % period == 0 or step == steps:
                sync()
    return models[0].state_dict(), optimizer_state_tensors(models[0], opts[0]), momentum


def assert_states_close(a, b, tol):
    assert a.keys() == b.keys()
    for n in a:
        torch.testing.assert_close(a[n], b[n], rtol=tol, atol=tol)


STEPS, PERIOD, WORLD, EPOCHS = 7, 3, 2, 2


def test_average_on_float32_is_k_avg_over_two_epochs(tmp_path):
    store = DirectoryStore(tmp_path)
    worlds = stage(store, "a", WORLD, EPOCHS)
    run_engine(store, "a", worlds, PERIOD, SyncSpec(outer_optimizer="average", sync_dtype="float32"))
    weights, state, extra, meta = load(store, "runs/a/ckpt/e1")
    ref_w, ref_s, _ = reference(store, "a", worlds, PERIOD)
    assert_states_close(weights, ref_w, 1e-6)
    assert_states_close(state, ref_s, 1e-6)
    assert extra == {} and "residual_keys" not in meta  # K-AVG has no outer state


def test_nesterov_is_diloco_and_its_momentum_crosses_the_epoch_in_the_checkpoint(tmp_path):
    store = DirectoryStore(tmp_path)
    worlds = stage(store, "n", WORLD, EPOCHS)
    run_engine(store, "n", worlds, PERIOD, SyncSpec(outer_optimizer="nesterov", outer_lr=0.7, outer_momentum=0.9))
    weights, state, extra, meta = load(store, "runs/n/ckpt/e1")
    ref_w, ref_s, ref_m = reference(store, "n", worlds, PERIOD, "nesterov", 0.7, 0.9)
    assert_states_close(weights, ref_w, 1e-9)
    assert_states_close(state, ref_s, 1e-9)
    assert meta["outer_optimizer"] == "nesterov"
    assert_states_close({k.removeprefix("outer/momentum/param/"): v for k, v in extra.items()}, ref_m, 1e-9)
    # the sync checkpoint of the last round holds the same outer state (a relaunch reads it)
    _, _, sync_extra, _ = load(store, "runs/n/ckpt/sync-e1.safetensors")
    assert_states_close(sync_extra, extra, 0)


def test_nesterov_with_outer_lr_1_and_no_momentum_equals_average(tmp_path):
    store = DirectoryStore(tmp_path)
    worlds = stage(store, "x", WORLD, EPOCHS)
    for run_id, sync in (("avg", SyncSpec()), ("nes", SyncSpec(outer_optimizer="nesterov", outer_lr=1.0, outer_momentum=0.0))):
        stage(store, run_id, WORLD, EPOCHS)
        run_engine(store, run_id, worlds, PERIOD, sync)
    assert_states_close(load(store, "runs/nes/ckpt/e1")[0], load(store, "runs/avg/ckpt/e1")[0], 1e-9)
    assert_states_close(load(store, "runs/nes/ckpt/e1")[1], load(store, "runs/avg/ckpt/e1")[1], 1e-9)


def test_error_feedback_loses_nothing_over_rounds():
    """Σ results + what is still owed = Σ exact means, every round, both collectives."""
    world, rounds = 3, 6
    for collective in (allreduce_mean, pipelined_allreduce_mean):
        store = MemoryStore()
        compressors = [Compressor("int8") for _ in range(world)]
        gen = torch.Generator().manual_seed(0)
        inputs = [[{"w": torch.randn(5000, generator=gen, dtype=torch.float64) * 1e-3,
                    "b": torch.randn(7, generator=gen, dtype=torch.float64)} for _ in range(world)]
                  for _ in range(rounds)]
        exact = {"w": torch.zeros(5000, dtype=torch.float64), "b": torch.zeros(7, dtype=torch.float64)}
        applied = {k: torch.zeros_like(v) for k, v in exact.items()}
        with ThreadPoolExecutor(world) as pool:
            for r in range(rounds):
                outs = list(pool.map(lambda i: collective(store, f"g/r{r}", i, world, inputs[r][i], 30,
                                                          compressor=compressors[i]), range(world)))
                assert all(torch.equal(o["w"], outs[0]["w"]) for o in outs)  # replicas agree bit for bit
                for k in exact:
                    exact[k] += torch.stack([inputs[r][i][k] for i in range(world)]).mean(0)
                    applied[k] += outs[0][k]
                    assert not torch.equal(outs[0][k], exact[k])  # rounding did drop something
        owed = pending([c.residual for c in compressors])["float64"]
        flat_applied = torch.cat([applied["b"], applied["w"]])  # sorted-name order
        flat_exact = torch.cat([exact["b"], exact["w"]])
        torch.testing.assert_close(flat_applied + owed, flat_exact, rtol=0, atol=1e-12)


@pytest.mark.parametrize("sync_dtype", ["int8", "bfloat16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_a_rank_uses_exactly_the_values_its_peers_decode_and_keeps_what_the_wire_dropped(sync_dtype, dtype):
    """The reduced slice a rank keeps is what every peer decodes from its wire, bit for bit
    (an all-zero block and exact positions included), and its residual is what was dropped."""
    gen = torch.Generator().manual_seed(3)
    v = (torch.randn(3 * INT8_BLOCK - 5, generator=gen, dtype=torch.float64) * 1e-2).to(dtype)
    v[INT8_BLOCK:2 * INT8_BLOCK] = 0  # a whole int8 block of zeros: scale 0
    mask = torch.zeros(v.numel(), dtype=torch.bool)
    mask[[3, 300, v.numel() - 1]] = True
    name = str(dtype).removeprefix("torch.")
    for exact in (None, {name: mask}):
        comp = Compressor(sync_dtype)
        comp.exact = exact
        comp.begin({name: v}, 1)
        for _ in range(3):  # the residual grows into the next call's piece
            before = comp.residual[name].clone()
            wire, values = comp.result({name: v}, 0)
            assert list(values) == [name]
            got = values[name]
            assert got.dtype == dtype and torch.equal(got, decode_flat(wire)[name])
            assert torch.equal(comp.residual[name], (v + before) - got)
            if exact is not None:
                assert torch.equal(got[mask], (v + before)[mask]) and not comp.residual[name][mask].any()


def test_a_residual_continues_in_a_world_of_another_size_owing_the_same():
    gen = torch.Generator().manual_seed(1)
    old = [{"float32": torch.randn(103, generator=gen)} for _ in range(4)]
    for world in (1, 2, 3, 4, 6):
        new = [residual_for(old, r, world) for r in range(world)]
        torch.testing.assert_close(pending(new)["float32"], pending(old)["float32"], rtol=0, atol=1e-6)
    assert all(torch.equal(residual_for(old, r, 4)["float32"], old[r]["float32"]) for r in range(4))


def wire_bytes_of_epoch(layout: dict[str, int], world: int, rank: int, rounds: int, sync_dtype: str) -> int:
    """Bytes one rank moves in `rounds` calls: each piece and reduced slice is one blob."""
    def blob(n):
        return len(encode_tensors(encode_flat({"float64": torch.zeros(n, dtype=torch.float64)}, sync_dtype)))
    total = sum(layout.values())
    sizes = [len(t) for t in torch.tensor_split(torch.zeros(total), world)]
    up = sum(blob(sizes[j]) for j in range(world) if j != rank) + blob(sizes[rank])
    down = (world - 1) * blob(sizes[rank]) + sum(blob(sizes[j]) for j in range(world) if j != rank)
    return rounds * (up + down)


@pytest.mark.parametrize("sync_dtype", ["bfloat16", "int8"])
def test_compressed_syncs_move_the_bytes_of_their_dtype_and_track_float32(tmp_path, sync_dtype):
    store = DirectoryStore(tmp_path)
    worlds = stage(store, "f", WORLD, 1)
    full = run_engine(store, "f", worlds, PERIOD)[0]
    stage(store, "c", WORLD, 1)
    comp = run_engine(store, "c", worlds, PERIOD, SyncSpec(sync_dtype=sync_dtype))[0]
    model = build_model(MODEL, 0).double()
    layout = {n: p.numel() for n, p in model.named_parameters()}
    rounds = -(-STEPS // PERIOD)
    n_values = 2 * sum(layout.values())  # weights and the momentum buffers
    for r in range(WORLD):
        assert comp[r].bytes_synced == wire_bytes_of_epoch({"all": n_values}, WORLD, r, rounds, sync_dtype)
        assert full[r].bytes_synced == wire_bytes_of_epoch({"all": n_values}, WORLD, r, rounds, "float32")
    ratio = sum(r.bytes_synced for r in comp) / sum(r.bytes_synced for r in full)
    # float64 here: int8 is 1/8 of it plus the scales, bfloat16 1/4
    assert ratio < (0.14 if sync_dtype == "int8" else 0.26), ratio
    w_full, w_comp = load(store, "runs/f/ckpt/e0")[0], load(store, "runs/c/ckpt/e0")[0]
    for n in w_full:
        assert (w_full[n] - w_comp[n]).abs().max() < 1e-3 * max(1.0, w_full[n].abs().max())
        if w_full[n].dim() > 1:
            assert not torch.equal(w_full[n], w_comp[n])
    meta = read_checkpoint_meta(store, "runs/c/ckpt/e0")
    last = rounds - 1
    assert meta["sync_dtype"] == sync_dtype
    assert meta["residual_keys"] == [f"runs/c/ckpt/residual/e0/r{r}/round{last}.safetensors" for r in range(WORLD)]
    assert all(store.list(f"runs/c/ckpt/residual/e0/r{r}/") == [meta["residual_keys"][r]] for r in range(WORLD))
    assert any(read_residual(store, k)["float64"].abs().max() > 0 for k in meta["residual_keys"])


def test_the_next_epoch_continues_the_residuals_and_a_rescale_owes_the_same(tmp_path, monkeypatch):
    store = DirectoryStore(tmp_path)
    worlds = stage(store, "r", 2, 1)
    started: dict = {}
    begin = Compressor.begin

    def record(self, flat, world):
        started.setdefault(id(self), {d: v.clone() for d, v in self.residual.items()})
        begin(self, flat, world)

    monkeypatch.setattr(Compressor, "begin", record)
    run_engine(store, "r", worlds, PERIOD, SyncSpec(sync_dtype="int8"))
    before = [read_residual(store, k) for k in read_checkpoint_meta(store, "runs/r/ckpt/e0")["residual_keys"]]
    started.clear()
    init_world = 4
    # epoch 1 with 4 replicas, from epoch 0's checkpoint
    wspecs = [WorkerSpec(run_id="r", epoch=1, rank=r, world=init_world, store_url=store.url, model=MODEL,
                         dataset=DATA, steps=epoch_steps(N, init_world, BATCH), batch_size=BATCH, lr=LR,
                         optimizer=OPT, sync_period=PERIOD, seed=SEED, init_key="runs/r/ckpt/e0",
                         out_key="runs/r/ckpt/e1", evaluate=False, sync_timeout_s=60,
                         compute=ComputeSpec(dtype="float64"), sync=SyncSpec(sync_dtype="int8"))
              for r in range(init_world)]
    with ThreadPoolExecutor(init_world) as pool:
        results = list(pool.map(lambda s: run_local_sgd_epoch(s, store), wspecs))
    assert len(results) == 4 and len(started) == 4
    owed_before = pending(before)["float64"]
    assert owed_before.abs().max() > 0
    # each new rank started with its own quarter of what the two old ranks still owed, zeros
    # elsewhere: together exactly the update owed
    new = [r["float64"] for r in started.values()]
    slices = [[bool(part.any()) for part in torch.tensor_split(r, 4)] for r in new]
    assert sorted(map(tuple, slices)) == sorted(tuple(i == k for i in range(4)) for k in range(4))
    torch.testing.assert_close(sum(new), owed_before, rtol=0, atol=1e-15)


def test_bad_outer_settings_are_refused_naming_the_field():
    with pytest.raises(ZooidValueError, match="sync.outer_optimizer"):
        SyncSpec(outer_optimizer="adam")
    with pytest.raises(ZooidValueError, match="sync.sync_dtype"):
        SyncSpec(sync_dtype="int4")
    with pytest.raises(ZooidValueError, match="sync.outer_momentum"):
        SyncSpec(outer_momentum=1.0)
    with pytest.raises(ZooidValueError, match="sync.outer_lr"):
        SyncSpec(outer_lr=0)
    with pytest.raises(ZooidValueError, match="sync_dtype"):
        Compressor("fp8")


@pytest.mark.parametrize("collective", [allreduce_mean, pipelined_allreduce_mean])
@pytest.mark.parametrize("dies", ["before_its_mean", "after_its_mean"])
def test_a_rank_relaunched_inside_a_compressed_round_leaves_results_and_residuals_as_without_the_fault(dies, collective):
    world = 3
    gen = torch.Generator().manual_seed(5)
    inputs = [[{"w": torch.randn(3000, generator=gen, dtype=torch.float64)} for _ in range(world)] for _ in range(2)]

    def run(fault: bool):
        store = MemoryStore()
        comps = [Compressor("int8") for _ in range(world)]
        saved = {}  # rank 1's residual after round 0, as the engine persists it (engine.residuals)

        def rank(r, round_):
            prefix = f"g/r{round_}"
            if not (fault and r == 1 and round_ == 1):
                return collective(store, prefix, r, world, inputs[round_][r], 20, compressor=comps[r],
                                  previous_prefix=f"g/r{round_ - 1}" if round_ else None)
            when = ((lambda op, key: op == "put" and key == f"{prefix}/mean-1") if dies == "before_its_mean"
                    else (lambda op, key: op == "get" and key == f"{prefix}/mean-0"))
            with pytest.raises(Died):
                collective(DyingStore(store, when), prefix, 1, world, inputs[round_][1], 20, compressor=comps[1],
                           previous_prefix=f"g/r{round_ - 1}")
            # the relaunch: its residual is the one persisted in round 0
            comps[1] = Compressor("int8", residual=saved["round0"])
            return collective(store, prefix, 1, world, inputs[round_][1], 20, compressor=comps[1],
                              previous_prefix=f"g/r{round_ - 1}", replay=True)

        outs = []
        with ThreadPoolExecutor(world) as pool:
            for round_ in range(2):
                outs.append(list(pool.map(lambda r: rank(r, round_), range(world))))
                saved.setdefault("round0", {d: v.clone() for d, v in comps[1].residual.items()})
        return outs, [c.residual["float64"] for c in comps]

    clean, faulty = run(False), run(True)
    for a, b in zip(clean[0], faulty[0]):
        for x, y in zip(a, b):
            assert torch.equal(x["w"], y["w"])
    for a, b in zip(clean[1], faulty[1]):
        assert torch.equal(a, b)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("chaos,victim,resume_step,every", [
    ("kill_worker:epoch=0:rank=1:step=4", 1, 3, 1),          # mid-round
    ("kill_worker:epoch=0:rank=0:step=6:at=sync", 0, 6, 1),  # right after a sync
    # checkpoints every 2 of the 3 rounds (steps 6 and 9): round 0's is not written, so the
    # relaunch starts at the epoch's start and replays it, its residual as every rank's was
    ("kill_worker:epoch=0:rank=1:step=4", 1, 0, 2),
    ("kill_worker:epoch=0:rank=0:step=8", 0, 6, 2),          # after round 1's checkpoint
])
def test_a_replaced_worker_leaves_weights_and_outer_state_as_without_the_fault(tmp_path, chaos, victim, resume_step,
                                                                              every):
    """DiLoCo with int8 syncs, replicas as processes: one is killed and relaunched from the
    sync checkpoint (written every round, or every `every` rounds as the coordinator sets a
    compressed sync's cadence); weights, outer momentum and every rank's residual end as in the
    fault-free run (processes too, one thread each, so the sums are the same bits)."""
    from engine.chaos import read_fault_marker
    from engine.local_sgd_epoch import read_epoch_history
    from tests.test_faults_engine import Coordinator, specs, stage, wait_for_sync_checkpoint

    sync = SyncSpec(outer_optimizer="nesterov", outer_lr=0.7, outer_momentum=0.9, sync_dtype="int8",
                    checkpoint_every=every)

    def run(name, chaos_env):
        store = DirectoryStore(tmp_path / name)
        stage(store, "k")
        worker_specs = specs(store.url, "k", sync=sync)
        (tmp_path / f"logs-{name}").mkdir()
        coordinator = Coordinator(tmp_path / f"logs-{name}", chaos_env)
        try:
            for spec in worker_specs:
                coordinator.launch(spec)
            if chaos_env:
                assert coordinator.wait(victim, 0) != 0
                assert read_fault_marker(store, "k", 0, victim, 0)["kind"] == "kill_worker"
                wait_for_sync_checkpoint(store, "k", resume_step)
                coordinator.launch(WorkerSpec.from_dict({**worker_specs[victim].to_dict(), "attempt": 1}))
                assert coordinator.wait(victim, 1) == 0, coordinator.output(victim, 1)
                assert coordinator.wait(1 - victim, 0) == 0, coordinator.output(1 - victim, 0)
                relaunch = next(h for h in read_epoch_history(store, "k", 0) if h["attempt"] == 1)
                assert relaunch["start_step"] == resume_step
            else:
                assert [coordinator.wait(r, 0) for r in range(2)] == [0, 0]
        finally:
            coordinator.stop_all()
        model = build_model("digits_mlp", 0).double()
        extra: dict = {}
        meta = load_checkpoint(store, "runs/k/ckpt/e0", model, extra=extra)
        residuals = [read_residual(store, k)["float64"] for k in meta["residual_keys"]]
        return model.state_dict(), extra, residuals

    clean, faulty = run("clean", ""), run("faulty", chaos)
    assert clean[1] and clean[1].keys() == faulty[1].keys()
    for a, b in zip(clean[:2], faulty[:2]):
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-12, atol=1e-12)
    for x, y in zip(clean[2], faulty[2]):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)


def test_hybrid_compressed_gradient_syncs_owe_nothing_when_the_epoch_ends(tmp_path, monkeypatch):
    """Hybrid 2 x 2 with int8 gradient syncs: fewer bytes, weights near the float32 run, and
    every stage's residual exactly zero at the end (its last sync is lossless with the
    residual added), so an epoch rerun after a failure starts as the first attempt did."""
    import dataclasses

    from comm.store import open_store
    from engine.pipeline_executor import pipeline_worker_specs, run_pipeline_worker
    from tests.test_pipeline_equivalence import BATCH as PIPE_BATCH
    from tests.test_pipeline_equivalence import RUN, base_spec, run_threads, weights

    data = "synthetic:64:10:768:64"  # 12 steps of 2 replicas x 32 rows

    url = (tmp_path / "store").as_uri()
    store = open_store(url)
    publish_dataset(store, RUN, data, subset_size=64)
    initial_checkpoint(store, f"runs/{RUN}/init", "digits_mlp", "sgd", 0.2, seed=3)
    made: list[Compressor] = []
    init = Compressor.__init__

    def record(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(Compressor, "__init__", record)
    runs = {}
    for sync_dtype in ("float32", "int8", "int8"):
        out = f"runs/{RUN}/h-{sync_dtype}-{len(runs)}"
        base = dataclasses.replace(base_spec(url, 2, out), dataset=data, steps=epoch_steps(768, 2, PIPE_BATCH),
                                   sync=SyncSpec(collective="pipelined", sync_dtype=sync_dtype))
        results = run_threads(pipeline_worker_specs(base, cuts=[1], microbatches=2, replicas=2),
                              run_pipeline_worker)
        runs[out] = (sync_dtype, sum(r.bytes_synced for r in results), weights(url, out))
    (_, b32, w32), (_, b8, w8), (_, _, w8_again) = runs.values()
    assert len(made) == 2 * 4  # two int8 runs of 4 workers, one stage each
    assert all(float(v.abs().max()) == 0.0 for c in made for v in c.residual.values())
    assert b8 < 0.25 * b32, (b8, b32)
    for k in w32:
        assert (w32[k] - w8[k]).abs().max() < 1e-2 and not torch.equal(w32[k], w8[k])
        assert torch.equal(w8[k], w8_again[k])


@pytest.mark.parametrize("fields,field", [
    ({"outer_optimizer": "adam"}, "outer_optimizer"),
    ({"outer_lr": 0}, "outer_lr"),
    ({"outer_lr": float("nan")}, "outer_lr"),
    ({"outer_momentum": 1.0}, "outer_momentum"),
    ({"outer_momentum": -0.1}, "outer_momentum"),
    ({"sync_dtype": "int4"}, "sync_dtype"),
    ({"outer_optimizer": "nesterov", "strategy": "hybrid"}, "outer_optimizer"),
    ({"sync_dtype": "int8", "collective": "ring"}, "sync_dtype"),
    ({"sync_dtype": "int8", "optimizer": "adam"}, "sync_dtype"),
])
def test_a_job_with_bad_outer_settings_is_refused_in_one_line_naming_the_field(fields, field):
    from pydantic import ValidationError

    from coordinator.run.job import TrainJob, format_validation_error

    with pytest.raises(ValidationError) as err:
        TrainJob(**fields)
    line = format_validation_error(err.value)
    assert line.startswith(f"{field}:") and "\n" not in line, line


def test_a_job_s_outer_settings_reach_every_replica_s_spec():
    from types import SimpleNamespace

    from coordinator.run.job import TrainJob
    from coordinator.workers.worker_specs import worker_specs
    from core.plan import Plan

    job = TrainJob(outer_optimizer="nesterov", outer_lr=0.5, outer_momentum=0.8, sync_dtype="bfloat16", workers=2)
    ctx = SimpleNamespace(job=job, run_id="s", store_ref="file:///tmp/x", durable_ref="file:///tmp/x",
                          resolved=SimpleNamespace(target=SimpleNamespace(remote=False), model_kwargs={}),
                          state=SimpleNamespace(dataset={"n_subsets": 8, "n_train": 96}, attempts={}))
    plan = Plan(strategy="local_sgd", data_parallel=2, steps_per_epoch=3, batch_size=16)
    specs = worker_specs(ctx, plan, 0, "init", 0.05, 0)
    assert [(s.sync.outer_optimizer, s.sync.outer_lr, s.sync.outer_momentum, s.sync.sync_dtype) for s in specs] \
        == [("nesterov", 0.5, 0.8, "bfloat16")] * 2
    assert all(WorkerSpec.from_dict(s.to_dict()) == s for s in specs)


def test_a_worker_refuses_int8_syncs_of_adam_before_training(tmp_path):
    store = DirectoryStore(tmp_path)
    spec = WorkerSpec(run_id="a", epoch=0, rank=0, world=2, store_url=store.url, model=MODEL, dataset="digits",
                      steps=3, batch_size=BATCH, lr=LR, optimizer="adam", sync_period=1, seed=0,
                      init_key="runs/a/ckpt/init", out_key="runs/a/ckpt/e0", sync=SyncSpec(sync_dtype="int8"))
    with pytest.raises(ZooidValueError, match="sync.sync_dtype"):
        run_local_sgd_epoch(spec, store)
    assert store.list("runs/") == []


def test_pruning_keeps_the_residuals_of_the_checkpoints_it_keeps(tmp_path):
    from coordinator.workers.retention import prune_checkpoints

    store, run = DirectoryStore(tmp_path), "prune"
    for epoch in range(4):
        store.put(f"runs/{run}/ckpt/epoch-{epoch:04d}.safetensors", b"x")
        for rank in range(2):
            store.put(f"runs/{run}/ckpt/residual/e{epoch}/r{rank}/round5.safetensors", b"x")
    prune_checkpoints(store, run, latest_epoch=2, keep=1, best={"epoch": 0})
    # epoch 2 (the last), 0 (the best) and 3 (still running) keep both ranks' residuals; 1 loses them
    assert store.list(f"runs/{run}/ckpt/residual/") == [
        f"runs/{run}/ckpt/residual/e{e}/r{r}/round5.safetensors" for e in (0, 2, 3) for r in (0, 1)]
    assert not store.exists(f"runs/{run}/ckpt/epoch-0001.safetensors")


class _ConvBN(torch.nn.Module):
    """Conv + BatchNorm + a linear head: parameters, float buffers and an int buffer."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 8, 3)
        self.bn = torch.nn.BatchNorm2d(8)
        self.head = torch.nn.Linear(8 * 6 * 6, 10)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.conv(x))).flatten(1))


# running_var at the round's start and on each replica when it syncs: values near zero
# beside large ones in one tensor (and one int8 block), the small ones falling towards zero
_VAR_START = [5.0, 1e-6, 1000.0, 2.0, 0.5, 3e-4, 1.0, 7.0]
_VAR_AT_SYNC = [[1e-3, 0.0, 2000.0, 1e-5, 0.0, 0.0, 1e-7, 3.0],
                [2e-3, 1e-7, 1500.0, 0.0, 1e-6, 2e-7, 0.0, 4.0]]


@pytest.mark.parametrize("collective", [allreduce_mean, pipelined_allreduce_mean])
@pytest.mark.parametrize("sync_dtype,outer", [("int8", "average"), ("int8", "nesterov"), ("bfloat16", "average")])
def test_compressed_syncs_send_batch_norm_buffers_exactly(collective, sync_dtype, outer):
    """A compressed Local-SGD sync rounds parameters and optimizer state, never the
    batch-norm statistics: running_var comes back as the exact mean of the replicas'
    (so >= 0), num_batches_tracked keeps its dtype and value, and no residual is owed there."""
    from engine.local_sgd import LocalSGD
    from engine.outer import OuterStep

    world, store = 2, MemoryStore()
    models, syncs, at_sync = [], [], []
    for rank in range(world):
        torch.manual_seed(0)
        model = _ConvBN()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model(torch.randn(4, 1, 8, 8)).square().mean().backward()
        opt.step()                                      # momentum buffers: optimizer state to sync
        with torch.no_grad():
            model.bn.running_var.copy_(torch.tensor(_VAR_START))
            model.bn.num_batches_tracked.fill_(7)
        # the engine's wiring of a compressed sync (engine.local_sgd_epoch._outer_and_wire)
        outer_step = OuterStep(outer, 0.7 if outer == "nesterov" else 1.0, 0.9 if outer == "nesterov" else 0.0,
                               deltas=True)
        syncs.append(LocalSGD(model, opt, store, "g", rank, world, period=None, timeout=30, allreduce=collective,
                              outer=outer_step, compressor=Compressor(sync_dtype)))
        gen = torch.Generator().manual_seed(10 + rank)
        with torch.no_grad():                           # the round's inner steps, as their result
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
            model.bn.running_var.copy_(torch.tensor(_VAR_AT_SYNC[rank]))
            model.bn.running_mean.copy_(torch.randn(8, generator=gen) * 100)
        at_sync.append({n: t.detach().clone() for n, t in model.state_dict().items()})
        models.append(model)
    with ThreadPoolExecutor(world) as pool:
        list(pool.map(lambda s: s.sync(), syncs))

    for model in models:
        assert (model.bn.running_var >= 0).all(), model.bn.running_var
    for name in ("bn.running_var", "bn.running_mean"):
        exact = torch.stack([s[name] for s in at_sync]).mean(0)
        for model in models:
            assert torch.equal(model.state_dict()[name], exact), name   # travelled exactly
    for model in models:
        tracked = model.bn.num_batches_tracked
        assert tracked.dtype == torch.int64 and int(tracked) == 7
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), models[0].state_dict().values()))
    # the parameters still travelled compressed: rounded, and the rounding owed as residual
    weight = torch.stack([s["conv.weight"] for s in at_sync]).mean(0)
    if outer == "average":
        assert not torch.equal(models[0].conv.weight.detach(), weight)
        assert (models[0].conv.weight.detach() - weight).abs().max() < 0.05
    for s in syncs:
        mask, residual = s.compressor.exact["float32"], s.compressor.residual["float32"]
        assert int(mask.sum()) == 16                    # running_mean and running_var
        assert residual[mask].abs().max() == 0 and residual[~mask].abs().max() > 0
    # in eval mode the model normalises with the synced statistics: finite outputs
    models[0].eval()
    assert torch.isfinite(models[0](torch.randn(2, 1, 8, 8))).all()
