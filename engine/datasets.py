"""Datasets by name, and their staging in the store as fixed-size subsets (KubeML Sec. 3.4.5).

Names:

- `digits`: scikit-learn's bundled 8x8 digits, features scaled to [0, 1] float32 as flat
  64-vectors, labels int64; a fixed seeded split of 1437 training and 360 validation rows.
- `synthetic[:SHAPE[:CLASSES[:N_TRAIN[:N_VAL]]]]`: seeded Gaussian inputs of SHAPE (`64`,
  `3x32x32`), labelled by a fixed random linear teacher so they are learnable. Defaults:
  `64`, 10 classes, 1024 training rows, N_TRAIN // 4 validation rows. Example:
  `synthetic:3x32x32:10:2048`.
- `package.module:function`: a function of no arguments returning `(train, val)`, each an
  `(x, y)` pair of tensors or a map-style dataset of `(x, y)` items.
- `text:SOURCE`: a text corpus (a path, file://, s3://, az://, a store block, or `stdlib`, the
  shipped one), tokenized and cut into blocks for a language model by the job's `tokenizer`,
  `objective` and `seq_len` (`engine.text_data`, `TextSettings`).

Staging: `publish_dataset` writes the training set as subsets of `subset_size` rows under
`runs/<run_id>/data/train/<i>` and the validation set under `runs/<run_id>/data/val/<i>`,
plus `runs/<run_id>/data/manifest.json` (`core.keys.data_subset_key`, `data_manifest_key`).
A worker reads only the subsets it is assigned (`assign_subsets`), so it needs no local copy
of the data. A text dataset's subsets hold int32 ids (widened to int64 when read) and say so in
their metadata (its `TextInfo` and the global index of their first row); an `mlm` subset is
masked when it is read, for the epoch the reader names (`engine.text_data.mlm_mask`).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from comm.store import Store
from comm.tensor_codec import decode_tensors, encode_tensors
from core.errors import ZooidValueError
from core.keys import data_manifest_key, data_subset_key
from engine.text_data import Opener, TextInfo, TextSettings, is_text, load_text, mlm_mask, validate_text
from engine.objective import target_classes
from engine.user_code import import_callable

DIGITS_VAL_FRACTION = 0.2
SPLIT_SEED = 0


class DatasetSplit(NamedTuple):
    """A dataset in memory: training and validation inputs and integer labels."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    val_x: torch.Tensor
    val_y: torch.Tensor
    text: TextInfo | None = None
    """A text dataset's vocabulary, objective and special ids; None for any other dataset."""


@dataclass(frozen=True)
class SyntheticSpec:
    """Parsed `synthetic:SHAPE:CLASSES:N_TRAIN:N_VAL`."""

    shape: tuple[int, ...] = (64,)
    classes: int = 10
    n_train: int = 1024
    n_val: int = 256


