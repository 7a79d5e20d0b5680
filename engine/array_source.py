"""A files-of-arrays source, `arrays:<URL or path>`: NumPy files in a store, planned from their
headers and read by row range, so a source far bigger than a process is cut without loading it.

Layout, under the root the reference names (a directory path, `file://`, `s3://bucket/prefix`,
`az://container/prefix` or a store block `block:<type slug>/<name>`):

    train/<part>.npz                     arrays `x` and `y` (`np.savez`, or `np.savez_compressed`)
    train/<part>.x.npy, <part>.y.npy     or a pair of `.npy` files per part
    val/...                              the validation split, laid out the same way

A split's rows are its parts' rows, the parts in the order of their names (`part-000`,
`part-001`, ...). Every part's `x` has the same row shape and dtype, across both splits, and
every part's `y` too; a part's `x` and `y` have the same rows. Planning reads only headers
(`scan_arrays`: each array's rows, dtype, row shape and where its data starts; an `.npz`'s zip
directory), and checks every file holds the rows its header promises. A reader then fetches
only the bytes of the rows it asks for (`RowReader`, through `Store.get_range`); a member of a
compressed `.npz` is inflated from its start up to those rows, never held whole, and stays open
for the next rows, so a cut reading its shards in order inflates it once. Nothing is
unpickled (`allow_pickle=False` throughout): an object dtype is refused, as is a Fortran-ordered
array. Each problem is one line naming `dataset`.
"""
from __future__ import annotations

import hashlib
import io
import json
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.lib.format as npy_format

from comm.store import Store
from core.errors import ZooidValueError
from core.keys import array_split_prefix

ARRAYS = "arrays:"
"""A files-of-arrays source's prefix in a dataset name."""
SPLITS = ("train", "val")
NPZ, X_NPY, Y_NPY = ".npz", ".x.npy", ".y.npy"
HEADER_READ = 4 << 10
"""Bytes fetched at once while reading a header or a zip directory (a `.npy` header is
usually 128 bytes)."""
INFLATE_READ = 1 << 20
"""Bytes fetched at once while inflating a compressed `.npz` member."""
_LOCAL_HEADER = struct.Struct(zipfile.structFileHeader)
_NAME_LEN, _EXTRA_LEN = 10, 11
"""Fields of a zip local file header: the lengths of the name and extra field after it."""


def is_arrays(name: object) -> bool:
    """Whether dataset `name` is a files-of-arrays source (`arrays:...`)."""
    return isinstance(name, str) and name.startswith(ARRAYS)


def arrays_ref(name: str) -> str:
    """The store reference of `arrays:<URL or path>`: a URL or block as given, a plain path as
    the absolute `file://` URL of that directory (other processes open it the same)."""
    ref = name[len(ARRAYS):].strip() if is_arrays(name) else ""
    if not ref:
        raise ZooidValueError("dataset", f"{name!r}: say where the arrays are: arrays:<directory, file://, s3:// "
                              "or az:// URL, or store block>")
    if "://" in ref or ":" in ref.split("/")[0]:  # a URL, or a store block's reference
        return ref
    return Path(ref).expanduser().resolve().as_uri()


@dataclass(frozen=True)
class ArrayFile:
    """One array as its header describes it: where it is and how its rows are laid out."""

    key: str
    """The store key of its `.npy`, or of the `.npz` holding it."""
    member: str | None
    """Its member in the `.npz` (`x.npy`, `y.npy`); None for a `.npy` file."""
    dtype: str
    """NumPy's dtype string (`<f4`, `|u1`, ...)."""
    row_shape: tuple[int, ...]
    rows: int
    offset: int
    """Where its first row starts: in the file, or in the inflated member when `compressed`."""
    compressed: bool = False

    @property
    def row_bytes(self) -> int:
        return np.dtype(self.dtype).itemsize * int(np.prod(self.row_shape, dtype=np.int64))

    @property
    def where(self) -> str:
        return f"{self.key} ({self.member.removesuffix('.npy')})" if self.member else self.key


