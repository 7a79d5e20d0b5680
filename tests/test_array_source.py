"""A files-of-arrays source (`engine.array_source`) and its cuts (`engine.array_cuts`), without
Prefect: headers planned without reading rows, a row range read by its bytes alone (`.npy`, a
stored and a compressed `.npz`, on a directory, S3 and Azure Blob), shards numbered the same whatever
the number of cuts, a cut's shards equal to the source rows, and each malformed source refused
in one line naming `dataset`."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from comm.store_dir import DirectoryStore
from comm.tensor_codec import decode_tensors
from core.errors import ZooidValueError
from core.keys import shard_key
from engine.array_cuts import Cut, arrays_manifest, plan_cuts, write_cut
from engine.array_source import HEADER_READ, INFLATE_READ, arrays_ref, read_rows, scan_arrays
from tests.bucket_stores import empty_store

N_TRAIN, N_VAL = 230, 37
ROW = (3, 32)


def source_arrays(seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((N_TRAIN + N_VAL, *ROW)).astype(np.float32)
    y = rng.integers(0, 7, N_TRAIN + N_VAL)
    return x, y


def write_source(root: Path, x: np.ndarray, y: np.ndarray) -> Path:
    """Train in three parts, one of each layout (a stored .npz, a compressed .npz, a .npy pair,
    named so that their order is not the order they were written in); val in one pair."""
    (root / "train").mkdir(parents=True)
    (root / "val").mkdir()
    np.save(root / "train" / "c.x.npy", x[180:N_TRAIN])
    np.save(root / "train" / "c.y.npy", y[180:N_TRAIN])
    np.savez(root / "train" / "a.npz", x=x[:100], y=y[:100])
    np.savez_compressed(root / "train" / "b.npz", x=x[100:180], y=y[100:180])
    np.save(root / "val" / "v.x.npy", x[N_TRAIN:])
    np.save(root / "val" / "v.y.npy", y[N_TRAIN:])
    return root


@pytest.fixture(params=["dir", "s3", "azure"])
def source(request, tmp_path):
    """The same source on a directory, in a bucket of the moto server and in an Azurite
    container: (store, x, y)."""
    x, y = source_arrays()
    root = write_source(tmp_path / "src", x, y)
    kind = request.param
    store = DirectoryStore(root) if kind == "dir" else empty_store(kind, request, tmp_path, "arr", "raw")
    if kind != "dir":
        for path in sorted(root.rglob("*.np?")):
            store.put(path.relative_to(root).as_posix(), path.read_bytes())
    yield store, x, y
    store.close()


@pytest.mark.parametrize("kind", ["dir", "s3", "azure"])
def test_a_range_read_takes_only_its_bytes(kind, request, tmp_path):
    store = empty_store(kind, request, tmp_path, "rng")
    with store:
        store.put("k", bytes(range(200)))
        assert store.size("k") == 200
        assert store.get_range("k", 10, 5) == bytes(range(10, 15))
        assert store.get_range("k", 195, 50) == bytes(range(195, 200))  # fewer where it ends
        assert store.get_range("k", 300, 5) == b""
        down = store.stats.bytes_down
        store.get_range("k", 0, 7)
        assert store.stats.bytes_down - down == 7
        with pytest.raises(KeyError):
            store.get_range("absent", 0, 1)
        with pytest.raises(KeyError):
            store.size("absent")


def test_headers_plan_the_source_and_any_row_range_reads_back_equal(source):
    store, x, y = source
    layout = scan_arrays(store)
    assert [p.name for p in layout.splits["train"]] == ["a", "b", "c"]  # by name
    assert (layout.rows("train"), layout.rows("val"), layout.input_shape) == (N_TRAIN, N_VAL, ROW)
    assert [p.x.compressed for p in layout.splits["train"]] == [False, True, False]
    assert store.stats.bytes_down <= 10 * HEADER_READ < x.nbytes / 2  # 8 headers and 2 zip directories, no rows
    for start, stop in ((0, N_TRAIN), (95, 105), (170, 190), (5, 6), (179, 181), (229, 230)):
        got_x, got_y = read_rows(store, layout.splits["train"], start, stop)
        assert np.array_equal(got_x, x[start:stop]) and np.array_equal(got_y, y[start:stop])
    got_x, got_y = read_rows(store, layout.splits["val"], 0, N_VAL)
    assert np.array_equal(got_x, x[N_TRAIN:]) and np.array_equal(got_y, y[N_TRAIN:])
    before = store.stats.bytes_down
    read_rows(store, layout.splits["train"], 10, 20)  # in the stored .npz: its 10 rows' bytes alone
    assert store.stats.bytes_down - before == 10 * (x[0].nbytes + y[0].nbytes)


def test_shards_are_numbered_from_the_headers_whatever_the_number_of_cuts(tmp_path):
    x, y = source_arrays()
    layout = scan_arrays(DirectoryStore(write_source(tmp_path / "src", x, y)))
    for workers in (1, 2, 3, 8, 100):
        cuts = plan_cuts(layout, 16, workers)
        for split, shards in (("train", 15), ("val", 3)):  # 230 = 14 * 16 + 6; 37 = 2 * 16 + 5
            mine = [c for c in cuts if c.split == split]
            assert [i for c in mine for i in range(c.first, c.last + 1)] == list(range(shards))
            assert [r for c in mine for i in range(c.first, c.last + 1) for r in range(*c.rows_of(i))] == \
                list(range(layout.rows(split)))
        assert len([c for c in cuts if c.split == "train"]) == min(workers, 15)
    cut = plan_cuts(layout, 16, 3)[1]  # shards 5-9: rows 80-159, in parts a and b
    assert (cut.label, [p.name for p in cut.parts], cut.parts_start) == ("cut train shards 5-9", ["a", "b"], 0)
    assert Cut.from_dict(cut.to_dict()) == cut  # travels to its process as JSON


def test_cuts_write_shards_equal_to_the_source_rows_and_a_second_pass_keeps_them(source, dir_store):
    store, x, y = source
    layout = scan_arrays(store)
    cuts = plan_cuts(layout, 16, 3)
    done = [write_cut(dir_store, "", store, c) for c in cuts]
    assert sum(r["written"] for r in done) == 18
    manifest = arrays_manifest("arrays:src", layout, cuts, done, {"source": "arrays:src"}, "test")
    assert (manifest.n_train, manifest.n_val, manifest.n_subsets, manifest.n_val_subsets) == (N_TRAIN, N_VAL, 15, 3)
    assert (manifest.input_shape, manifest.classes, manifest.id_bound) == (ROW, int(y.max()) + 1, 0)
    assert manifest.dtypes == {"x": "torch.float32", "y": "torch.int64"}
    for split, rows in (("train", slice(0, N_TRAIN)), ("val", slice(N_TRAIN, None))):
        parts = [decode_tensors(dir_store.get(shard_key("", split, i)))[0]
                 for i in range(len(manifest.shards[split]))]
        assert [len(p["y"]) for p in parts] == [s.rows for s in manifest.shards[split]]
        assert torch.equal(torch.cat([p["x"] for p in parts]), torch.from_numpy(x[rows]))
        assert torch.equal(torch.cat([p["y"] for p in parts]), torch.from_numpy(y[rows]))
    again = [write_cut(dir_store, "", store, c) for c in plan_cuts(layout, 16, 5)]  # other cuts, same shards
    assert sum(r["written"] for r in again) == 0
    assert [s for r in again for s in r["shards"]] == [s for r in done for s in r["shards"]]


def test_integer_inputs_give_the_id_bound_and_bytes_become_floats(tmp_path):
    root = tmp_path / "tok"
    for split, n in (("train", 40), ("val", 8)):
        (root / split).mkdir(parents=True)
        np.savez(root / split / "p.npz", x=np.arange(n * 5, dtype=np.int32).reshape(n, 5) % 50,
                 y=np.full((n, 5), 3, dtype=np.int16))
    store, out = DirectoryStore(root), DirectoryStore(tmp_path / "out")
    layout = scan_arrays(store)
    cuts = plan_cuts(layout, 16, 2)
    manifest = arrays_manifest("arrays:tok", layout, cuts, [write_cut(out, "", store, c) for c in cuts], {})
    assert (manifest.id_bound, manifest.classes, manifest.dtypes["x"]) == (50, 4, "torch.int64")
    img = tmp_path / "img"
    for split in ("train", "val"):
        (img / split).mkdir(parents=True)
        np.save(img / split / "p.x.npy", np.full((4, 2, 2), 255, dtype=np.uint8))
        np.save(img / split / "p.y.npy", np.arange(4))
    layout = scan_arrays(DirectoryStore(img))
    cuts = plan_cuts(layout, 4, 1)
    done = [write_cut(out, "img", DirectoryStore(img), c) for c in cuts]
    manifest = arrays_manifest("arrays:img", layout, cuts, done, {})
    assert (manifest.id_bound, manifest.dtypes["x"]) == (0, "torch.float32")
    assert decode_tensors(out.get(shard_key("img", "train", 0)))[0]["x"].max().item() == 255.0


def _refusal(root: Path) -> str:
    with pytest.raises(ZooidValueError) as caught:
        scan_arrays(DirectoryStore(root))
    text = str(caught.value)
    assert "\n" not in text and text.startswith("dataset: "), text
    return text


def test_malformed_sources_are_refused_in_one_line_naming_dataset(tmp_path):
    x, y = source_arrays()
    assert "no train arrays under" in _refusal(tmp_path / "empty")
    only_train = tmp_path / "only_train"
    (only_train / "train").mkdir(parents=True)
    np.savez(only_train / "train" / "a.npz", x=x[:4], y=y[:4])
    assert "no val arrays under" in _refusal(only_train)

    def variant(name: str, **train) -> Path:
        root = write_source(tmp_path / name, x, y)
        for file, arrays in train.items():
            path = root / "train" / file
            if isinstance(arrays, dict):
                np.savez(path, **arrays)
            elif arrays is None:
                path.unlink()
            else:
                np.save(path, arrays)
        return root

    assert "train/c.x.npy has no train/c.y.npy beside it" in _refusal(variant("lone", **{"c.y.npy": None}))
    text = _refusal(variant("rows", **{"a.npz": {"x": x[:100], "y": y[:99]}}))
    assert "train/a: x has 100 rows and y 99" in text
    text = _refusal(variant("shape", **{"c.x.npy": x[180:N_TRAIN, :2]}))
    assert "train/c.x.npy has rows of shape (2, 32)" in text and "train/a.npz (x) has (3, 32)" in text
    text = _refusal(variant("dtype", **{"c.x.npy": x[180:N_TRAIN].astype(np.float64)}))
    assert "dtype float64" in text
    assert "has no array 'y'" in _refusal(variant("noy", **{"a.npz": {"x": x[:100], "z": y[:100]}}))
    objects = variant("objects")
    np.save(objects / "train" / "c.y.npy", np.array([{"a": 1}] * 50, dtype=object), allow_pickle=True)
    assert "holds Python objects" in _refusal(objects)
    short = variant("short")
    path = short / "train" / "c.x.npy"
    path.write_bytes(path.read_bytes()[:-x[0].nbytes * 3])  # three rows short
    assert "train/c.x.npy holds 47 of the 50 rows its header says" in _refusal(short)
    stray = variant("stray")
    (stray / "val" / "notes.txt").write_text("hi")
    assert "val/notes.txt is not <part>.npz" in _refusal(stray)
    with pytest.raises(ZooidValueError, match=r"^dataset: 'arrays:': say where the arrays are"):
        arrays_ref("arrays:")
    assert arrays_ref(f"arrays:{tmp_path}") == tmp_path.as_uri()


def test_a_cut_inflates_a_compressed_part_once_and_holds_one_shard_at_a_time(tmp_path):
    """A 48 MB source (a .npy pair, and a compressed .npz of the same rows for the val split):
    writing every shard of 1 MB rows in one process grows its peak memory by a few shards, not
    by the source, and a compressed member read shard by shard is fetched about once."""
    script = f"""
