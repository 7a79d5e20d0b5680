"""The `prepare` flow on a real Prefect API: shards and a manifest written to a bucket (the moto
server, Azurite, a directory), what prepared them named in the manifest, a second prepare a
no-op that says so; bad input refused in one line naming the parameter before anything is read. Files
of arrays (`arrays:`) cut in parallel, each cut a task run in a process of its own; a prepare whose
cut failed goes on where it stopped."""
from __future__ import annotations

import json
import os
import subprocess
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from comm.store import open_store
from engine.datasets import read_shards
from engine.shards import read_dataset_manifest
from flows.prepare import main, prepare
from flows.prepare_cuts import CutFailed
from tests.bucket_stores import bucket_url

pytestmark = pytest.mark.usefixtures("prefect_api")
SOURCE = "synthetic:8:3:120:30"


@pytest.mark.parametrize("kind", ["dir", "s3", "azure"])
def test_prepare_writes_a_manifest_once_and_again_is_a_no_op(kind, request, tmp_path, monkeypatch):
    url = bucket_url(kind, request, tmp_path, monkeypatch, "prep", "corpora/syn")
    first = prepare(dataset=SOURCE, to=url, subset_size=16)
    assert (first["written"], first["kept"], first["already"]) == (10, 0, False)  # 8 + 2 shards
    store = open_store(url)
    try:
        manifest = read_dataset_manifest(store, "")
        assert sorted(store.list("")) == sorted(["manifest.json"] + [f"train/{i}" for i in range(8)]
                                                + [f"val/{i}" for i in range(2)])
    finally:
        store.close()
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert manifest.prepared_by == head and manifest.to_dict() == first["manifest"]
    assert manifest.settings == {"source": SOURCE, "subset_size": 16, "text": None}
    again = prepare(dataset=SOURCE, to=url, subset_size=16)
    assert (again["written"], again["already"]) == (0, True)
    assert again["message"].startswith(f"already prepared at {first['to']} with these settings: 120 training")


@pytest.mark.parametrize("params, field", [
    (["dataset=digitz", "to=file:///tmp/x"], "dataset"),
    (["dataset=digits"], "to"),
    (["to=file:///tmp/x"], "dataset"),
    (["dataset=digits", "to=file:///tmp/x", "subset_size=0"], "subset_size"),
    (["dataset=digits", "to=file:///tmp/x", "shards=3"], "shards"),
    (["dataset=text:stdlib", "to=file:///tmp/x", "tokenizer=bpe:x"], "tokenizer"),
])
def test_bad_input_is_one_line_naming_the_parameter_before_anything_runs(params, field, capsys, tmp_path):
    to = tmp_path / "never"
    argv = [a for p in params for a in ("--param", p.replace("file:///tmp/x", to.as_uri()))]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {field}: "), err
    assert not to.exists()


# --- files of arrays, cut in parallel (`flows.prepare_cuts`) ----------------------------------

ARRAY_ROWS = (230, 37)  # 15 + 3 shards of 16 rows: with workers=2, cuts train 0-7, 8-14 and val 0-2


def array_source(kind: str, request, tmp_path) -> tuple[str, np.ndarray, np.ndarray]:
    """`arrays:` source of 230 + 37 rows in three training parts (a stored .npz, a compressed
    one, a .npy pair) and one validation pair, in a directory or a moto bucket: (name, x, y)."""
    rng = np.random.default_rng(1)
    n = sum(ARRAY_ROWS)
    x, y = rng.standard_normal((n, 3, 8)).astype(np.float32), rng.integers(0, 5, n)
    root = tmp_path / "raw"
    (root / "train").mkdir(parents=True)
    (root / "val").mkdir()
    np.savez(root / "train" / "p0.npz", x=x[:100], y=y[:100])
    np.savez_compressed(root / "train" / "p1.npz", x=x[100:180], y=y[100:180])
    np.save(root / "train" / "p2.x.npy", x[180:230])
    np.save(root / "train" / "p2.y.npy", y[180:230])
    np.save(root / "val" / "p0.x.npy", x[230:])
    np.save(root / "val" / "p0.y.npy", y[230:])
    if kind == "dir":
        return f"arrays:{root}", x, y
    server = request.getfixturevalue("s3_server")
    bucket = server.create_bucket(f"raw-{uuid.uuid4().hex[:10]}")
    with open_store(f"s3://{bucket}/arrays?endpoint={server.endpoint}") as store:
        for path in sorted(root.rglob("*.np?")):
            store.put(path.relative_to(root).as_posix(), path.read_bytes())
    return f"arrays:s3://{bucket}/arrays?endpoint={server.endpoint}", x, y