@dataclass(frozen=True)
class ArrayPart:
    """One part of a split: its inputs `x` and targets `y`, row for row."""

    name: str
    x: ArrayFile
    y: ArrayFile

    @property
    def rows(self) -> int:
        return self.x.rows

    @classmethod
    def from_dict(cls, d: dict) -> ArrayPart:
        """Inverse of `dataclasses.asdict` (a cut's parts travel to its process as JSON)."""
        def array(a: dict) -> ArrayFile:
            return ArrayFile(**{**a, "row_shape": tuple(a["row_shape"])})

        return cls(d["name"], array(d["x"]), array(d["y"]))


@dataclass(frozen=True)
class ArrayLayout:
    """A files-of-arrays source as planned from its headers."""

    splits: dict[str, tuple[ArrayPart, ...]]
    fingerprint: str
    """SHA-256 of every file's key and size: another file, or one of another size, changes it."""

    def rows(self, split: str) -> int:
        return sum(p.rows for p in self.splits[split])

    @property
    def first(self) -> ArrayPart:
        return self.splits["train"][0]

    @property
    def input_shape(self) -> tuple[int, ...]:
        return self.first.x.row_shape


class _RangeFile(io.RawIOBase):
    """The bytes under one key of a store as a seekable file, each read a `Store.get_range`
    (what `zipfile` and NumPy's header reader read from)."""

    def __init__(self, store: Store, key: str, size: int, base: int = 0):
        super().__init__()
        self.store, self.key, self.size, self.pos = store, key, size, base

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.pos = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence] + offset
        return self.pos

    def readinto(self, buffer) -> int:
        n = max(0, min(len(buffer), self.size - self.pos))
        data = self.store.get_range(self.key, self.pos, n) if n else b""
        buffer[: len(data)] = data
        self.pos += len(data)
        return len(data)


def _opened(store: Store, key: str, size: int, base: int = 0, buffer: int = HEADER_READ) -> io.BufferedReader:
    return io.BufferedReader(_RangeFile(store, key, size, base), buffer_size=buffer)


def _refuse(what: str) -> ZooidValueError:
    return ZooidValueError("dataset", what)


def _read_header(fp, where: str) -> tuple[np.dtype, tuple[int, ...]]:
    """The dtype and shape in the `.npy` header at `fp`'s position (left at the data)."""
    try:
        version = npy_format.read_magic(fp)
        read = npy_format.read_array_header_1_0 if version == (1, 0) else npy_format.read_array_header_2_0
        shape, fortran, dtype = read(fp)
    except (ValueError, EOFError, OSError) as exc:
        raise _refuse(f"{where} is not a NumPy .npy array ({exc})") from None
    if dtype.hasobject:
        raise _refuse(f"{where} holds Python objects ({dtype}); only plain numeric arrays are read, never unpickled")
    if not shape:
        raise _refuse(f"{where} is a scalar; x and y need one row per sample")
    if fortran and len(shape) > 1:
        raise _refuse(f"{where} is stored in Fortran order; save it C-ordered (np.ascontiguousarray)")
    return dtype, tuple(int(d) for d in shape)


def _npy_file(store: Store, key: str) -> ArrayFile:
    size = store.size(key)
    with _opened(store, key, size) as fp:
        dtype, shape = _read_header(fp, key)
        offset = fp.tell()
    array = ArrayFile(key, None, dtype.str, shape[1:], shape[0], offset)
    _check_length(array, size - offset)
    return array


