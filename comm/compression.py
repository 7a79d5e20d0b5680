"""Compressed store syncs: the wire form of a collective's pieces and one rank's
error-feedback residual (`core.outer_sync` names the dtypes).

A `Compressor` is handed to a store collective (`comm.collectives`, `comm.scatter_reduce`)
as `compressor=`; every piece a rank uploads (its share of another rank's slice, and its
own reduced slice) then travels as bfloat16, or as int8 with one scale per `INT8_BLOCK`
values, and is decoded to the tensor's own dtype on arrival. Every rank decodes the same
bytes, so the replicas still agree bit for bit.

Error feedback: the rank keeps one residual vector per dtype, as long as the flat vector it
syncs. Before a piece is encoded the residual's part of it is added, and what the encoding
dropped is kept for the next call, so over a run no update is lost, only delayed. For slice
j != rank the residual holds this rank's unsent share of its contribution; for its own slice
it holds what rounding the reduced slice dropped. The update still owed to slice j is
therefore `e_jj + (1/world) * sum_{i != j} e_ij` (`pending`), which `residual_for` hands
to another world size unchanged (each new rank keeps its own slice of it).

Exact positions (`Compressor.exact`, a model's buffers: batch-norm running statistics): a
caller may mark positions of the flat vector that must not be rounded. They travel in their
own dtype beside the rounded vector and owe no residual, so a running variance comes back as
the mean of non-negative values (never below zero), whatever else shares its int8 block.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from core.errors import ZooidValueError
from core.outer_sync import INT8_BLOCK, SYNC_DTYPES

Flat = dict[str, torch.Tensor]
"""One flat vector per dtype name (`comm.collectives.flatten_by_dtype`)."""


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def quantize_int8(v: torch.Tensor, block: int = INT8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales): `v` (1-D) in blocks of `block` values, each scaled by max|x| / 127
    and rounded to int8 in -127..127; scales in `v`'s dtype, 0 for an all-zero block."""
    codes, scale, _ = _quantize(v, block)
    return codes, scale