def parse_synthetic(name: str) -> SyntheticSpec:
    """Parse a `synthetic[:SHAPE[:CLASSES[:N_TRAIN[:N_VAL]]]]` name (see module docstring)."""
    parts = name.split(":")
    if parts[0] != "synthetic" or len(parts) > 5:
        raise ZooidValueError("dataset", f"{name!r} is not synthetic[:SHAPE[:CLASSES[:N_TRAIN[:N_VAL]]]]")
    try:
        shape = tuple(int(d) for d in parts[1].split("x")) if len(parts) > 1 else (64,)
        classes = int(parts[2]) if len(parts) > 2 else 10
        n_train = int(parts[3]) if len(parts) > 3 else 1024
        n_val = int(parts[4]) if len(parts) > 4 else max(1, n_train // 4)
    except ValueError:
        raise ZooidValueError("dataset", f"{name!r}: SHAPE is like 3x32x32, the rest are integers") from None
    if not shape or min(shape) < 1 or classes < 2 or n_train < 1 or n_val < 1:
        raise ZooidValueError("dataset", f"{name!r}: sizes must be positive and classes >= 2")
    return SyntheticSpec(shape, classes, n_train, n_val)


def _digits() -> DatasetSplit:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = torch.from_numpy((bunch.data / 16.0).astype(np.float32))
    y = torch.from_numpy(bunch.target.astype(np.int64))
    order = torch.from_numpy(np.random.RandomState(SPLIT_SEED).permutation(len(y)))
    n_val = int(np.ceil(len(y) * DIGITS_VAL_FRACTION))
    val, train = order[:n_val], order[n_val:]
    return DatasetSplit(x[train], y[train], x[val], y[val])


def _synthetic(spec: SyntheticSpec) -> DatasetSplit:
    g = torch.Generator().manual_seed(SPLIT_SEED)
    n = spec.n_train + spec.n_val
    x = torch.randn((n, *spec.shape), generator=g)
    teacher = torch.randn(int(np.prod(spec.shape)), spec.classes, generator=g)
    y = (x.reshape(n, -1) @ teacher).argmax(1)
    return DatasetSplit(x[: spec.n_train], y[: spec.n_train], x[spec.n_train :], y[spec.n_train :])


def _as_tensors(part: Any, which: str, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(part, (tuple, list)) and len(part) == 2 and all(isinstance(t, torch.Tensor) for t in part):
        x, y = part
    elif hasattr(part, "__len__") and hasattr(part, "__getitem__"):
        items = [part[i] for i in range(len(part))]
        x = torch.stack([torch.as_tensor(it[0]) for it in items])
        y = torch.stack([torch.as_tensor(it[1]) for it in items])
    else:
        raise ZooidValueError("dataset", f"{name!r}: {which} is neither (x, y) tensors nor a dataset")
    if len(x) != len(y) or len(x) == 0:
        raise ZooidValueError("dataset", f"{name!r}: {which} x and y must be non-empty and equally long")
    return _as_inputs(x), _as_targets(y)


def _as_inputs(x: torch.Tensor) -> torch.Tensor:
    """Inputs as a model takes them: integers (token ids) as int64; bytes and booleans (pixels,
    flags) as float32; floats as they are."""
    if x.is_floating_point():
        return x
    if x.dtype in (torch.uint8, torch.bool):
        return x.float()
    return x.long()


def _as_targets(y: torch.Tensor) -> torch.Tensor:
    """Targets in their shape ([N] classes, [N, T] tokens, anything for a custom loss): integers
    as int64, floats (a custom loss's values) as they are."""
    return y if y.is_floating_point() else y.long()


def _imported(name: str) -> DatasetSplit:
    fn = _import_loader(name)
    try:
        out = fn()
    except Exception as exc:  # a user's loader may fail any way; that is bad input
        raise ZooidValueError("dataset", f"{name!r} failed when called: {exc}") from None
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise ZooidValueError("dataset", f"{name!r} must return (train, val)")
    (tx, ty), (vx, vy) = _as_tensors(out[0], "train", name), _as_tensors(out[1], "val", name)
    return DatasetSplit(tx, ty, vx, vy)


def _import_loader(name: str):
    return import_callable(name, "dataset", "a callable loader", allow_class=True)


def validate_dataset(name: str, text: TextSettings | None = None) -> None:
    """Raise ZooidValueError("dataset", ...) unless `name` is a dataset this module can load
    (import paths are imported and checked to be callable, not called). `text`: the job's
    tokenizer, objective and sequence length (checked for a `text:` dataset; any other
    dataset refuses a tokenizer or objective other than the defaults)."""
    if not isinstance(name, str) or not name:
        raise ZooidValueError("dataset", f"expected a dataset name, got {name!r}")
    if is_text(name):
        validate_text(name, text or TextSettings())
        return
    for field in ("tokenizer", "objective"):
        if text is not None and getattr(text, field) != getattr(TextSettings, field):
            raise ZooidValueError(field, f"{getattr(text, field)!r} is for text: datasets; {name!r} is not one")
    if name == "digits":
        return
    if name.split(":")[0] == "synthetic":
        parse_synthetic(name)
        return
    if ":" in name:
        _import_loader(name)
        return
    raise ZooidValueError(
        "dataset", f"unknown dataset {name!r}; valid: digits, synthetic[:SHAPE:CLASSES:N], package.module:function"
    )


def load_dataset(name: str, text: TextSettings | None = None, *, cache: Store | None = None,
                 open_source: Opener | None = None) -> DatasetSplit:
    """Load dataset `name` (see the module docstring) into memory. For a `text:` dataset:
    `text`, the tokenizer, objective and sequence length; `cache`, the durable store that keeps
    trained tokenizers; `open_source`, what opens an s3://, az:// or block source."""
    validate_dataset(name, text)
    if is_text(name):
        return DatasetSplit(*load_text(name, text or TextSettings(), cache=cache, open_source=open_source))
    if name == "digits":
        return _digits()
    if name.split(":")[0] == "synthetic":
        return _synthetic(parse_synthetic(name))
    return _imported(name)


def dataset_input_shape(name: str, text: TextSettings | None = None) -> tuple[int, ...]:
    """Per-sample input shape of dataset `name`, without loading it where that is avoidable."""
    validate_dataset(name, text)
    if is_text(name):
        return ((text or TextSettings()).seq_len,)
    if name == "digits":
        return (64,)
    if name.split(":")[0] == "synthetic":
        return parse_synthetic(name).shape
    return tuple(load_dataset(name).train_x.shape[1:])


# --- staging in the store --------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class DatasetManifest:
    """What `publish_dataset` wrote: sizes and subset counts, JSON-able."""

    name: str
    subset_size: int
    n_train: int
    n_val: int
    n_subsets: int
    n_val_subsets: int
    input_shape: tuple[int, ...]
    classes: int
    """What the integer targets use (`engine.objective.target_classes`): classes, or the
    vocabulary of token targets; 0 for float targets."""

    text: TextInfo | None = None
    """A text dataset's `TextInfo`; None for any other dataset."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DatasetManifest":
        """Inverse of `to_dict`."""
        text = TextInfo.from_dict(d["text"]) if d.get("text") else None
        return cls(**{**d, "input_shape": tuple(d["input_shape"]), "text": text})


def _write_subsets(store: Store, run_id: str, split: str, x: torch.Tensor, y: torch.Tensor, size: int,
                   text: TextInfo | None = None) -> int:
    n = 0
    for n, start in enumerate(range(0, len(y), size), start=1):
        part = {"x": x[start : start + size].contiguous(), "y": y[start : start + size].contiguous()}
        meta = None
        if text is not None:  # ids below the vocabulary: int32 halves the bytes stored and read
            part = {k: v.to(torch.int32) for k, v in part.items()}
            meta = {"text": json.dumps(text.to_dict()), "first": str(start)}
        store.put(data_subset_key(run_id, split, n - 1), encode_tensors(part, meta))
    return n


def publish_dataset(store: Store, run_id: str, name: str, subset_size: int = 64,
                    text: TextSettings | None = None, open_source: Opener | None = None) -> DatasetManifest:
    """Load `name` and write it to the store as subsets of `subset_size` rows (the last may be
    shorter), training and validation, plus a JSON manifest; return the manifest. A `text:`
    dataset is loaded with `text` and `open_source` (`load_dataset`), `store` keeping its tokenizer."""
    if not isinstance(subset_size, int) or subset_size < 1:
        raise ZooidValueError("subset_size", f"must be a positive integer, got {subset_size!r}")
    data = load_dataset(name, text, cache=store, open_source=open_source)
    n_sub = _write_subsets(store, run_id, "train", data.train_x, data.train_y, subset_size, data.text)
    n_val_sub = _write_subsets(store, run_id, "val", data.val_x, data.val_y, subset_size, data.text)
    manifest = DatasetManifest(
        name=name,
        subset_size=subset_size,
        n_train=len(data.train_y),
        n_val=len(data.val_y),
        n_subsets=n_sub,
        n_val_subsets=n_val_sub,
        input_shape=tuple(data.train_x.shape[1:]),
        text=data.text,
        classes=target_classes(data.train_y, data.val_y),
    )
    # The manifest goes last: its presence means every subset is already readable.
    store.put(data_manifest_key(run_id), json.dumps(manifest.to_dict()).encode())
    return manifest


def read_manifest(store: Store, run_id: str, timeout: float | None = None) -> DatasetManifest:
    """The manifest `publish_dataset` wrote for `run_id`."""
    raw = store.get(data_manifest_key(run_id), timeout=timeout)
    return DatasetManifest.from_dict(json.loads(raw))


_SUBSETS: dict | None = None
"""Decoded subsets by (store URL, key), kept by a warm worker (`keep_subsets`); None: off."""


def keep_subsets() -> None:
    """Keep every subset this process reads in memory: a warm worker reads each once per run
    (a run's subsets never change once published)."""
    global _SUBSETS
    if _SUBSETS is None:
        _SUBSETS = {}


def read_subsets(
    store: Store, run_id: str, indices, split: str = "train", timeout: float | None = None,
    *, seed: int = 0, epoch: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate the (x, y) of subsets `indices` of `split` ("train" or "val"), in order.
    Text subsets come back as int64; `mlm` ones masked for (`seed`, `epoch`) by each row's
    global index (the validation split with one mask for every epoch): every reader of a row,
    whichever worker or micro-batch, sees the same mask."""
    if split not in ("train", "val"):
        raise ZooidValueError("split", f"must be 'train' or 'val', got {split!r}")
    xs, ys = [], []
    for i in indices:
        key = data_subset_key(run_id, split, i)
        cached = _SUBSETS.get((store.url, key)) if _SUBSETS is not None else None
        if cached is None:
            tensors, meta = decode_tensors(store.get(key, timeout=timeout))
            cached = (tensors["x"], tensors["y"], meta)
            if _SUBSETS is not None:
                _SUBSETS[(store.url, key)] = cached
        x, y, meta = cached
        if "text" in meta:
            x, y = _text_rows(x, y, meta, split, seed, epoch)
        xs.append(x)
        ys.append(y)
    if not xs:
        raise ZooidValueError("subsets", "no subsets given")
    return torch.cat(xs), torch.cat(ys)


def _text_rows(x: torch.Tensor, y: torch.Tensor, meta: dict[str, str], split: str, seed: int,
               epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A text subset's rows as a model reads them: int64, masked for the epoch if `mlm`."""
    info = TextInfo.from_dict(json.loads(meta["text"]))
    if info.objective == "mlm":
        return mlm_mask(x, info, seed=seed, epoch=epoch, first_index=int(meta["first"]), split=split)
    return x.long(), y.long()


def assign_subsets(n_subsets: int, world: int, epoch: int, seed: int = 0) -> list[tuple[int, ...]]:
    """Deal `n_subsets` subsets to `world` workers for `epoch`: a permutation seeded by
    (seed, epoch), cut into `world` runs whose lengths differ by at most one. Every subset
    goes to exactly one worker; each worker's tuple is sorted."""
    if world < 1:
        raise ZooidValueError("workers", f"must be at least 1, got {world}")
    if n_subsets < world:
        raise ZooidValueError("workers", f"{world} workers but only {n_subsets} data subsets")
    order = np.random.default_rng([seed, epoch]).permutation(n_subsets)
    return [tuple(sorted(int(i) for i in part)) for part in np.array_split(order, world)]