import json, resource, sys
import numpy as np
from comm.store_dir import DirectoryStore
from engine.array_cuts import plan_cuts, write_cut
from engine.array_source import scan_arrays
root = {str(tmp_path / "big")!r}
rows, width = 12288, 1024  # 4 KB a row, 48 MB in all
for split in ("train", "val"):
    __import__("os").makedirs(f"{{root}}/{{split}}")
x = np.lib.format.open_memmap(f"{{root}}/train/p.x.npy", mode="w+", dtype=np.float32, shape=(rows, width))
for i in range(0, rows, 1024):
    x[i:i + 1024] = np.arange(i, i + 1024, dtype=np.float32)[:, None]
x.flush(); del x
np.save(f"{{root}}/train/p.y.npy", np.arange(rows) % 10)
np.savez_compressed(f"{{root}}/val/p.npz", x=np.repeat(np.arange(2048, dtype=np.float32)[:, None], width, 1),
                    y=np.arange(2048) % 10)
source, out = DirectoryStore(root), DirectoryStore({str(tmp_path / "out")!r})
layout = scan_arrays(source)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
cuts = plan_cuts(layout, 256, 1)
fetched = {{}}
for cut in cuts:
    start = source.stats.bytes_down
    write_cut(out, "", source, cut)
    fetched[cut.split] = source.stats.bytes_down - start
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
print(json.dumps({{"grown": grown, "fetched": fetched, "npz": source.size("val/p.npz"),
                  "shards": [len(c.parts) for c in cuts], "n": [c.shards for c in cuts]}}))