def _quantize(v: torch.Tensor, block: int = INT8_BLOCK) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`quantize_int8`'s (codes, scales) and the values they decode to (`dequantize_int8`'s,
    bit for bit: the same integers times the same scales), from one pass over `v`."""
    n = v.numel()
    blocks = F.pad(v, (0, (-n) % block)).view(-1, block)
    scale = blocks.abs().amax(1) / 127
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    rounded = torch.round(blocks / safe[:, None]).clamp_(-127, 127)
    codes = rounded.to(torch.int8).view(-1)[:n].contiguous()
    return codes, scale, rounded.mul_(scale[:, None]).view(-1)[:n]


def dequantize_int8(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                    block: int = INT8_BLOCK) -> torch.Tensor:
    """The values `quantize_int8` encoded, in `dtype`."""
    n = codes.numel()
    blocks = F.pad(codes.to(dtype), (0, (-n) % block)).view(-1, block)
    return (blocks * scale.to(dtype)[:, None]).view(-1)[:n]


def encode_flat(flat: Flat, sync_dtype: str, exact: Flat | None = None) -> Flat:
    """The wire tensors of `flat` in `sync_dtype` (safetensors names `<dtype>` or
    `<dtype>.q` / `<dtype>.s`, and `<dtype>.x` / `<dtype>.i`).

    `exact`: per dtype name, a bool mask over the vector of the positions that travel as
    they are (a model's buffers): their values as `<dtype>.x` in their own dtype and their
    positions as `<dtype>.i`; the rounded vector carries zeros there, so they neither come
    back rounded nor widen an int8 block's scale."""
    return _encode_flat(flat, sync_dtype, exact)[0]


def _encode_flat(flat: Flat, sync_dtype: str, exact: Flat | None = None) -> tuple[Flat, Flat]:
    """(`encode_flat`'s wire, what `decode_flat` reads back from it), in one pass a vector."""
    if sync_dtype == "float32":
        return flat, flat
    out, sent = {}, {}
    for d, v in flat.items():
        mask = _mask_of(exact, d, v)
        if mask is not None:
            out[f"{d}.x"] = v[mask].contiguous()
            where = torch.nonzero(mask).view(-1)
            out[f"{d}.i"] = where.to(torch.int32) if v.numel() < 2**31 else where
            rounded = torch.where(mask, torch.zeros_like(v), v)
        else:
            rounded = v
        if sync_dtype == "bfloat16":
            out[d] = rounded.to(torch.bfloat16)
            sent[d] = out[d].to(v.dtype)
        else:
            out[f"{d}.q"], out[f"{d}.s"], sent[d] = _quantize(rounded)
        if mask is not None:
            sent[d] = torch.where(mask, v, sent[d])
    return out, sent


def _mask_of(exact: Flat | None, d: str, v: torch.Tensor) -> torch.Tensor | None:
    """The exact positions of vector `d` (None: none)."""
    mask = None if exact is None else exact.get(d)
    if mask is None or not bool(mask.any()):
        return None
    if mask.shape != v.shape:
        raise ValueError(f"exact mask of {d} has {mask.numel()} values, the vector {v.numel()}")
    return mask


def decode_flat(wire: Flat) -> Flat:
    """`encode_flat`'s input back, as rounding left it, in each vector's own dtype (the
    names say how each travelled; exact positions come back as they were sent)."""
    out = {}
    for name, v in wire.items():
        if name.endswith(".q"):
            out[name[:-2]] = dequantize_int8(v, wire[f"{name[:-2]}.s"], _dtype(name[:-2]))
        elif not name.endswith((".s", ".x", ".i")):
            out[name] = v.to(_dtype(name))
    for name, v in wire.items():
        if name.endswith(".x"):
            d = name[:-2]
            if d in wire and out[d].data_ptr() == wire[d].data_ptr():
                out[d] = out[d].clone()   # never write into the wire's own tensor
            out[d][wire[f"{d}.i"].long()] = v.to(_dtype(d))
    return out


class Compressor:
    """One rank's wire format for a group of syncs and its error-feedback residual.

    `residual` is `{dtype name: flat vector}` (empty: zeros). `before_result` runs after
    the rank has computed its reduced slice (its residual is then final for the call) and
    before it posts it: whoever must persist the residual does it there (see
    `engine.local_sgd_epoch`)."""

    def __init__(self, sync_dtype: str, residual: Flat | None = None,
                 before_result: Callable[[], None] | None = None):
        if sync_dtype not in SYNC_DTYPES:
            raise ZooidValueError("sync_dtype", f"must be one of {', '.join(SYNC_DTYPES)}, got {sync_dtype!r}")
        self.sync_dtype = sync_dtype
        self.residual: Flat = dict(residual or {})
        self.before_result = before_result
        self.flushing = False
        """Send the next calls losslessly with the residual added: it ends at zero (a
        group of syncs whose residual must not outlive it, `engine.pipeline_stage_worker`)."""
        self.exact: Flat | None = None
        """Per dtype name, a bool mask over the call's flat vector (`comm.collectives.flatten_by_dtype`
        of the tensors the caller syncs) of the positions that travel exactly and owe no
        residual: a model's buffers (`engine.local_sgd`); None: every position is rounded."""
        self._world = 1

    @property
    def lossy(self) -> bool:
        """Whether the wire drops anything (everything but float32)."""
        return self.sync_dtype != "float32"

    def begin(self, flat: Flat, world: int) -> None:
        """Start a call on `flat` among `world` ranks: a residual of another layout is zeros,
        and so is its part at exact positions (nothing is owed there)."""
        self._world = world
        for d, v in flat.items():
            r = self.residual.get(d)
            if r is None or r.shape != v.shape or r.dtype != v.dtype:
                self.residual[d] = torch.zeros_like(v)
            mask = _mask_of(self.exact, d, v)
            if mask is not None:
                self.residual[d][mask] = 0

    def _part(self, d: str, j: int) -> torch.Tensor:
        return torch.tensor_split(self.residual[d], self._world)[j]

    def _exact_part(self, j: int) -> Flat | None:
        if self.exact is None:
            return None
        return {d: torch.tensor_split(m, self._world)[j] for d, m in self.exact.items()}

    def encode(self, piece: Flat, j: int) -> Flat:
        """The wire form of `piece` (slice `j` of the call's flat vector) with this rank's
        residual of slice j added; the residual keeps what the encoding dropped (nothing at
        exact positions, which travel as they are)."""
        return self._encode(piece, j)[0]

    def _encode(self, piece: Flat, j: int) -> tuple[Flat, Flat]:
        """(`encode`'s wire, the values every rank decodes from it)."""
        corrected = {d: v + self._part(d, j) for d, v in piece.items()}
        wire, sent = _encode_flat(corrected, "float32" if self.flushing else self.sync_dtype, self._exact_part(j))
        for d, v in corrected.items():
            torch.sub(v, sent[d], out=self._part(d, j))
        return wire, sent

    def decode(self, wire: Flat) -> Flat:
        """The values a wire piece carries, in their own dtypes."""
        return decode_flat(wire)

    def result(self, mean: Flat, rank: int) -> tuple[Flat, Flat]:
        """(wire, values) of this rank's reduced slice: encoded with its residual, and what
        every rank will read back from it (this rank uses the same values)."""
        wire, sent = self._encode(mean, rank)
        if self.before_result is not None:
            self.before_result()
        return wire, sent


def pending(residuals: list[Flat]) -> Flat:
    """The update still owed per dtype by ranks 0..world-1 with these residuals (module
    docstring): slice j gets rank j's own part plus the mean of the others' parts."""
    world = len(residuals)
    out = {}
    for d in residuals[0]:
        slices = []
        for j in range(world):
            parts = [torch.tensor_split(r[d], world)[j] for r in residuals]
            slices.append(parts[j] + sum(p for i, p in enumerate(parts) if i != j) / world)
        out[d] = torch.cat(slices)
    return out


def residual_for(residuals: list[Flat], rank: int, world: int) -> Flat:
    """Rank `rank`'s residual in a group of `world` ranks that continues `residuals` (the
    previous group's, by rank): the same world keeps each rank's own; another one gives
    every rank its own slice of `pending`, zeros elsewhere, so the owed update is unchanged."""
    if len(residuals) == world:
        return {d: v.clone() for d, v in residuals[rank].items()}
    owed = pending(residuals)
    out = {}
    for d, v in owed.items():
        r = torch.zeros_like(v)
        torch.tensor_split(r, world)[rank].copy_(torch.tensor_split(v, world)[rank])
        out[d] = r
    return out
