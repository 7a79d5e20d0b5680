"""Issue 42, items 2 and 6: language models against their data, checked before anything is rented.

The model is built with the arguments the dataset decides (`vocab_size`, `mask_token_id`) and
checked on `meta` or with one row on the CPU: integer inputs are fed as token ids; outputs
that cannot be scored against the targets, a token id at or above the embedding's size, a
`seq_len` above the model's positions, and `mlm` with a model that has no mask token are each
refused in one line naming the field. A model whose parameter two children share (tied
embeddings) is refused as a pipeline, naming the parameter, and trains as Local-SGD.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from comm.store import open_store
from coordinator.run.job import TrainJob
from core.errors import ZooidValueError
from core.shared_parameters import split_shared
from core.specs import ComputeSpec, WorkerSpec
from engine.checkpoint import initial_checkpoint
from engine.datasets import publish_dataset
from engine.local_sgd_epoch import run_local_sgd_epoch
from engine.models import build_model, dataset_model_kwargs
from engine.stages import shared_parameters, split_stages
from engine.transformers import bert_mini, gpt_mini
from tests import lm_helpers
from tests.test_pipeline_equivalence import run_threads, weights

SEQ = 64

# --- datasets and models given by import path in these tests ------------------------------------


def _bytes(n: int, seed: int, seq: int = SEQ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(32, 127, (n * seq + 1,), generator=g)  # printable bytes
    windows = text.unfold(0, seq + 1, seq)[:n]
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def byte_windows():
    """Byte windows of 64 and their next bytes (ids below 127): the issue's example data."""
    return _bytes(64, 0), _bytes(16, 1)


def long_windows():
    """Byte windows of 200: longer than gpt_mini's 128 positions."""
    return _bytes(32, 0, 200), _bytes(8, 1, 200)


def one_label_per_window():
    """Byte windows labelled by one class each ([N] targets): a classifier's data."""
    (x, y), (vx, vy) = byte_windows()
    return (x, y[:, 0] % 4), (vx, vy[:, 0] % 4)


def issue_lm():
    """The issue's new user: a small causal transformer of a fixed vocabulary (no `vocab_size`
    argument), given by import path."""
    return gpt_mini(vocab_size=128, max_positions=SEQ)


def small_vocab_lm():
    """A causal transformer whose embedding holds 100 tokens, whatever the data."""
    return gpt_mini(vocab_size=100)


def window_classifier():
    """Token windows -> one class per window: outputs [B, C], which token targets cannot score."""
    return torch.nn.Sequential(torch.nn.Embedding(128, 8), torch.nn.Flatten(), torch.nn.Linear(8 * SEQ, 128))


def other_mask_bert():
    """A masked LM whose mask token is 5, whatever the tokenizer's."""
    return bert_mini(mask_token_id=5)


def tied_gpt(vocab_size: int = 258, max_positions: int = 128, d_model: int = 64, heads: int = 4):
    """gpt_mini with its head tied to its token embedding (children 0 and 4 share one weight)."""
    return gpt_mini(vocab_size=vocab_size, max_positions=max_positions, d_model=d_model, heads=heads,
                    tie_embeddings=True)


HERE = "tests.test_lm_refusals"


def _validate(tmp_path, **params):
    from coordinator.run.validate import validate_job

    return validate_job(TrainJob(store=f"file://{tmp_path}/store", batch_size=8, **params))


def _refused(tmp_path, field: str, **params) -> str:
    with pytest.raises(ZooidValueError) as err:
        _validate(tmp_path, **params)
    message = str(err.value)
    assert err.value.field == field and message.startswith(f"{field}: ") and "\n" not in message, message
    assert not (tmp_path / "store" / "runs").exists()  # nothing staged, nothing rented
    return message


# --- the model's arguments follow the dataset ------------------------------------------------


