"""Model registry: small models for digits, ResNet-18/VGG-11-shaped models for profiling,
and user models given as `package.module:factory`.

Every registry model is an `nn.Sequential` whose top-level children run in order, so a
pipeline planner can cut it into stages by child index. `build_model(name, seed)` is
deterministic: the same name, seed and keyword arguments give bitwise-equal weights.
"""
from __future__ import annotations

import copy
import importlib
import inspect
import math
import sys
import threading
from typing import Any, Callable

import torch
from torch import nn

from core.errors import ZooidValueError
from engine.datasets import dataset_input_shape

# torch.manual_seed is process-global; the lock keeps two threads that build models at the
# same time (threads standing in for replicas in tests) from interleaving their seeds.
_SEED_LOCK = threading.Lock()


def digits_mlp(hidden: int = 64, in_features: int = 64, classes: int = 10) -> nn.Sequential:
    """64 -> hidden -> 10 perceptron with ReLU; no BatchNorm, no dropout."""
    return nn.Sequential(
        nn.Linear(in_features, hidden),
        nn.ReLU(),
        nn.Linear(hidden, classes),
    )


def digits_cnn(channels: int = 16, classes: int = 10) -> nn.Sequential:
    """Small conv net on the 8x8 digits; takes flat 64-feature rows and reshapes them itself."""
    return nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)),
        nn.Conv2d(1, channels, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(channels, 2 * channels, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(2 * channels * 4 * 4, 64),
        nn.ReLU(),
        nn.Linear(64, classes),
    )


class BasicBlock(nn.Module):
    """ResNet basic block: two 3x3 convolutions with BatchNorm and an identity/1x1 shortcut."""

    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Residual forward pass."""
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


def resnet18(in_channels: int = 3, classes: int = 10, width: int = 64) -> nn.Sequential:
    """ResNet-18 layout (CIFAR stem, 8 basic blocks) as 12 sequential children."""
    layers: list[nn.Module] = [
        nn.Conv2d(in_channels, width, 3, padding=1, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(),
    ]
    c = width
    for i, mult in enumerate((1, 2, 4, 8)):
        for j in range(2):
            stride = 2 if (i > 0 and j == 0) else 1
            layers.append(BasicBlock(c, width * mult, stride))
            c = width * mult
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, classes)]
    return nn.Sequential(*layers)


_VGG11 = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")


def vgg11(
    in_channels: int = 3, image_size: int = 32, classes: int = 10, hidden: int = 512
) -> nn.Sequential:
    """VGG-11 layout (8 conv layers, 5 pools, 3 linear layers) as flat sequential children."""
    if image_size < 32 or image_size % 32:
        raise ZooidValueError("image_size", f"must be a positive multiple of 32, got {image_size}")
    layers: list[nn.Module] = []
    c = in_channels
    for v in _VGG11:
        if v == "M":
            layers.append(nn.MaxPool2d(2))
        else:
            layers += [nn.Conv2d(c, int(v), 3, padding=1), nn.ReLU()]
            c = int(v)
    side = image_size // 32
    layers += [
        nn.Flatten(),
        nn.Linear(c * side * side, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, classes),
    ]
    return nn.Sequential(*layers)


REGISTRY: dict[str, Callable[..., nn.Module]] = {
    "digits_mlp": digits_mlp,
    "digits_cnn": digits_cnn,
    "resnet18": resnet18,
    "vgg11": vgg11,
}


def _import_factory(path: str) -> Callable[..., Any]:
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ZooidValueError("model", f"{path!r} is not `package.module:factory`")
    if module_name.split(".")[0] in sys.stdlib_module_names:
        # Never call into the standard library (`os:system`, `sys:exit`): no model lives there.
        raise ZooidValueError("model", f"{path!r} is in the standard library, not a model factory")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ZooidValueError("model", f"cannot import {module_name!r}: {exc}") from None
    factory = getattr(module, attr, None)
    if factory is None:
        raise ZooidValueError("model", f"{module_name!r} has no attribute {attr!r}")
    if not callable(factory) or inspect.isbuiltin(factory):
        raise ZooidValueError("model", f"{path!r} is not a model factory (not a Python callable)")
    return factory


def resolve_model(name: str) -> Callable[..., nn.Module]:
    """Return the factory `name` denotes, validated: a registry name, or an import path whose
    factory takes no required arguments and returns an `nn.Module` (checked by calling it)."""
    if not isinstance(name, str) or not name:
        raise ZooidValueError("model", f"expected a model name, got {name!r}")
    if ":" not in name:
        if name not in REGISTRY:
            raise ZooidValueError(
                "model", f"unknown model {name!r}; valid: {', '.join(sorted(REGISTRY))} "
                "or package.module:factory"
            )
        return REGISTRY[name]
    factory = _import_factory(name)
    try:
        inspect.signature(factory).bind()
    except TypeError:
        raise ZooidValueError("model", f"{name!r} needs arguments; a factory must take none") from None
    except ValueError:
        pass  # no signature available; the trial call below decides
    with _SEED_LOCK, torch.random.fork_rng(devices=[]):
        try:
            built = factory()
        except Exception as exc:  # a user's factory can fail any way; report it as bad input
            raise ZooidValueError("model", f"{name!r} failed when called: {exc}") from None
    if not isinstance(built, nn.Module):
        raise ZooidValueError(
            "model", f"{name!r} returned {type(built).__name__}, not a torch.nn.Module"
        )
    return factory


def build_model(name: str, seed: int = 0, **kwargs: Any) -> nn.Module:
    """Build model `name` with weights drawn from `seed` (deterministic) and `kwargs`
    passed to its factory. The global RNG state is left as it was."""
    cache_key = (name, seed, repr(sorted(kwargs.items())))
    if _TEMPLATES is not None and cache_key in _TEMPLATES:
        return copy.deepcopy(_TEMPLATES[cache_key])
    factory = resolve_model(name)
    with _SEED_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = factory(**kwargs)
    if not isinstance(model, nn.Module):
        raise ZooidValueError("model", f"{name!r} returned {type(model).__name__}, not a Module")
    if _TEMPLATES is not None:
        _TEMPLATES[cache_key] = copy.deepcopy(model)
    return model


_TEMPLATES: dict | None = None
"""Built models by (name, seed, kwargs), kept by a warm worker (`keep_models`); None: off."""


def keep_models() -> None:
    """Build each model once in this process: later `build_model` calls return a copy of
    the first build (the same initial weights), without running the factory again."""
    global _TEMPLATES
    if _TEMPLATES is None:
        _TEMPLATES = {}


def input_shape(model_name: str, dataset: str | None = None, **kwargs: Any) -> tuple[int, ...]:
    """Per-sample input shape: the dataset's when given, else the model's natural default
    (flat 64 features for the digits models, C x 32 x 32 images for resnet18/vgg11)."""
    if dataset is not None:
        return dataset_input_shape(dataset)
    if model_name.startswith("digits_"):
        return (kwargs.get("in_features", 64),)
    if model_name in ("resnet18", "vgg11"):
        size = kwargs.get("image_size", 32)
        return (kwargs.get("in_channels", 3), size, size)
    raise ZooidValueError("dataset", f"give a dataset to know the input shape of {model_name!r}")


# --- does a model fit a dataset? (checked on the coordinator before anything is rented) ----------


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def expected_input(model: nn.Module) -> str | None:
    """The per-sample input the model's first layer takes, where it says (`64`, `3xHxW`); None
    where it does not (its first layer is neither a Linear nor a convolution)."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            return str(module.in_features)
        if isinstance(module, nn.Conv1d):
            return f"{module.in_channels}xL"
        if isinstance(module, nn.Conv2d):
            return f"{module.in_channels}xHxW"
        if isinstance(module, nn.Conv3d):
            return f"{module.in_channels}xDxHxW"
        if isinstance(module, nn.Unflatten) and module.dim == 1:  # flat rows, reshaped by the model
            return str(math.prod(module.unflattened_size))
    return None


META_ABOVE_ELEMENTS = 16384
"""Samples larger than this are checked on the `meta` device (shapes only, no arithmetic; its
first use imports about a second of torch); smaller ones by one real forward on the CPU."""


def _output_shape(model: nn.Module, x: torch.Tensor) -> tuple[int, ...]:
    model.eval()  # BatchNorm on one row, dropout off
    with torch.no_grad():
        out = model(x)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"the model returned {type(out).__name__}, not a tensor of class scores")
    return tuple(out.shape)


