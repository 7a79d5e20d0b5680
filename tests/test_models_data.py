"""Model registry and validation, datasets, and their staging in the store."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from core.errors import ZooidValueError
from engine.datasets import (load_dataset, parse_synthetic, publish_dataset, read_manifest,
                             read_subsets, validate_dataset)
from engine.models import REGISTRY, build_model, input_shape, resolve_model
from tests.memory_store import MemoryStore

NOT_CALLABLE = 42


def returns_int():
    return 7


def needs_args(width):
    return nn.Linear(width, 2)


def tiny_factory(width=4):
    return nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, 10))


def tiny_dataset():
    g = torch.Generator().manual_seed(1)
    train = torch.utils.data.TensorDataset(torch.randn(30, 5, generator=g), torch.arange(30) % 3)
    return train, (torch.randn(6, 5, generator=g), torch.arange(6) % 3)


# --- models --------------------------------------------------------------------------


def test_build_model_is_deterministic_given_the_seed():
    a, b, c = build_model("digits_cnn", 3), build_model("digits_cnn", 3), build_model("digits_cnn", 4)
    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())
    assert not torch.equal(a.state_dict()["1.weight"], c.state_dict()["1.weight"])


def test_digits_mlp_has_no_batchnorm_or_dropout():
    kinds = {type(m) for m in build_model("digits_mlp", 0).modules()}
    assert kinds == {nn.Sequential, nn.Linear, nn.ReLU}


@pytest.mark.parametrize("name,kwargs", [
    ("digits_mlp", {}), ("digits_cnn", {}), ("resnet18", {"width": 4}), ("vgg11", {"hidden": 16}),
])
def test_registry_models_run_their_children_in_order(name, kwargs):
    model = build_model(name, 0, **kwargs).eval()
    x = torch.randn(2, *input_shape(name, **kwargs))
    h = x
    for child in model.children():
        h = child(h)
    with torch.no_grad():
        assert torch.equal(h, model(x))
    assert h.shape == (2, 10)


def test_unknown_model_lists_valid_names():
    with pytest.raises(ZooidValueError, match="model: unknown model 'resnet9'.*digits_mlp"):
        resolve_model("resnet9")


@pytest.mark.parametrize("path,why", [
    ("os:system", "standard library"),
    ("tests.test_models_data:NOT_CALLABLE", "not a model factory"),
    ("tests.test_models_data:returns_int", "returned int"),
    ("tests.test_models_data:needs_args", "needs arguments"),
    ("tests.test_models_data:missing", "no attribute"),
    ("no_such_package.mod:f", "cannot import"),
])
def test_bad_model_import_paths(path, why):
    with pytest.raises(ZooidValueError, match=why) as err:
        resolve_model(path)
    assert err.value.field == "model"


def test_user_factory_by_import_path():
    model = build_model("tests.test_models_data:tiny_factory", 0, width=3)
    assert model[0].out_features == 3
    assert sorted(REGISTRY) == ["bert_base", "bert_large", "bert_mini", "digits_cnn", "digits_mlp", "gpt2_small",
                                "gpt_mini", "resnet18", "vgg11"]


# --- datasets ------------------------------------------------------------------------


def test_digits_split_is_fixed_and_scaled():
    a, b = load_dataset("digits"), load_dataset("digits")
    assert a.train_x.shape == (1437, 64) and a.val_x.shape == (360, 64)
    assert a.train_x.dtype == torch.float32 and a.train_y.dtype == torch.int64
    assert 0.0 == a.train_x.min() and a.train_x.max() == 1.0
    assert torch.equal(a.val_x, b.val_x) and torch.equal(a.train_y, b.train_y)
    assert set(a.val_y.tolist()) == set(range(10))


def test_synthetic_syntax():
    assert parse_synthetic("synthetic") == parse_synthetic("synthetic:64:10:1024:256")
    d = load_dataset("synthetic:3x8x8:5:100:20")
    assert d.train_x.shape == (100, 3, 8, 8) and d.val_x.shape == (20, 3, 8, 8)
    assert int(d.train_y.max()) < 5


@pytest.mark.parametrize("name", ["mnist", "synthetic:3x:10", "synthetic:64:1", "os:getcwd", ""])
def test_bad_dataset_names(name):
    with pytest.raises(ZooidValueError) as err:
        validate_dataset(name)
    assert err.value.field == "dataset"


def test_dataset_by_import_path():
    d = load_dataset("tests.test_models_data:tiny_dataset")
    assert d.train_x.shape == (30, 5) and d.val_y.tolist() == [0, 1, 2, 0, 1, 2]


def test_publish_and_read_subsets_round_trip():
    store, data = MemoryStore(), load_dataset("digits")
    manifest = publish_dataset(store, "r1", "digits", subset_size=100)
    assert (manifest.n_subsets, manifest.n_val_subsets) == (15, 4)
    assert read_manifest(store, "r1") == manifest
    assert len(store.list("runs/r1/data/train/")) == 15
    x, y = read_subsets(store, "r1", range(15))
    assert torch.equal(x, data.train_x) and torch.equal(y, data.train_y)
    x, y = read_subsets(store, "r1", [14, 2])  # a worker reads only its own subsets
    assert torch.equal(x, torch.cat([data.train_x[1400:], data.train_x[200:300]]))
    vx, _ = read_subsets(store, "r1", range(4), split="val")
    assert torch.equal(vx, data.val_x)