def test_the_issues_causal_lm_is_no_longer_refused_its_token_ids(tmp_path):
    """The issue's example (`Expected tensor for argument #1 'indices' ... got torch.FloatTensor`):
    integer inputs are token ids, fed as int64, and [B, T, V] outputs score [B, T] targets."""
    resolved = _validate(tmp_path, model=f"{HERE}:issue_lm", dataset=f"{HERE}:byte_windows")
    assert resolved.input_shape == (SEQ,) and resolved.model_kwargs == {}  # it takes no vocab_size
    assert resolved.shared_parameters == ()


@pytest.mark.parametrize("model", ["gpt_mini", "bert_mini", "gpt2_small", "bert_large"])
def test_registry_lms_are_built_with_the_datas_vocabulary(tmp_path, model, monkeypatch):
    """The factories take the data's vocabulary (the largest id plus one); the large models are
    checked on `meta`: nothing builds them on the CPU."""
    import engine.models

    def no_cpu_build(*args, **kwargs):
        raise AssertionError("validation built a model on the CPU")

    monkeypatch.setattr(engine.models, "build_model", no_cpu_build)
    resolved = _validate(tmp_path, model=model, dataset=f"{HERE}:byte_windows",
                         **({"strategy": "pipeline", "workers": 2} if model == "bert_large" else {}))
    assert resolved.model_kwargs == {"vocab_size": 127}


def test_the_dataset_decides_vocab_and_mask_from_its_text_info_else_its_ids():
    (x, y), (vx, vy) = byte_windows()
    ids = SimpleNamespace(train_x=x, train_y=y, val_x=vx, val_y=vy.masked_fill(vy > 120, -100), text=None)
    assert dataset_model_kwargs(ids) == {"vocab_size": int(max(x.max(), y.max(), vx.max())) + 1}
    info = SimpleNamespace(vocab_size=300, mask_id=299, tokenizer="bpe:300", objective="mlm")
    assert dataset_model_kwargs(SimpleNamespace(**{**vars(ids), "text": info})) == {"vocab_size": 300,
                                                                                   "mask_token_id": 299}
    floats = SimpleNamespace(train_x=x.float(), train_y=y, val_x=vx.float(), val_y=vy, text=None)
    assert dataset_model_kwargs(floats) == {}


def test_workers_the_profile_and_the_initial_checkpoint_get_the_model_kwargs(tmp_path):
    from coordinator.plan.target_profile import profile_request
    from coordinator.run.context import RunContext
    from coordinator.workers.worker_specs import worker_specs
    from core.plan import Plan

    job = TrainJob(model="gpt_mini", dataset=f"{HERE}:byte_windows", batch_size=8, workers=2,
                   store=f"file://{tmp_path}/store")
    from coordinator.run.validate import validate_job

    ctx = RunContext(run_id="zlmkw", job=job, resolved=validate_job(job))
    ctx.state.dataset = {"n_subsets": 4, "n_train": 32}
    specs = worker_specs(ctx, Plan(strategy="local_sgd", data_parallel=2, steps_per_epoch=2, batch_size=8),
                         0, "init", 0.1, 0)
    assert [s.compute.model_kwargs for s in specs] == [{"vocab_size": 127}] * 2
    assert all(WorkerSpec.from_dict(s.to_dict()) == s for s in specs)
    assert profile_request(ctx, model_profile=True, store_probe=False).model_kwargs == {"vocab_size": 127}
    store = open_store(f"file://{tmp_path}/store")
    initial_checkpoint(store, "runs/zlmkw/init", "gpt_mini", "sgd", 0.1, model_kwargs=ctx.resolved.model_kwargs)
    assert weights(f"file://{tmp_path}/store", "runs/zlmkw/init")["model/0.tok.weight"].shape == (127, 64)


# --- refused in one line naming the field -------------------------------------------------------


def test_a_token_id_at_or_above_the_embedding_is_refused_naming_dataset(tmp_path):
    message = _refused(tmp_path, "dataset", model=f"{HERE}:small_vocab_lm", dataset=f"{HERE}:byte_windows")
    assert "token id 126 is at or above" in message and "embedding of 100 tokens" in message