def _npz_files(store: Store, key: str) -> tuple[ArrayFile, ArrayFile]:
    size = store.size(key)
    try:
        with _opened(store, key, size) as raw, zipfile.ZipFile(raw) as zf:
            out = []
            for member in ("x.npy", "y.npy"):
                try:
                    info = zf.getinfo(member)
                except KeyError:
                    raise _refuse(f"{key} has no array {member.removesuffix('.npy')!r} (np.savez(path, x=..., y=...) "
                                  f"makes one)") from None
                if info.flag_bits & 0x1:
                    raise _refuse(f"{key}: {member} is encrypted")
                out.append(_member_file(store, key, size, zf, info))
            return out[0], out[1]
    except zipfile.BadZipFile as exc:
        raise _refuse(f"{key} is not an .npz archive ({exc})") from None


def _member_file(store: Store, key: str, size: int, zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> ArrayFile:
    where = f"{key} ({info.filename.removesuffix('.npy')})"
    if info.compress_type == zipfile.ZIP_STORED:  # its bytes lie in the file as they are: read ranges of it
        local = _LOCAL_HEADER.unpack(store.get_range(key, info.header_offset, _LOCAL_HEADER.size))
        start = info.header_offset + _LOCAL_HEADER.size + local[_NAME_LEN] + local[_EXTRA_LEN]
        with _opened(store, key, size, start) as fp:
            dtype, shape = _read_header(fp, where)
            offset = fp.tell()
        array = ArrayFile(key, info.filename, dtype.str, shape[1:], shape[0], offset)
        _check_length(array, start + info.file_size - offset)
        return array
    with zf.open(info) as fp:
        dtype, shape = _read_header(fp, where)
        offset = fp.tell()
    array = ArrayFile(key, info.filename, dtype.str, shape[1:], shape[0], offset, compressed=True)
    _check_length(array, info.file_size - offset)
    return array


def _check_length(array: ArrayFile, data_bytes: int) -> None:
    if data_bytes < array.rows * array.row_bytes:
        held = data_bytes // array.row_bytes if array.row_bytes else 0
        raise _refuse(f"{array.where} holds {held} of the {array.rows} rows its header says (the file ends early)")


def _split_parts(store: Store, root: str, split: str) -> list[tuple[str, dict[str, str]]]:
    """(part name, {'npz': key} or {'x': key, 'y': key}) of one split, by name."""
    prefix = array_split_prefix(root, split)
    parts: dict[str, dict[str, str]] = {}
    for key in store.list(prefix):
        name = key[len(prefix):]
        for suffix, kind in ((NPZ, "npz"), (X_NPY, "x"), (Y_NPY, "y")):
            if name.endswith(suffix) and "/" not in name and len(name) > len(suffix):
                part = parts.setdefault(name[: -len(suffix)], {})
                part[kind] = key
                break
        else:
            raise _refuse(f"{key} is not <part>{NPZ}, <part>{X_NPY} or <part>{Y_NPY} (files of arrays lie directly "
                          f"under {prefix})")
    for name, files in parts.items():
        if "npz" in files and len(files) > 1:
            raise _refuse(f"{prefix}{name} is both an .npz and .npy files: keep one")
        if "npz" not in files and len(files) < 2:
            have, lack = ("x", "y") if "x" in files else ("y", "x")
            raise _refuse(f"{files[have]} has no {prefix}{name}.{lack}.npy beside it")
    return sorted(parts.items())


def scan_arrays(store: Store, root: str = "") -> ArrayLayout:
    """Plan the source under `root` of `store` from its files' headers (module docstring):
    refused in one line naming `dataset` when a split has no files, a part's x and y differ in
    rows, a file's rows differ in shape or dtype from the first part's, or a file is short."""
    splits, sizes = {}, []
    for split in SPLITS:
        found = _split_parts(store, root, split)
        if not found:
            raise _refuse(f"no {split} arrays under {store.url.rstrip('/')}/{array_split_prefix(root, split)} "
                          f"(expected <part>{NPZ} with x and y, or <part>{X_NPY} and <part>{Y_NPY})")
        parts = []
        for name, files in found:
            x, y = _npz_files(store, files["npz"]) if "npz" in files else (_npy_file(store, files["x"]),
                                                                          _npy_file(store, files["y"]))
            if x.rows != y.rows:
                raise _refuse(f"{split}/{name}: x has {x.rows} rows and y {y.rows}; a part's x and y pair row for row")
            parts.append(ArrayPart(name, x, y))
            sizes += [(k, store.size(k)) for k in sorted(set(files.values()))]
        splits[split] = tuple(parts)
    first = splits["train"][0]
    for part in (p for split in SPLITS for p in splits[split]):
        for mine, theirs in ((part.x, first.x), (part.y, first.y)):
            if (mine.row_shape, mine.dtype) != (theirs.row_shape, theirs.dtype):
                raise _refuse(f"{mine.where} has rows of shape {mine.row_shape} and dtype {np.dtype(mine.dtype)}, "
                              f"where {theirs.where} has {theirs.row_shape} {np.dtype(theirs.dtype)}: every file's "
                              "rows must match")
    fingerprint = hashlib.sha256(json.dumps(sizes).encode()).hexdigest()
    return ArrayLayout(splits, fingerprint)


class RowReader:
    """Reads rows of a source's arrays from `store`, fetching only their bytes. A member of a
    compressed `.npz` stays open between reads, so reading its rows in order (a cut's shards)
    inflates it once, not once per read; a read behind the open position opens it again.
    A context manager: `close` releases the open members."""

    def __init__(self, store: Store):
        self.store = store
        self._open: dict[tuple[str, str], tuple[io.BufferedReader, zipfile.ZipFile, io.IOBase]] = {}

    def _member(self, array: ArrayFile, at: int):
        """The open member stream of `array`, positioned at byte `at` of it."""
        key = (array.key, array.member)
        held = self._open.get(key)
        if held is not None and held[2].tell() > at:
            self._close(key)
            held = None
        if held is None:
            raw = _opened(self.store, array.key, self.store.size(array.key), buffer=INFLATE_READ)
            archive = zipfile.ZipFile(raw)
            held = self._open[key] = (raw, archive, archive.open(array.member))
        stream = held[2]
        stream.seek(at)  # forward: inflates and drops the bytes before `at`, a chunk at a time
        return stream

    def _close(self, key) -> None:
        for part in reversed(self._open.pop(key)):
            part.close()

    def close(self) -> None:
        for key in list(self._open):
            self._close(key)

    def __enter__(self) -> "RowReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def array_rows(self, array: ArrayFile, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of one array."""
        n, size = stop - start, array.row_bytes
        want = n * size
        if not array.compressed:
            data = self.store.get_range(array.key, array.offset + start * size, want)
        else:
            data = self._member(array, array.offset + start * size).read(want)
        if len(data) != want:
            raise _refuse(f"{array.where} ended at {len(data)} of the {want} bytes of rows {start}-{stop - 1}")
        return np.frombuffer(bytearray(data), dtype=np.dtype(array.dtype)).reshape(n, *array.row_shape)

    def rows(self, parts: tuple[ArrayPart, ...], start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows [start, stop) of a split (its `parts` in order, or the run of them that holds
        these rows, `start` and `stop` counted from the first) as (x, y), reading only the parts
        and bytes that hold them."""
        xs, ys, first = [], [], 0
        for part in parts:
            lo, hi = max(start, first), min(stop, first + part.rows)
            if lo < hi:
                xs.append(self.array_rows(part.x, lo - first, hi - first))
                ys.append(self.array_rows(part.y, lo - first, hi - first))
            first += part.rows
            if first >= stop:
                break
        if sum(len(x) for x in xs) != stop - start or not xs:
            raise ZooidValueError("rows", f"rows {start}-{stop - 1} are not all in these parts' {first} rows")
        return np.concatenate(xs), np.concatenate(ys)


def read_rows(store: Store, parts: tuple[ArrayPart, ...], start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows [start, stop) of a split (its `parts` in order) as (x, y), reading only the parts
    and bytes that hold them (`RowReader.rows`, once)."""
    with RowReader(store) as reader:
        return reader.rows(parts, start, stop)