def model_fit(name: str, sample: torch.Tensor, classes: int, seed: int = 0) -> tuple[str | None, str | None]:
    """Whether model `name` takes `sample` (one dataset row, batched: `1 x shape`) and scores at
    least `classes` classes, cheaply: the model is built on the `meta` device (no weights drawn),
    then given the row on the CPU with uninitialised weights under `torch.no_grad` (a large row:
    on `meta`, shapes only). A model given by import path that cannot be built or run that way is
    built on the CPU and run once on the row. Returns `(problem, expected)`: `problem` None when
    it fits, else one line; `expected` the input its first layer takes, where it says."""
    factory = resolve_model(name)
    rows, expected = len(sample), None
    device = "meta" if sample[0].numel() > META_ABOVE_ELEMENTS else "cpu"
    try:
        with _SEED_LOCK, torch.random.fork_rng(devices=[]), torch.device("meta"):
            model = factory()
        expected = expected_input(model)
        if device == "cpu":
            model = model.to_empty(device="cpu")
        shape = _output_shape(model, sample if device == "cpu" else torch.empty(sample.shape, dtype=sample.dtype,
                                                                              device="meta"))
    except Exception as exc:
        if ":" not in name:  # the registry's models build and run this way: the shape is at fault
            return _first_line(exc), expected
        try:  # a user's model may need real weights: built for real, one forward on the CPU
            model = build_model(name, seed)
            expected = expected or expected_input(model)
            shape = _output_shape(model, sample)
        except Exception as exc2:  # a user's model can fail any way; that is the mismatch
            return _first_line(exc2), expected
    if len(shape) != 2 or shape[0] != rows:
        return (f"gives outputs of shape {'x'.join(map(str, shape)) or 'scalar'} for {rows} row(s), "
                f"not {rows} x classes"), expected
    if shape[-1] < classes:
        return f"scores {shape[-1]} classes, the dataset has {classes}", expected
    return None, expected


def models_that_fit(sample: torch.Tensor, classes: int) -> list[str]:
    """The registry models that take `sample` and score at least `classes` classes."""
    return [name for name in REGISTRY if model_fit(name, sample, classes)[0] is None]
