"""A files-of-arrays source prepared in cuts: the plan fixed up front from the headers, each cut
written by its own process, the manifest last from what the cuts wrote.

`plan_cuts` numbers every split's shards from its row count alone (shard i holds rows
[i * subset_size, (i + 1) * subset_size)), then groups consecutive shards into cuts: the shards
and their rows are the same whatever the parallelism, and so are their bytes and checksums.
`write_cut` writes one cut's shards (`engine.shards.write_shard`, resumable: a whole shard
already there with the same bytes is kept), reading only the source rows of its own shards
(`engine.array_source.RowReader`): a cut holds one shard's rows at a time. `arrays_manifest`
assembles the manifest from the cuts' `ShardInfo` rows and the layout, without reading data.
The inputs and targets become tensors by the rules a dataset factory's do (`engine.datasets`).
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from comm.store import Store
from comm.tensor_codec import encode_tensors
from core.errors import ZooidValueError
from engine.array_source import SPLITS, ArrayLayout, ArrayPart, RowReader
from engine.datasets import _as_inputs, _as_targets
from engine.objective import IGNORE_INDEX
from engine.shards import DatasetManifest, ShardInfo, write_shard


@dataclass(frozen=True)
class Cut:
    """Consecutive shards [first, first + shards) of one split, written by one task run."""

    split: str
    first: int
    shards: int
    subset_size: int
    split_rows: int
    """The split's rows (its last shard may be shorter)."""
    parts: tuple[ArrayPart, ...] = ()
    """The source's parts that hold its rows, in order (all a cut's process reads)."""
    parts_start: int = 0
    """The split's row where `parts[0]` begins."""

    @property
    def last(self) -> int:
        return self.first + self.shards - 1

    def rows_of(self, index: int) -> tuple[int, int]:
        """The split's rows [start, stop) that shard `index` holds."""
        return index * self.subset_size, min((index + 1) * self.subset_size, self.split_rows)

    @property
    def label(self) -> str:
        """Its task run's name: which shards it writes."""
        span = f"shard {self.first}" if self.shards == 1 else f"shards {self.first}-{self.last}"
        return f"cut {self.split} {span}"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Cut:
        return cls(**{**d, "parts": tuple(ArrayPart.from_dict(p) for p in d.get("parts", ()))})

    def read(self, reader: RowReader, index: int) -> tuple[np.ndarray, np.ndarray]:
        """The source rows of shard `index` (from `parts`, through `reader`)."""
        start, stop = self.rows_of(index)
        return reader.rows(self.parts, start - self.parts_start, stop - self.parts_start)


def plan_cuts(layout: ArrayLayout, subset_size: int, workers: int) -> list[Cut]:
    """Every split's shards of `subset_size` rows, in cuts of consecutive shards: about
    `workers` cuts over the training split (each at least one shard) and the validation split's
    shards in cuts of the same size."""
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ZooidValueError("workers", f"must be a positive integer, got {workers!r}")
    counts = {split: math.ceil(layout.rows(split) / subset_size) for split in SPLITS}
    per_cut = max(1, math.ceil(counts["train"] / workers))
    cuts = []
    for split in SPLITS:
        rows = layout.rows(split)
        for first in range(0, counts[split], per_cut):
            cut = Cut(split, first, min(per_cut, counts[split] - first), subset_size, rows)
            start, stop = cut.rows_of(first)[0], cut.rows_of(cut.last)[1]
            parts, at, parts_start = [], 0, None
            for part in layout.splits[split]:
                if at < stop and at + part.rows > start:
                    parts.append(part)
                    parts_start = at if parts_start is None else parts_start
                at += part.rows
            cuts.append(dataclasses.replace(cut, parts=tuple(parts), parts_start=parts_start or 0))
    return cuts


def _tensor(array: np.ndarray) -> torch.Tensor:
    """A NumPy array as a tensor: native byte order; integers other than bytes as int64."""
    if array.dtype.kind in "iu" and array.dtype != np.uint8:
        array = array.astype(np.int64)
    elif not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    return torch.from_numpy(array)