def test_a_tokenizers_id_above_the_embedding_is_refused_naming_tokenizer():
    from engine.fit import fit_model

    (x, y), (vx, vy) = byte_windows()
    info = SimpleNamespace(vocab_size=127, mask_id=None, tokenizer="bpe:127", objective="causal")
    data = SimpleNamespace(train_x=x, train_y=y, val_x=vx, val_y=vy, text=info)
    with pytest.raises(ZooidValueError, match=r"^tokenizer: bpe:127 gives token ids up to 126 \(127 tokens\), "
                                              r"at or above .*embedding of 100") as err:
        fit_model(f"{HERE}:small_vocab_lm", "digits", data, 127)
    assert "\n" not in str(err.value)


def test_seq_len_above_the_models_positions_is_refused_naming_seq_len(tmp_path):
    message = _refused(tmp_path, "seq_len", model="gpt_mini", dataset=f"{HERE}:long_windows")
    assert "200 tokens per sample are above gpt_mini's 128 positions" in message


def test_outputs_that_cannot_score_the_targets_are_refused_naming_model(tmp_path):
    message = _refused(tmp_path, "model", model="gpt_mini", dataset=f"{HERE}:one_label_per_window")
    assert "gives outputs of shape 1x64x127 for 1 row(s), not 1 x classes" in message
    message = _refused(tmp_path, "model", model=f"{HERE}:window_classifier", dataset=f"{HERE}:byte_windows")
    assert "gives outputs of shape 1x128 for targets of shape 1x64, which cannot be scored together" in message
    assert "a sample is 64, targets 64 of 127 token ids" in message
    assert "registry models that fit" in message and "gpt_mini" in message and "bert_mini" in message


def test_mlm_with_a_model_without_a_mask_token_is_refused_naming_objective():
    from engine.fit import fit_model

    (x, y), (vx, vy) = byte_windows()
    info = SimpleNamespace(vocab_size=258, mask_id=257, tokenizer="bytes", objective="mlm")
    data = SimpleNamespace(train_x=x, train_y=y, val_x=vx, val_y=vy, text=info)
    with pytest.raises(ZooidValueError, match=r"^objective: mlm masks tokens, and gpt_mini has no mask token .*"
                                              r"bert_mini, bert_base, bert_large"):
        fit_model("gpt_mini", "digits", data, 258, objective="mlm")
    fit = fit_model("bert_mini", "digits", data, 258, objective="mlm")
    assert fit.model_kwargs == {"vocab_size": 258, "mask_token_id": 257} and fit.shared_parameters == ()
    with pytest.raises(ZooidValueError, match=r"^objective: mlm: .*other_mask_bert's mask token is 5, bytes's is 257"):
        fit_model(f"{HERE}:other_mask_bert", "digits", data, 258, objective="mlm")


def test_mlm_on_the_shipped_corpus_through_validation(tmp_path):
    pytest.importorskip("engine.text_data")
    params = {"dataset": "text:stdlib:40", "objective": "mlm", "seq_len": 32}
    message = _refused(tmp_path, "objective", model="gpt_mini", **params)
    assert "gpt_mini has no mask token" in message
    resolved = _validate(tmp_path, model="bert_mini", **params)
    assert resolved.model_kwargs == {"vocab_size": 258, "mask_token_id": 257}
    assert "positions" in _refused(tmp_path, "seq_len", model="bert_mini", **{**params, "seq_len": 256})


# --- tied weights: refused as a pipeline, trained as Local-SGD -----------------------------------


def test_a_parameter_shared_between_stages_is_found_and_refused_where_it_is_split():
    model = tied_gpt()
    assert shared_parameters(model) == (("0.tok.weight", (0, 4)),)
    assert shared_parameters(gpt_mini()) == ()
    with pytest.raises(ZooidValueError, match=r"^model: parameter '0.tok.weight' is shared by children 0 and 4, "
                                              r"which stages 1 and 2 would hold; .*strategy=local_sgd"):
        split_stages(model, [2])
    assert split_shared((("w", (1, 2)),), [1, 3], 5) is None  # both holders on stage 2
    assert "stages 2 and 3" in split_shared((("w", (1, 3)),), [1, 3], 5)