"""
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False,
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["n"] == [48, 8]  # 12288 / 256 training shards of 1 MB, 2048 / 256 validation ones
    assert got["grown"] < 24 * 2**20, got  # a few 1 MB shards in flight, not the 48 MB source
    assert got["fetched"]["train"] == 12288 * (4096 + 8)  # each row's bytes once, no more
    assert got["fetched"]["val"] < got["npz"] + 4 * INFLATE_READ, got  # the compressed member once


def test_arrays_of_a_factorys_dataset_prepare_into_the_factorys_very_shards(tmp_path):
    """The same rows as files of arrays or from the factory give byte-identical shards (equal
    SHA-256s, rows, dtypes): a run trains on either exactly alike."""
    from engine.datasets import load_dataset, prepare_dataset

    name = "synthetic:8:3:120:30"
    data = load_dataset(name)
    root = tmp_path / "arrays"
    for split, x, y in (("train", data.train_x, data.train_y), ("val", data.val_x, data.val_y)):
        (root / split).mkdir(parents=True)
        np.savez(root / split / "a.npz", x=x[:50].numpy(), y=y[:50].numpy())  # two parts: a cut spans both
        np.savez_compressed(root / split / "b.npz", x=x[50:].numpy(), y=y[50:].numpy())
    factory = prepare_dataset(DirectoryStore(tmp_path / "factory"), "", name, 16).manifest
    source, out = DirectoryStore(root), DirectoryStore(tmp_path / "out")
    layout = scan_arrays(source)
    cuts = plan_cuts(layout, 16, 3)
    arrays = arrays_manifest(f"arrays:{root}", layout, cuts, [write_cut(out, "", source, c) for c in cuts], {})
    assert arrays.shards == factory.shards
    assert (arrays.n_train, arrays.n_val, arrays.input_shape, arrays.classes, arrays.id_bound, arrays.dtypes) == \
        (factory.n_train, factory.n_val, factory.input_shape, factory.classes, factory.id_bound, factory.dtypes)