def cut_task_runs(state) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id])))
    return sorted((r for r in runs if r.name.startswith("cut ")), key=lambda r: r.name)


@pytest.mark.parametrize("kind", ["dir", "s3"])
def test_files_of_arrays_are_cut_in_parallel_task_runs_into_shards_equal_to_their_rows(kind, request, tmp_path,
                                                                                       monkeypatch):
    dataset, x, y = array_source(kind, request, tmp_path)
    url = bucket_url(kind, request, tmp_path, monkeypatch, "prep", "corpora/syn")
    state = prepare(dataset=dataset, to=url, subset_size=16, workers=2, return_state=True)
    first = state.result()
    assert (first["written"], first["kept"], first["already"]) == (18, 0, False)
    assert [c["cut"] for c in first["cuts"]] == ["cut train shards 0-7", "cut train shards 8-14",
                                                 "cut val shards 0-2"]
    pids = [c["pid"] for c in first["cuts"]]
    assert len(set(pids)) == 3 and os.getpid() not in pids  # a process of its own each
    runs = cut_task_runs(state)  # each cut a task run of the prepare's flow run, named after its shards
    assert [r.name for r in runs] == sorted(c["cut"] for c in first["cuts"])
    assert all(r.state.is_completed() for r in runs)
    assert first["message"].endswith(", in 3 cuts on inline, 2 at once")

    with open_store(url) as store:
        manifest = read_dataset_manifest(store, "")
        assert manifest.to_dict() == first["manifest"]
        assert (manifest.n_train, manifest.n_val, manifest.input_shape, manifest.classes) == (230, 37, (3, 8),
                                                                                              int(y.max()) + 1)
        assert manifest.settings["source"] == dataset and manifest.settings["subset_size"] == 16
        train = read_shards(store, "", range(15), "train", manifest=manifest)
        val = read_shards(store, "", range(3), "val", manifest=manifest)
    assert torch.equal(train[0], torch.from_numpy(x[:230])) and torch.equal(train[1], torch.from_numpy(y[:230]))
    assert torch.equal(val[0], torch.from_numpy(x[230:])) and torch.equal(val[1], torch.from_numpy(y[230:]))

    again = prepare(dataset=dataset, to=url, subset_size=16, workers=3)
    assert (again["written"], again["already"], again["cuts"]) == (0, True, [])
    assert again["message"].startswith(f"already prepared at {first['to']} with these settings: 230 training")


def test_a_prepare_whose_cut_failed_goes_on_where_it_stopped(tmp_path, request):
    dataset, _, _ = array_source("dir", request, tmp_path)
    bucket = tmp_path / "bucket"
    (bucket / "val" / "0").mkdir(parents=True)  # val/0 cannot be written: the val cut fails there
    with pytest.raises(CutFailed, match=r"^1 of 3 cuts failed \(run the prepare again to go on: whole shards are "
                                        r"kept\): cut val shards 0-2 failed: error: key 'val/0' collides"):
        prepare(dataset=dataset, to=bucket.as_uri(), subset_size=16, workers=2)
    with open_store(bucket.as_uri()) as store:
        assert not store.exists("manifest.json")  # the manifest is written last, by a whole prepare
        assert sorted(store.list("train/")) == sorted(f"train/{i}" for i in range(15))  # the others finished
    (bucket / "val" / "0").rmdir()
    done = prepare(dataset=dataset, to=bucket.as_uri(), subset_size=16, workers=2)
    assert (done["written"], done["kept"], done["already"]) == (3, 15, False)  # only the missing shards
    assert [c["written"] for c in done["cuts"]] == [0, 0, 3]


