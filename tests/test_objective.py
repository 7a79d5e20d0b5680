"""The loss and the metrics (`engine.objective`): cross-entropy over the output's last dimension,
-100 positions ignored, sums that micro-batch to the whole batch's mean, the custom `loss` field,
and the dataset staging that keeps token ids and token targets as they are."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from core.errors import ZooidValueError
from engine.datasets import load_dataset, publish_dataset
from engine.local_sgd import evaluate, validation_metrics
from engine.objective import (
    CROSS_ENTROPY,
    IGNORE_INDEX,
    Objective,
    Tally,
    objective_for,
    resolve_loss,
    shapes_problem,
    target_classes,
)
from tests import lm_helpers


def test_class_targets_score_as_todays_cross_entropy():
    g = torch.Generator().manual_seed(0)
    out, y = torch.randn(32, 10, generator=g, dtype=torch.float64), torch.randint(0, 10, (32,), generator=g)
    assert CROSS_ENTROPY.loss(out, y) == F.cross_entropy(out, y)  # the same call, bit for bit
    assert CROSS_ENTROPY.loss_sum(out, y).item() == pytest.approx(F.cross_entropy(out, y, reduction="sum").item(),
                                                                  rel=1e-15)
    assert CROSS_ENTROPY.scored(y) == 32
    m = CROSS_ENTROPY.tally(out, y, Tally()).metrics()
    assert m.loss == pytest.approx(F.cross_entropy(out, y).item(), rel=1e-12)
    assert m.accuracy == (out.argmax(1) == y).double().mean().item()
    assert m.perplexity is None and m.token_accuracy is None


def test_token_targets_ignore_minus_100_and_report_perplexity_and_token_accuracy():
    g = torch.Generator().manual_seed(1)
    out = torch.randn(4, 6, 11, generator=g, dtype=torch.float64)
    y = torch.randint(0, 11, (4, 6), generator=g)
    y[0, :3] = y[2, 5] = IGNORE_INDEX
    keep = y != IGNORE_INDEX
    expected = F.cross_entropy(out[keep], y[keep])  # only the scored positions
    assert CROSS_ENTROPY.scored(y) == int(keep.sum()) == 20
    torch.testing.assert_close(CROSS_ENTROPY.loss(out, y), expected, rtol=1e-12, atol=0)
    # an ignored position's logits get no gradient
    out.requires_grad_(True)
    CROSS_ENTROPY.loss(out, y).backward()
    assert out.grad[0, :3].abs().sum() == 0 and out.grad[1].abs().sum() > 0
    m = CROSS_ENTROPY.tally(out.detach(), y, Tally()).metrics()
    assert m.loss == pytest.approx(expected.item(), rel=1e-12)
    assert m.perplexity == pytest.approx(math.exp(expected.item()), rel=1e-12)
    assert m.token_accuracy == (out.detach().argmax(-1)[keep] == y[keep]).double().mean().item()
    assert m.accuracy is None
    assert CROSS_ENTROPY.tokens(y) == 24 and CROSS_ENTROPY.tokens(y[:, 0]) == 0


def test_micro_batched_terms_sum_to_the_whole_batch_loss_and_gradient():
    """Rows with different counts of scored positions: each micro-batch divided by the whole
    batch's scored count sums to the batch's mean, its gradient too (a micro-batch's mean scaled
    by its share of rows would not)."""
    g = torch.Generator().manual_seed(2)
    out = torch.randn(8, 5, 7, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 7, (8, 5), generator=g)
    y[:3, :4] = IGNORE_INDEX  # the first micro-batch scores far fewer positions
    whole = CROSS_ENTROPY.loss(out, y)
    (full_grad,) = torch.autograd.grad(whole, out)
    n = CROSS_ENTROPY.scored(y)
    parts = [CROSS_ENTROPY.part_loss(out[i:i + 2], y[i:i + 2], n, 8) for i in range(0, 8, 2)]
    torch.testing.assert_close(sum(parts), whole, rtol=1e-13, atol=0)
    on_device = CROSS_ENTROPY.divisor(y)  # what the pipeline passes: no copy to the host per step
    assert isinstance(on_device, torch.Tensor) and int(on_device) == n
    torch.testing.assert_close(sum(CROSS_ENTROPY.part_loss(out[i:i + 2], y[i:i + 2], on_device, 8)
                                   for i in range(0, 8, 2)), whole, rtol=1e-13, atol=0)
    (part_grad,) = torch.autograd.grad(sum(parts), out)
    torch.testing.assert_close(part_grad, full_grad, rtol=1e-12, atol=1e-15)
    by_rows = sum(CROSS_ENTROPY.loss(out[i:i + 2], y[i:i + 2]) * 2 / 8 for i in range(0, 8, 2))
    assert abs(by_rows.item() - whole.item()) > 1e-3


def test_a_custom_loss_is_its_own_mean_split_by_rows():
    mse = objective_for("tests.lm_helpers:mse")
    out, y = torch.randn(6, 1, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    assert mse.kind(y) == "custom" and mse.scored(y) == 6 and mse.tokens(y) == 0
    torch.testing.assert_close(mse.loss(out, y), ((out.squeeze(-1) - y) ** 2).mean())
    parts = sum(mse.part_loss(out[i:i + 3], y[i:i + 3], mse.scored(y), 6) for i in (0, 3))
    torch.testing.assert_close(parts, mse.loss(out, y), rtol=1e-14, atol=0)
    m = mse.tally(out, y, Tally()).metrics()
    assert m.loss == pytest.approx(mse.loss(out, y).item()) and m.accuracy is None and m.perplexity is None


@pytest.mark.parametrize("path, words", [
    ("nomodule", "is not `package.module:function`"),
    ("os:system", "standard library"),
    ("tests.no_such_module:f", "cannot import"),
    ("tests.lm_helpers:nothing", "has no attribute"),
    ("tests.lm_helpers:VOCAB", "not a loss function"),
    ("tests.lm_helpers:TokenEmbedding", "not a loss function"),
])
def test_a_bad_loss_is_refused_naming_the_field(path, words):
    with pytest.raises(ZooidValueError, match=words) as info:
        resolve_loss(path)
    assert info.value.field == "loss"


def test_a_loss_that_returns_no_scalar_is_refused_when_it_runs():
    obj = Objective("tests.test_objective:per_sample")
    with pytest.raises(ZooidValueError, match="^loss: .* must return a scalar tensor"):
        obj.loss(torch.zeros(3, 2), torch.zeros(3, 2))


def per_sample(output, target):
    """Not a loss: one value per sample."""
    return ((output - target) ** 2).mean(1)


def test_shapes_that_cannot_be_scored_are_named():
    assert shapes_problem((4, 10), (4,), torch.int64) is None
    assert shapes_problem((4, 8, 50), (4, 8), torch.int64) is None
    assert "targets of shape 4x8" in shapes_problem((4, 50), (4, 8), torch.int64)
    assert "needs targets of shape 4x7" in shapes_problem((4, 7, 50), (4, 8), torch.int64)
    assert "integer targets" in shapes_problem((4, 1), (4,), torch.float32)


def test_target_classes_ignore_the_ignored_and_floats_have_none():
    assert target_classes(torch.tensor([0, 3, 1]), torch.tensor([2])) == 4
    assert target_classes(torch.tensor([[5, -100], [-100, 9]])) == 10
    assert target_classes(torch.randn(3)) == 0


def test_token_datasets_keep_int64_ids_and_their_target_shape(tmp_path):
    from comm.store import open_store

    data = load_dataset("tests.lm_helpers:masked_token_data")
    assert data.train_x.dtype == data.train_y.dtype == torch.int64
    assert data.train_x.shape == data.train_y.shape == (384, lm_helpers.SEQ)
    manifest = publish_dataset(open_store(tmp_path.as_uri()), "tok", "tests.lm_helpers:masked_token_data")
    assert manifest.classes == lm_helpers.VOCAB and manifest.input_shape == (lm_helpers.SEQ,)
    reg = load_dataset("tests.lm_helpers:regression_data")
    assert reg.train_x.dtype == torch.float32 and reg.train_y.dtype == torch.float32  # values stay values
    assert publish_dataset(open_store(tmp_path.as_uri()), "reg", "tests.lm_helpers:regression_data").classes == 0


def test_map_style_datasets_keep_each_items_target_shape():
    from engine.datasets import _as_tensors

    items = [(torch.tensor([1, 2, 3]), torch.tensor([2, 3, 4])) for _ in range(5)]
    x, y = _as_tensors(items, "train", "t")
    assert x.dtype == torch.int64 and y.shape == (5, 3)
    x, y = _as_tensors([(torch.zeros(4, dtype=torch.uint8), 3)] * 2, "train", "t")
    assert x.dtype == torch.float32 and y.tolist() == [3, 3]  # pixels as floats, labels as classes


def test_validation_of_a_classifier_is_as_before():
    from engine.models import build_model

    data = load_dataset("digits")
    model = build_model("digits_mlp", 0)
    loss, acc = evaluate(model, data.val_x, data.val_y, chunk=100)
    with torch.no_grad():
        logits = model(data.val_x)
    assert loss == pytest.approx(F.cross_entropy(logits, data.val_y).item(), rel=1e-6)
    assert acc == int((logits.argmax(1) == data.val_y).sum()) / len(data.val_y)
    m = validation_metrics(model, data.val_x, data.val_y)
    assert (m.loss, m.accuracy) == (loss, acc)


def strict(output, target):
    """A loss that insists on equal shapes."""
    assert output.shape == target.shape, f"{tuple(output.shape)} != {tuple(target.shape)}"
    return ((output - target) ** 2).mean()


@pytest.mark.parametrize("loss, error", [
    ("tests.lm_helpers:mse", None),
    ("tests.test_objective:per_sample", "must return a scalar tensor"),
    ("tests.test_objective:strict", r"failed on an output of shape 2x1 against a target of shape 2: AssertionError"),
    ("os.path:join", "standard library"),
])
def test_a_custom_loss_is_run_on_the_models_output_before_anything_is_rented(loss, error):
    from coordinator.run.job import TrainJob
    from engine.fit import check_loss

    job = TrainJob(model="tests.lm_helpers:tiny_regressor", dataset="tests.lm_helpers:regression_data", loss=loss)
    data = load_dataset(job.dataset)
    if error is None:
        check_loss(job.loss, job.model, data, seed=job.seed, model_kwargs={})
        return
    with pytest.raises(ZooidValueError, match=error) as info:
        check_loss(job.loss, job.model, data, seed=job.seed, model_kwargs={})
    assert info.value.field == "loss" and str(info.value).count("\n") == 0


def test_the_loss_is_computed_in_one_place():
    """Every strategy and metric scores through engine.objective; profiling.sample's one
    cross-entropy (written to trace on `meta`) is the only other."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    found = [str(p.relative_to(root)) for folder in ("engine", "profiling", "runtime", "coordinator", "comm")
             for p in sorted((root / folder).rglob("*.py"))
             if "cross_entropy(" in p.read_text() or "CrossEntropyLoss(" in p.read_text()]
    assert found == ["engine/objective.py", "profiling/sample.py"]
