"""A prepared dataset: fixed-size shards and a manifest under one prefix of any store.

Layout (`core.keys.shard_key`, `shard_manifest_key`), under a prefix that is a run's staged data
(`runs/<run>/data`) or the root of a bucket a user prepared (`flows.prepare`):

    [<prefix>/]train/<i>, [<prefix>/]val/<i>   one shard each: tensors `x`, `y` (`comm.tensor_codec`)
    [<prefix>/]manifest.json                  written last: its presence means every shard is whole

The manifest (`DatasetManifest`) holds the sample counts, the input shape and dtypes, each
shard's rows, bytes and SHA-256, the settings that prepared it (source, shard rows, text
settings) and what prepared it. A reader checks a shard against its checksum (`fetch_shard`),
retries a shard that is missing or does not match, and then fails naming the shard: nothing
is skipped silently. A manifest of another format, or none, is refused in one line naming
`dataset` (`read_dataset_manifest`).

Writing is resumable (`write_shard`): a put is atomic, so a shard already in the store is whole,
and one whose checksum matches what this prepare would write is kept rather than written again.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from comm.store import Store
from core.errors import DataError, StoreError, ZooidValueError
from core.keys import shard_key, shard_manifest_key
from engine.text_data import TextInfo

FORMAT = 1
"""The manifest format this code writes and reads; another is refused, naming `dataset`."""
SPLITS = ("train", "val")
READ_TRIES = 3
"""Reads of a shard before a missing or corrupt one fails the worker's attempt."""
RETRY_PAUSE_S = 0.2
"""Pause before the second read of a shard; doubled before each next one."""


class ShardError(DataError):
    """A shard that stayed missing or corrupt after `READ_TRIES` reads (one line naming it)."""


@dataclass(frozen=True)
class ShardInfo:
    """One shard as written: its rows, its bytes in the store and their SHA-256."""

    rows: int
    bytes: int
    sha256: str

    @classmethod
    def of(cls, data: bytes, rows: int) -> "ShardInfo":
        return cls(rows=rows, bytes=len(data), sha256=hashlib.sha256(data).hexdigest())


@dataclass(frozen=True, kw_only=True)
class DatasetManifest:
    """What a prepared dataset holds: sizes, shard counts and checksums, JSON-able."""

    name: str
    """The source it was prepared from (a dataset name the job accepts)."""
    subset_size: int
    """Rows per shard (the last of a split may be shorter)."""
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
    id_bound: int = 0
    """One more than the largest integer id of its inputs and targets (a language model's
    smallest vocabulary); 0 for float inputs."""
    format: int = FORMAT
    dtypes: dict[str, str] = field(default_factory=dict)
    """The stored dtype of `x` and `y` (`torch.float32`, `torch.int32` ...)."""
    shards: dict[str, list[ShardInfo]] = field(default_factory=dict)
    """Per split, each shard's rows, bytes and checksum, in order."""
    settings: dict[str, Any] = field(default_factory=dict)
    """What prepared it: source, shard rows, text settings; preparing again with equal settings
    is a no-op."""
    prepared_by: str = ""
    """The Zooid commit (or version) that prepared it."""

    def shard(self, split: str, index: int) -> ShardInfo | None:
        """Shard `index` of `split` as written; None for a manifest without checksums."""
        shards = self.shards.get(split) or []
        return shards[index] if 0 <= index < len(shards) else None

    @property
    def total_bytes(self) -> int:
        return sum(s.bytes for split in self.shards.values() for s in split)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DatasetManifest":
        """Inverse of `to_dict` (a manifest staged before checksums has no `shards`)."""
        text = TextInfo.from_dict(d["text"]) if d.get("text") else None
        shards = {split: [ShardInfo(**s) for s in rows] for split, rows in (d.get("shards") or {}).items()}
        return cls(**{**d, "input_shape": tuple(d["input_shape"]), "text": text, "shards": shards})


