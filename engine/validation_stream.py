"""A validation pass read chunk by chunk through `engine.shard_stream.ShardStream` (issue #44).

A worker that evaluates scores the validation split in the chunks `validation_metrics` would
cut it into (`validation_chunk`, or a pipeline's `val_chunk` split), each chunk's rows read
from the shards as it comes, so its memory is a few validation shards and chunks, not the
split; the figures equal scoring the whole split at once in the same chunks.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch
from torch import nn

from engine.datasets import ShardSource
from engine.local_sgd import chunked_metrics, validation_chunk
from engine.objective import CROSS_ENTROPY, Metrics, Objective
from engine.shard_stream import ShardStream
from engine.shards import DatasetManifest


def manifest_chunk(manifest: DatasetManifest) -> int:
    """`validation_chunk` of the dataset's rows, from its manifest (the inputs' shape and stored
    dtype; a text dataset's inputs are integer token rows)."""
    name = (manifest.dtypes or {}).get("x", "torch.int64" if manifest.text is not None else "torch.float32")
    dtype = getattr(torch, name.removeprefix("torch."))
    return validation_chunk(torch.empty((0, *manifest.input_shape), dtype=dtype))


def chunk_ids(n: int, chunk: int) -> list[np.ndarray]:
    """Ids 0..n-1 in consecutive chunks of `chunk` (the last shorter)."""
    return [np.arange(start, min(start + chunk, n)) for start in range(0, n, chunk)]


def streamed_validation(model: nn.Module, source: ShardSource, objective: Objective = CROSS_ENTROPY, *,
                        seed: int = 0, convert: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
                        readahead_mb: float | None = None) -> Metrics:
    """`validation_metrics` of `model` on the validation split of `source`, read chunk by chunk
    (`manifest_chunk` rows), each tensor passed through `convert` (the worker's compute dtype)."""
    manifest = source.manifest
    batches = chunk_ids(manifest.n_val, manifest_chunk(manifest))
    with ShardStream(source, batches, "val", seed=seed, readahead_mb=readahead_mb) as stream:
        return chunked_metrics(model, _converted(stream, convert), objective)


def _converted(stream: ShardStream, convert) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    for x, y in stream:
        yield convert(x), convert(y)


class ChunkRows:
    """The inputs and targets of a pipeline's validation chunks (`batches`, read by a
    `ShardStream` in order) as its schedule takes them: `take(m, part)` gives chunk m's inputs
    (part 0) or targets (part 1), each passed through `convert`; chunks are read in order and a
    chunk is kept only until every part in `parts` (what this worker uses) was taken. `close()`
    stops the stream."""

    def __init__(self, source: ShardSource, batches: list[np.ndarray], parts: tuple[int, ...], *,
                 seed: int = 0, epoch: int = 0, convert: Callable[[torch.Tensor], torch.Tensor] = lambda t: t):
        self._stream = ShardStream(source, batches, "val", seed=seed, epoch=epoch)
        self._rows = iter(self._stream)
        self._parts, self._convert = parts, convert
        self._next = 0
        self._kept: dict[int, dict[int, torch.Tensor]] = {}

    def take(self, m: int, part: int) -> torch.Tensor:
        while self._next <= m:
            xy = next(self._rows)
            self._kept[self._next] = {p: self._convert(xy[p]) for p in self._parts}
            self._next += 1
        kept = self._kept[m]
        t = kept.pop(part)
        if not kept:
            del self._kept[m]
        return t

    def close(self) -> None:
        self._kept.clear()
        self._stream.close()
