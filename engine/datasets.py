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

Staging: a dataset is prepared as shards and a manifest under a prefix of a store
(`prepare_dataset`, `engine.shards`): a run's under `runs/<run_id>/data` (`publish_dataset`),
a user's into a bucket by `flows.prepare`. A worker reads only the shards its batches need
(`engine.replica_data`, `engine.shard_stream`), so it needs no local copy of the data, and keeps
what it read within a bound (`keep_subsets`). A text dataset's shards hold int32 ids (widened to int64 when
read) and say so in their metadata (its `TextInfo` and the global index of their first row); an
`mlm` shard is masked when it is read, for the epoch the reader names (`engine.text_data.mlm_mask`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import threading
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import numpy as np
import torch

from comm.store import Store
from comm.tensor_codec import decode_tensors, encode_tensors
from core.errors import ZooidValueError
from core.keys import data_prefix, shard_key
from core.specs import WorkerSpec
from engine.text_data import Opener, TextInfo, TextSettings, is_text, load_text, mlm_mask, validate_text
from engine.objective import target_classes
from engine.shards import (SPLITS, DatasetManifest, ShardCache, fetch_shard, read_dataset_manifest, write_manifest,
                           write_shard)
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
    id_bound: int | None = None
    """Set on a sample of a prepared dataset: its integer ids' bound over the whole dataset
    (`DatasetManifest.id_bound`), where the sample's own ids would understate it."""


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


class Prepared(NamedTuple):
    """What `prepare_dataset` did: the manifest, and the shards it wrote and kept (a resumed
    prepare keeps the whole ones already there); `already`: an equal preparation was there."""

    manifest: DatasetManifest
    written: int
    kept: int
    already: bool


def id_bound(data: DatasetSplit) -> int:
    """One more than the largest id of a dataset of integer inputs (over the inputs and targets
    of both splits: what a model's embedding must hold); 0 for float inputs."""
    if data.train_x.is_floating_point():
        return 0
    return 1 + max(int(t.max()) for t in (data.train_x, data.val_x, data.train_y, data.val_y) if t.numel())


def prepare_settings(name: str, subset_size: int, text: TextSettings | None) -> dict[str, Any]:
    """What makes two preparations of a source equal: the source, the shard rows and, for text,
    the tokenizer, objective and sequence length."""
    return {"source": name, "subset_size": subset_size,
            "text": dataclasses.asdict(text or TextSettings()) if is_text(name) else None}


def _shards_of(x: torch.Tensor, y: torch.Tensor, size: int, text: TextInfo | None):
    """(bytes, rows) of each shard of `size` rows, in order."""
    for start in range(0, len(y), size):
        part = {"x": x[start : start + size].contiguous(), "y": y[start : start + size].contiguous()}
        meta = None
        if text is not None:  # ids below the vocabulary: int32 halves the bytes stored and read
            part = {k: v.to(torch.int32) for k, v in part.items()}
            meta = {"text": json.dumps(text.to_dict()), "first": str(start)}
        yield encode_tensors(part, meta), len(part["y"])


def prepare_dataset(store: Store, prefix: str, name: str, subset_size: int = 64,
                    text: TextSettings | None = None, open_source: Opener | None = None, *,
                    prepared_by: str = "", resume: bool = True) -> Prepared:
    """Load `name` and write it under `prefix` of `store` as shards of `subset_size` rows (the
    last of a split may be shorter), training and validation, then the manifest (`engine.shards`).
    An equal preparation already there (same format and `prepare_settings`) is left as it is;
    with `resume`, a shard already there with the same bytes is kept, not written again. A
    `text:` dataset is loaded with `text` and `open_source` (`load_dataset`), `store` keeping its
    tokenizer."""
    if not isinstance(subset_size, int) or isinstance(subset_size, bool) or subset_size < 1:
        raise ZooidValueError("subset_size", f"must be a positive integer, got {subset_size!r}")
    settings = prepare_settings(name, subset_size, text)
    try:
        there = read_dataset_manifest(store, prefix)
    except ZooidValueError:
        there = None  # none, or another format: prepared (again) below
    if there is not None and there.settings == settings:
        return Prepared(there, 0, 0, True)
    data = load_dataset(name, text, cache=store, open_source=open_source)
    shards, written = {}, 0
    for split, x, y in (("train", data.train_x, data.train_y), ("val", data.val_x, data.val_y)):
        shards[split] = []
        for i, (blob, rows) in enumerate(_shards_of(x, y, subset_size, data.text)):
            info, wrote = write_shard(store, prefix, split, i, blob, rows, resume=resume)
            shards[split].append(info)
            written += wrote
    dtypes = {"x": str(torch.int32 if data.text else data.train_x.dtype),
              "y": str(torch.int32 if data.text else data.train_y.dtype)}
    manifest = DatasetManifest(
        name=name, subset_size=subset_size, n_train=len(data.train_y), n_val=len(data.val_y),
        n_subsets=len(shards["train"]), n_val_subsets=len(shards["val"]),
        input_shape=tuple(data.train_x.shape[1:]), text=data.text,
        classes=target_classes(data.train_y, data.val_y), id_bound=id_bound(data), dtypes=dtypes, shards=shards,
        settings=settings, prepared_by=prepared_by)
    write_manifest(store, prefix, manifest)  # last: its presence means every shard is readable
    return Prepared(manifest, written, sum(map(len, shards.values())) - written, False)


def publish_dataset(store: Store, run_id: str, name: str, subset_size: int = 64,
                    text: TextSettings | None = None, open_source: Opener | None = None) -> DatasetManifest:
    """Stage `name` for run `run_id`: prepared into the run's own data prefix (`prepare_dataset`);
    return the manifest."""
    return prepare_dataset(store, data_prefix(run_id), name, subset_size, text, open_source).manifest


def read_manifest(store: Store, run_id: str, timeout: float | None = None) -> DatasetManifest:
    """The manifest of the data staged for `run_id`."""
    return read_dataset_manifest(store, data_prefix(run_id), timeout=timeout)


_CACHE: ShardCache | None = None
"""Decoded shards by (store URL, key), kept by a worker (`keep_subsets`); None: off."""
_CACHE_LOCK = threading.Lock()
"""Guards `_CACHE`: a worker's read-ahead thread reads through it too (`engine.shard_stream`)."""


def keep_subsets(max_mb: float | None = None) -> None:
    """Keep the shards this process reads in memory, at most `max_mb` MB of their stored bytes
    (None: all; a warm worker reads each of a run's staged subsets once per run)."""
    global _CACHE
    max_bytes = None if max_mb is None else int(max_mb * 2**20)
    if _CACHE is None or _CACHE.max_bytes != max_bytes:
        _CACHE = ShardCache(max_bytes)


def read_shard(store: Store, prefix: str, split: str, index: int, timeout: float | None = None, *,
               manifest: DatasetManifest | None = None) -> tuple[tuple[torch.Tensor, torch.Tensor, dict[str, str]], int]:
    """Shard `index` of `split` decoded, `(x, y, metadata)` as stored, from the process's cache
    when it kept it (`keep_subsets`), else fetched and checked against `manifest`'s checksum
    (`fetch_shard`) and kept there; and the stored bytes fetched (0 from the cache). Safe from
    several threads."""
    key = (store.url, shard_key(prefix, split, index))
    with _CACHE_LOCK:
        cached = _CACHE.get(key) if _CACHE is not None else None
    if cached is not None:
        return cached, 0
    info = manifest.shard(split, index) if manifest is not None else None
    blob = fetch_shard(store, prefix, split, index, info, timeout=timeout)
    tensors, meta = decode_tensors(blob)
    cached = (tensors["x"], tensors["y"], meta)
    with _CACHE_LOCK:
        if _CACHE is not None:
            _CACHE.put(key, cached, len(blob))
    return cached, len(blob)


def shard_rows(x: torch.Tensor, y: torch.Tensor, meta: dict[str, str], split: str, seed: int,
               epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoded shard's rows as a model reads them: a text shard's int64, masked for (`seed`,
    `epoch`) if `mlm` (`_text_rows`); any other shard's as stored."""
    return _text_rows(x, y, meta, split, seed, epoch) if "text" in meta else (x, y)


def read_shards(
    store: Store, prefix: str, indices, split: str = "train", timeout: float | None = None,
    *, seed: int = 0, epoch: int = 0, manifest: DatasetManifest | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate the (x, y) of shards `indices` of `split` ("train" or "val") of the dataset at
    `prefix`, in order, each checked against `manifest`'s checksum when given (`fetch_shard`).
    Text shards come back as int64; `mlm` ones masked for (`seed`, `epoch`) by each row's global
    index (the validation split with one mask for every epoch): every reader of a row,
    whichever worker or micro-batch, sees the same mask."""
    if split not in SPLITS:
        raise ZooidValueError("split", f"must be 'train' or 'val', got {split!r}")
    xs, ys = [], []
    for i in indices:
        (x, y, meta), _ = read_shard(store, prefix, split, i, timeout, manifest=manifest)
        x, y = shard_rows(x, y, meta, split, seed, epoch)
        xs.append(x)
        ys.append(y)
    if not xs:
        raise ZooidValueError("subsets", "no subsets given")
    return torch.cat(xs), torch.cat(ys)


class ShardSource:
    """Where one worker reads its shards: a store and the dataset's prefix there, with the
    dataset's manifest read once (its checksums check every shard read)."""

    def __init__(self, store: Store, prefix: str, timeout: float | None = None):
        self.store, self.prefix, self.timeout = store, prefix, timeout

    @functools.cached_property
    def manifest(self) -> DatasetManifest:
        return read_dataset_manifest(self.store, self.prefix, timeout=self.timeout)

    def read(self, indices, split: str = "train", *, seed: int = 0, epoch: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """`read_shards` of this dataset, each shard checked against the manifest."""
        return read_shards(self.store, self.prefix, indices, split, self.timeout, seed=seed, epoch=epoch,
                           manifest=self.manifest)


@contextlib.contextmanager
def worker_shards(spec: WorkerSpec, run_store: Store, open_ref: Callable[[str], Store]):
    """The shards `spec` reads (`spec.data`): the run's staged data in `run_store` (the store of
    its checkpoints), or a prepared dataset's store, opened with `open_ref` and closed after. A
    `cache_mb` bounds what the worker keeps of them (`keep_subsets`)."""
    data = spec.data
    if data.cache_mb is not None:
        keep_subsets(data.cache_mb)
    if not data.store:
        yield ShardSource(run_store, data_prefix(spec.run_id), spec.sync_timeout_s)
        return
    store = open_ref(data.store)
    try:
        yield ShardSource(store, data.prefix, spec.sync_timeout_s)
    finally:
        store.close()


def read_subsets(
    store: Store, run_id: str, indices, split: str = "train", timeout: float | None = None,
    *, seed: int = 0, epoch: int = 0, manifest: DatasetManifest | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`read_shards` of the data staged for `run_id`."""
    return read_shards(store, data_prefix(run_id), indices, split, timeout, seed=seed, epoch=epoch,
                       manifest=manifest)


def _text_rows(x: torch.Tensor, y: torch.Tensor, meta: dict[str, str], split: str, seed: int,
               epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A text subset's rows as a model reads them: int64, masked for the epoch if `mlm`."""
    info = TextInfo.from_dict(json.loads(meta["text"]))
    if info.objective == "mlm":
        return mlm_mask(x, info, seed=seed, epoch=epoch, first_index=int(meta["first"]), split=split)
    return x.long(), y.long()