@pytest.mark.parametrize("strategy", ["pipeline", "hybrid"])
def test_a_tied_gpt_pipelined_is_refused_naming_the_shared_parameter(tmp_path, strategy):
    message = _refused(tmp_path, "model", model=f"{HERE}:tied_gpt", dataset=f"{HERE}:byte_windows",
                       strategy=strategy, workers=2)
    assert message.startswith(f"model: {HERE}:tied_gpt: parameter '0.tok.weight' is shared by children 0 and 4, "
                              "which the first and the last stage of every pipeline would hold")


def test_a_tied_gpt_is_planned_as_local_sgd_under_auto(tmp_path, monkeypatch):
    """Validation records the shared parameter; the planner, which picks a 2 x 2 hybrid for
    the same profile without it, then plans Local-SGD."""
    import coordinator.plan.planning
    from blocks.compute import ComputeTarget
    from tests.test_co_optimizer_in_plan import context, profile

    resolved = _validate(tmp_path, model=f"{HERE}:tied_gpt", dataset=f"{HERE}:byte_windows", workers=2)
    assert resolved.shared_parameters == (("0.tok.weight", (0, 4)),)
    monkeypatch.setattr(coordinator.plan.planning, "with_run", lambda ctx, chosen, calibration, epochs_left, **kw: chosen)
    job = TrainJob(strategy="auto", workers=4, batch_size=8, microbatches=2)
    ctx = context(job, ComputeTarget(kind="aci", offer="aci-cpu", worker_memory_gb=2.0))
    untied = coordinator.plan.planning.make_plan(ctx, profile(), 4)
    assert (untied.strategy, untied.data_parallel, untied.stages) == ("hybrid", 2, 2)
    ctx.resolved.shared_parameters = resolved.shared_parameters
    tied = coordinator.plan.planning.make_plan(ctx, profile(), 4)
    assert (tied.strategy, tied.data_parallel, tied.stages) == ("local_sgd", 4, 1)


def test_a_tied_gpt_trains_as_local_sgd_and_stays_tied(tmp_path):
    """Two replicas averaging every 2 steps, twice: the loss falls, and the tied weight is one
    tensor in every checkpoint (its two names hold equal values) and in the rebuilt model."""
    url = (tmp_path / "store").as_uri()
    store = open_store(url)
    publish_dataset(store, "tied", "tests.lm_helpers:token_data", subset_size=32)
    kwargs = {"vocab_size": lm_helpers.VOCAB, "max_positions": lm_helpers.SEQ, "d_model": 16, "heads": 2}
    initial_checkpoint(store, "runs/tied/e-1", f"{HERE}:tied_gpt", "adam", 0.01, seed=0, model_kwargs=kwargs)
    losses = []
    for epoch in range(2):
        specs = [WorkerSpec(run_id="tied", epoch=epoch, rank=r, world=2, store_url=url, model=f"{HERE}:tied_gpt",
                            dataset="tests.lm_helpers:token_data", steps=12, batch_size=16,
                            lr=0.01, optimizer="adam", sync_period=2, seed=0, init_key=f"runs/tied/e{epoch - 1}",
                            out_key=f"runs/tied/e{epoch}", compute=ComputeSpec(model_kwargs=kwargs))
                 for r in range(2)]
        [rank0, _] = run_threads(specs, run_local_sgd_epoch)
        losses.append(rank0.val_loss)
        trained = weights(url, f"runs/tied/e{epoch}")
        assert torch.equal(trained["model/0.tok.weight"], trained["model/4.weight"])
    assert losses[1] < losses[0]
    model = build_model(f"{HERE}:tied_gpt", 0, **kwargs)
    model.load_state_dict({k.removeprefix("model/"): v for k, v in trained.items()})
    assert model[4].weight is model[0].tok.weight
