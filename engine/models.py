"""Model registry: small models for digits, ResNet-18/VGG-11-shaped models for profiling,
and user models given as `package.module:factory`.

Every registry model is an `nn.Sequential` whose top-level children run in order, so a
pipeline planner can cut it into stages by child index. `build_model(name, seed)` is
deterministic: the same name, seed and keyword arguments give bitwise-equal weights.
"""
from __future__ import annotations

import copy
import inspect
import math
import threading
from typing import Any, Callable

import torch
from torch import nn

from core.errors import ZooidValueError
from engine.datasets import dataset_input_shape, id_bound
from engine.transformers import LANGUAGE_MODELS
from engine.user_code import import_callable

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
    **LANGUAGE_MODELS,  # gpt_mini, gpt2_small, bert_mini, bert_base, bert_large (engine/transformers.py)
}


def _import_factory(path: str) -> Callable[..., Any]:
    return import_callable(path, "model", "a model factory", form="factory", allow_class=True)


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
    (flat 64 features for the digits models, C x 32 x 32 images for resnet18/vgg11, `max_positions`
    token ids for the language models)."""
    if dataset is not None:
        return dataset_input_shape(dataset)
    if model_name.startswith("digits_"):
        return (kwargs.get("in_features", 64),)
    if model_name in ("resnet18", "vgg11"):
        size = kwargs.get("image_size", 32)
        return (kwargs.get("in_channels", 3), size, size)
    if model_name in LANGUAGE_MODELS:
        default = inspect.signature(LANGUAGE_MODELS[model_name]).parameters["max_positions"].default
        return (kwargs.get("max_positions", default),)
    raise ZooidValueError("dataset", f"give a dataset to know the input shape of {model_name!r}")


# --- does a model fit a dataset? (checked on the coordinator before anything is rented) ----------


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def expected_input(model: nn.Module) -> str | None:
    """The per-sample input the model's first layer takes, where it says (`64`, `3xHxW`, `T token
    ids below 258`); None where it does not (its first layer is neither a Linear, a convolution
    nor an embedding)."""
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            return f"T token ids below {module.num_embeddings}"
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

META_ABOVE_PARAMETERS = 50_000_000
"""Models with more parameters than this are checked on `meta` whatever the sample (gpt2_small,
bert_base, bert_large: bert_large's weights would take 1.5 GB of the coordinator's memory for a
shape check)."""


def _output_shape(model: nn.Module, x: torch.Tensor) -> tuple[int, ...]:
    model.eval()  # BatchNorm on one row, dropout off
    with torch.no_grad():
        out = model(x)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"the model returned {type(out).__name__}, not a tensor of class scores")
    return tuple(out.shape)


def _on_meta(factory: Callable[..., nn.Module], kwargs: dict[str, Any]) -> nn.Module:
    with _SEED_LOCK, torch.random.fork_rng(devices=[]), torch.device("meta"):
        return factory(**kwargs)


def _scoring_problem(shape: tuple[int, ...], target_shape: tuple[int, ...], classes: int) -> str | None:
    """Why outputs of `shape` cannot be scored against targets of `target_shape` (cross-entropy
    over the output's last dimension: `[B, C]` against `[B]`, `[B, T, V]` against `[B, T]`), or
    score fewer than `classes` classes; None when they can."""
    rows = target_shape[0]
    if len(target_shape) == 1 and (len(shape) != 2 or shape[0] != rows):
        return (f"gives outputs of shape {'x'.join(map(str, shape)) or 'scalar'} for {rows} row(s), "
                f"not {rows} x classes")
    if len(target_shape) > 1 and tuple(shape[:-1]) != tuple(target_shape):
        return (f"gives outputs of shape {_shape(shape)} for targets of shape {_shape(target_shape)}, which "
                f"cannot be scored together (cross-entropy needs {_shape(target_shape)}xV)")
    if shape[-1] < classes:
        if len(target_shape) > 1:
            return f"scores {shape[-1]} tokens, the targets hold ids up to {classes - 1}"
        return f"scores {shape[-1]} classes, the dataset has {classes}"
    return None


def _shape(shape) -> str:
    return "x".join(map(str, shape)) or "scalar"


def model_fit(name: str, sample: torch.Tensor, classes: int | None, seed: int = 0, *,
              target: torch.Tensor | None = None,
              model_kwargs: dict[str, Any] | None = None) -> tuple[str | None, str | None]:
    """Whether model `name` (built with `model_kwargs`) takes `sample` (one dataset row, batched:
    `1 x shape`; integer rows are token ids, fed as int64) and gives outputs that can be scored
    against `target` (that row's target; None: a class label) and score at least `classes`
    classes (None: a custom loss, any output is scored), cheaply: the model is built on the
    `meta` device (no weights drawn), then given the row on the CPU with uninitialised weights
    under `torch.no_grad` (a large row or a large model: on `meta`, shapes only). A model given by import path that cannot be built or run
    that way is built on the CPU and run once on the row. Returns `(problem, expected)`:
    `problem` None when it fits, else one line; `expected` the input its first layer takes,
    where it says."""
    factory = resolve_model(name)
    kwargs = model_kwargs or {}
    if not sample.is_floating_point():
        sample = sample.long()
    rows, expected = len(sample), None
    target_shape = tuple(target.shape) if target is not None else (rows,)
    try:
        model = _on_meta(factory, kwargs)
        expected = expected_input(model)
        big = (sample[0].numel() > META_ABOVE_ELEMENTS
               or sum(p.numel() for p in model.parameters()) > META_ABOVE_PARAMETERS)
        if big:
            shape = _output_shape(model, torch.empty(sample.shape, dtype=sample.dtype, device="meta"))
        else:
            shape = _output_shape(model.to_empty(device="cpu"), sample)
    except Exception as exc:
        if ":" not in name:  # the registry's models build and run this way: the shape is at fault
            return _first_line(exc), expected
        try:  # a user's model may need real weights: built for real, one forward on the CPU
            model = build_model(name, seed, **kwargs)
            expected = expected or expected_input(model)
            shape = _output_shape(model, sample)
        except Exception as exc2:  # a user's model can fail any way; that is the mismatch
            return _first_line(exc2), expected
    return None if classes is None else _scoring_problem(shape, target_shape, classes), expected


def models_that_fit(sample: torch.Tensor, classes: int | None, *, target: torch.Tensor | None = None,
                    data_kwargs: dict[str, Any] | None = None) -> list[str]:
    """The registry models that take `sample` and score at least `classes` classes (against
    `target`'s shape), each built with the `data_kwargs` its factory accepts."""
    return [name for name in REGISTRY
            if model_fit(name, sample, classes, target=target,
                         model_kwargs=accepted_kwargs(REGISTRY[name], data_kwargs or {}))[0] is None]


# --- the model's keyword arguments that follow from the dataset ------------------------------------

DATA_KWARGS = ("vocab_size", "mask_token_id")
"""The factory arguments a dataset decides: the token vocabulary and the mask token."""


def accepted_kwargs(factory: Callable[..., Any], available: dict[str, Any]) -> dict[str, Any]:
    """The entries of `available` that `factory` names as parameters (a `**kwargs` catch-all
    is not taken as accepting them)."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return {}
    return {k: v for k, v in available.items()
            if k in params and params[k].kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                  inspect.Parameter.KEYWORD_ONLY)}


def dataset_model_kwargs(data) -> dict[str, Any]:
    """What the dataset decides about a language model: `vocab_size` (the text dataset's
    `TextInfo.vocab_size`; else, for integer inputs, the largest id over inputs and targets
    plus one) and `mask_token_id` (the tokenizer's mask id, where it has one). Empty for
    float inputs."""
    info = getattr(data, "text", None)
    if info is not None:
        out: dict[str, Any] = {"vocab_size": int(info.vocab_size)}
        if info.mask_id is not None:
            out["mask_token_id"] = int(info.mask_id)
        return out
    bound = getattr(data, "id_bound", None)  # a prepared dataset's sample: the whole dataset's bound
    if bound is None:
        bound = id_bound(data)
    return {"vocab_size": int(bound)} if bound else {}


def data_model_kwargs(name: str, data) -> dict[str, Any]:
    """The keyword arguments model `name` is built with for dataset `data`: those of
    `dataset_model_kwargs` that its factory accepts (see `accepted_kwargs`)."""
    return accepted_kwargs(resolve_model(name), dataset_model_kwargs(data))


# --- language models against their data (checked on the coordinator before anything is rented) ----


def shape_model(name: str, seed: int = 0, **kwargs: Any) -> nn.Module:
    """Model `name` built for its shapes and attributes: on `meta` (no weights drawn, no memory:
    bert_large in milliseconds), or, for a factory given by import path that cannot be built
    there, on the CPU (`build_model`)."""
    try:
        return _on_meta(resolve_model(name), kwargs)
    except Exception:
        if ":" not in name:  # the registry's models build on meta: the arguments are at fault
            raise
        return build_model(name, seed, **kwargs)


def check_token_inputs(model: nn.Module, name: str, data, objective: str = "causal") -> None:
    """A model taking token ids (integer inputs) against its dataset `data` (a `DatasetSplit`):
    raise a ZooidValueError, one line, for a token id at or above the size of the model's
    embedding (its first `nn.Embedding`; naming `tokenizer` for a text dataset, else `dataset`,
    with both numbers), tokens per sample above the model's `max_positions` (naming `seq_len`),
    or `objective=mlm` with a model that has no `mask_token_id` or another mask id than the
    tokenizer's (naming `objective`). Float inputs are not token ids: nothing to check."""
    if data.train_x.is_floating_point():
        return
    info = getattr(data, "text", None)
    embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    top = max(int(t.max()) for t in (data.train_x, data.val_x) if t.numel())
    if embedding is not None and top >= embedding.num_embeddings:
        if info is not None:
            raise ZooidValueError("tokenizer", f"{info.tokenizer} gives token ids up to {top} ({info.vocab_size} "
                                  f"tokens), at or above {name}'s embedding of {embedding.num_embeddings}; give "
                                  f"{name} vocab_size={info.vocab_size} or a tokenizer of at most "
                                  f"{embedding.num_embeddings} tokens")
        raise ZooidValueError("dataset", f"token id {top} is at or above {name}'s embedding of "
                              f"{embedding.num_embeddings} tokens; the ids must be below {embedding.num_embeddings}")
    positions = getattr(model, "max_positions", None)
    tokens = data.train_x.shape[-1] if data.train_x.dim() > 1 else 1
    if positions is not None and tokens > positions:
        raise ZooidValueError("seq_len", f"{tokens} tokens per sample are above {name}'s {positions} positions "
                              f"(max_positions); use seq_len <= {positions}")
    if objective == "mlm":
        mask = getattr(model, "mask_token_id", None)
        if mask is None:
            fit = ", ".join(n for n in REGISTRY if n.startswith("bert_"))
            raise ZooidValueError("objective", f"mlm masks tokens, and {name} has no mask token (no "
                                  f"mask_token_id); use a masked LM ({fit}) or objective=causal")
        if info is not None and info.mask_id is not None and mask != info.mask_id:
            raise ZooidValueError("objective", f"mlm: {name}'s mask token is {mask}, {info.tokenizer}'s is "
                                  f"{info.mask_id}; give {name} mask_token_id={info.mask_id}")