def test_a_malformed_source_is_refused_in_one_line_naming_dataset_before_any_cut(tmp_path, request, capsys):
    dataset, x, y = array_source("dir", request, tmp_path)
    raw = Path(dataset.removeprefix("arrays:"))
    to = tmp_path / "never"

    def refused(source: str, *params: str) -> str:
        argv = ["--param", f"dataset={source}", "--param", f"to={to.as_uri()}"]
        assert main(argv + [a for p in params for a in ("--param", p)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: "), err
        return err[0].removeprefix("error: ")

    assert refused(f"arrays:{tmp_path / 'nothing'}").startswith("dataset: no train arrays under ")
    np.savez(raw / "train" / "p0.npz", x=x[:100], y=y[:99])
    assert refused(dataset) == "dataset: train/p0: x has 100 rows and y 99; a part's x and y pair row for row"
    np.savez(raw / "train" / "p0.npz", x=x[:100], y=y[:100])
    (raw / "val" / "p0.y.npy").rename(raw / "p0.y.npy")
    assert refused(dataset) == "dataset: val/p0.x.npy has no val/p0.y.npy beside it"
    (raw / "p0.y.npy").rename(raw / "val" / "p0.y.npy")
    np.save(raw / "train" / "p2.x.npy", x[180:230, :2])
    assert refused(dataset).startswith("dataset: train/p2.x.npy has rows of shape (2, 8) and dtype float32, where "
                                       "train/p0.npz (x) has (3, 8) float32")
    np.save(raw / "train" / "p2.x.npy", x[180:230])
    for param, field in (("workers=0", "workers"), ("target=", "target"), ("tokenizer=bpe:64", "tokenizer"),
                         ("target=nowhere", "target")):
        assert refused(dataset, param).startswith(f"{field}: ")
    # the process pool's worker deployment is not on this API (no stack): refused before any cut
    assert refused(dataset, "target=local").startswith("target: 'local' is not set up: no worker deployment "
                                                       "'worker/local'; ")
    assert refused(dataset, f"to={raw}").startswith("to: is where the arrays of ")
    assert not to.exists()  # nothing written, not even the destination's folder


def test_files_of_arrays_in_a_store_block_are_read_by_cuts_that_load_the_block(tmp_path, request):
    from blocks.store_refs import ZooidStore

    dataset, x, y = array_source("dir", request, tmp_path)
    name = f"raw-{uuid.uuid4().hex[:8]}"
    ZooidStore(url=Path(dataset.removeprefix("arrays:")).as_uri()).save(name)
    done = prepare(dataset=f"arrays:block:zooid-store/{name}", to=(tmp_path / "out").as_uri(), subset_size=64,
                   workers=1)
    assert (done["written"], [c["cut"] for c in done["cuts"]]) == (5, ["cut train shards 0-3", "cut val shard 0"])
    with open_store((tmp_path / "out").as_uri()) as store:
        got = read_shards(store, "", range(4), "train", manifest=read_dataset_manifest(store, ""))
    assert torch.equal(got[0], torch.from_numpy(x[:230])) and torch.equal(got[1], torch.from_numpy(y[:230]))


def test_a_cut_over_many_files_reaches_its_process_whole(tmp_path):
    """A cut's job lists every part it reads: over 600 files it is far beyond an argument's
    128 KB, and still reaches the inline cut's process (on its stdin)."""
    from engine.array_cuts import plan_cuts
    from engine.array_source import scan_arrays
    from flows.prepare_cuts import _inline, cut_job

    root = tmp_path / "many"
    for split, parts in (("train", 640), ("val", 1)):
        (root / split).mkdir(parents=True)
        for i in range(parts):
            np.savez(root / split / f"part-{i:04d}.npz", x=np.full((2, 3), i, np.float32), y=np.array([i % 4, 1]))
    with open_store(root.as_uri()) as source:
        cut = plan_cuts(scan_arrays(source), 64, 1)[0]
    job = cut_job(cut, root.as_uri(), (tmp_path / "out").as_uri())
    assert len(cut.parts) == 640 and len(json.dumps(job)) > 131072  # MAX_ARG_STRLEN
    done = _inline(job, cut.label)
    assert (done["written"], [s["rows"] for s in done["shards"]]) == (20, [64] * 20)