def shard_tensors(x: np.ndarray, y: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """A shard's rows as the tensors a factory's (x, y) become (`engine.datasets`)."""
    return _as_inputs(_tensor(x)), _as_targets(_tensor(y))


def _top(t: torch.Tensor) -> int | None:
    """The largest integer id in `t` (None: float, or none)."""
    if t.is_floating_point() or not t.numel():
        return None
    return int(t.max())


def _most(*values: int | None) -> int | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def write_cut(store: Store, prefix: str, source: Store, cut: Cut, *, resume: bool = True) -> dict[str, Any]:
    """Write `cut`'s shards of the source (its `parts` in `source`) under `prefix` of `store`, one
    shard's rows in memory at a time. Returns (JSON-able) the shards' `ShardInfo` rows in order,
    how many were written (the rest kept), the largest id of the inputs and the largest scored
    target (integer data; None else), and the process that wrote them."""
    infos, written, x_top, y_top = [], 0, None, None
    with RowReader(source) as reader:
        for index in range(cut.first, cut.first + cut.shards):
            start, stop = cut.rows_of(index)
            x, y = shard_tensors(*cut.read(reader, index))
            blob = encode_tensors({"x": x.contiguous(), "y": y.contiguous()})
            info, wrote = write_shard(store, prefix, cut.split, index, blob, stop - start, resume=resume)
            infos.append(dataclasses.asdict(info))
            written += wrote
            x_top = _most(x_top, _top(x), _top(y))  # a model's embedding holds every id (`engine.datasets.id_bound`)
            y_top = _most(y_top, _top(y if y.is_floating_point() else y[y != IGNORE_INDEX]))
    return {"cut": cut.to_dict(), "shards": infos, "written": written, "x_top": x_top, "y_top": y_top,
            "pid": os.getpid()}


def run_cut_job(job: dict[str, Any], open_ref: Callable[[str], Store]) -> dict[str, Any]:
    """Write one cut, in the process that runs it: `job` holds the cut (`Cut.to_dict`), the
    source's and the destination's store references (`source`, `to`, opened with `open_ref`) and
    the destination prefix (`prefix`). Returns `write_cut`'s result."""
    cut = Cut.from_dict(job["cut"])
    source = open_ref(job["source"])
    try:
        store = open_ref(job["to"])
        try:
            return write_cut(store, job.get("prefix", ""), source, cut)
        finally:
            store.close()
    finally:
        source.close()


def arrays_manifest(name: str, layout: ArrayLayout, cuts: list[Cut], done: list[dict[str, Any]],
                    settings: dict[str, Any], prepared_by: str = "") -> DatasetManifest:
    """The manifest of a source prepared in `cuts`, from what each cut returned (`done`, in
    the order of `cuts`): the shards in order, the sizes, dtypes and integer bounds."""
    shards: dict[str, list[ShardInfo]] = {split: [] for split in SPLITS}
    for cut, result in sorted(zip(cuts, done), key=lambda c: (SPLITS.index(c[0].split), c[0].first)):
        shards[cut.split] += [ShardInfo(**s) for s in result["shards"]]
    first = layout.first
    x0, y0 = shard_tensors(np.zeros((0, *first.x.row_shape), np.dtype(first.x.dtype)),
                           np.zeros((0, *first.y.row_shape), np.dtype(first.y.dtype)))
    y_tops = [r["y_top"] for r in done if r["y_top"] is not None]
    x_tops = [r["x_top"] for r in done if r["x_top"] is not None]
    classes = 0 if y0.is_floating_point() else (max(y_tops) + 1 if y_tops else 0)
    return DatasetManifest(
        name=name, subset_size=cuts[0].subset_size if cuts else settings["subset_size"],
        n_train=layout.rows("train"), n_val=layout.rows("val"), n_subsets=len(shards["train"]),
        n_val_subsets=len(shards["val"]), input_shape=first.x.row_shape, classes=classes,
        id_bound=0 if x0.is_floating_point() else 1 + max(x_tops, default=-1),
        dtypes={"x": str(x0.dtype), "y": str(y0.dtype)}, shards=shards, settings=settings,
        prepared_by=prepared_by)