def write_shard(store: Store, prefix: str, split: str, index: int, data: bytes, rows: int,
                *, resume: bool = False) -> tuple[ShardInfo, bool]:
    """Put shard `index` of `split` unless `resume` finds it there already with the same bytes;
    returns its info and whether it was written."""
    info = ShardInfo.of(data, rows)
    key = shard_key(prefix, split, index)
    if resume and store.exists(key) and hashlib.sha256(store.get(key)).hexdigest() == info.sha256:
        return info, False
    store.put(key, data)
    return info, True


def write_manifest(store: Store, prefix: str, manifest: DatasetManifest) -> None:
    """Write the manifest, last: its presence means every shard is readable."""
    store.put(shard_manifest_key(prefix), json.dumps(manifest.to_dict()).encode())


def _where(store: Store, prefix: str) -> str:
    return f"{store.url.rstrip('/')}/{prefix}" if prefix else store.url


def read_dataset_manifest(store: Store, prefix: str, timeout: float | None = None,
                          field_name: str = "dataset") -> DatasetManifest:
    """The manifest of the dataset at `prefix`; ZooidValueError naming `field_name` when there
    is none, or it is of another format."""
    try:
        raw = store.get(shard_manifest_key(prefix), timeout=timeout)
    except (KeyError, StoreError):
        raise ZooidValueError(field_name, f"no prepared dataset at {_where(store, prefix)} (no manifest.json; "
                              "prepare one with `python -m flows.prepare`)") from None
    try:
        doc = json.loads(raw)
        version = doc.get("format", FORMAT) if isinstance(doc, dict) else None
    except ValueError:
        version = None
    if version != FORMAT:
        raise ZooidValueError(field_name, f"the manifest at {_where(store, prefix)} is format {version!r}; "
                              f"this Zooid reads format {FORMAT}: prepare the dataset again")
    return DatasetManifest.from_dict(doc)


def fetch_shard(store: Store, prefix: str, split: str, index: int, info: ShardInfo | None,
                timeout: float | None = None, tries: int = READ_TRIES) -> bytes:
    """Shard `index` of `split`, checked against `info`'s checksum (None: unchecked). A shard
    that is missing, whose store stalls, or whose bytes do not match is read again, up to
    `tries` reads in all; then `ShardError` names it."""
    key = shard_key(prefix, split, index)
    pause, problem = RETRY_PAUSE_S, ""
    for attempt in range(tries):
        if attempt:
            time.sleep(pause)
            pause *= 2
        try:
            data = store.get(key, timeout=timeout)
        except KeyError:
            problem = "missing"
            continue
        except StoreError as exc:
            problem = f"unreadable ({type(exc).__name__})"
            continue
        if info is None or hashlib.sha256(data).hexdigest() == info.sha256:
            return data
        problem = f"corrupt (SHA-256 does not match the manifest's, {len(data)} bytes against {info.bytes})"
    raise ShardError(f"dataset shard {key} of {store.url} is {problem} after {tries} reads")


class ShardCache:
    """Decoded shards kept by a worker, least recently used first out, within `max_bytes`
    (None: unbounded, as a warm worker keeps a run's staged subsets)."""

    def __init__(self, max_bytes: int | None = None):
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[tuple, tuple[Any, int]] = OrderedDict()

    def get(self, key: tuple):
        hit = self._items.get(key)
        if hit is None:
            return None
        self._items.move_to_end(key)
        return hit[0]

    def put(self, key: tuple, value, size: int) -> None:
        if self.max_bytes is not None and size > self.max_bytes:
            return
        old = self._items.pop(key, None)
        if old is not None:
            self.bytes -= old[1]
        self._items[key] = (value, size)
        self.bytes += size
        while self.max_bytes is not None and self.bytes > self.max_bytes:
            _, (_, dropped) = self._items.popitem(last=False)
            self.bytes -= dropped

    def __len__(self) -> int:
        return len(self._items)
