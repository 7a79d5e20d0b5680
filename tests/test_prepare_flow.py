"""The `prepare` flow on a real Prefect API: shards and a manifest written to a bucket (the moto
server, Azurite, a directory), what prepared them named in the manifest, a second prepare a
no-op that says so; bad input refused in one line naming the parameter before anything is read."""
from __future__ import annotations

import subprocess
import uuid

import pytest

from comm.store import open_store
from engine.shards import read_dataset_manifest
from flows.prepare import main, prepare

pytestmark = pytest.mark.usefixtures("prefect_api")
SOURCE = "synthetic:8:3:120:30"


def bucket_url(kind: str, request, tmp_path, monkeypatch) -> str:
    if kind == "s3":
        server = request.getfixturevalue("s3_server")
        return f"s3://{server.create_bucket(f'prep-{uuid.uuid4().hex[:10]}')}/corpora/syn?endpoint={server.endpoint}"
    if kind == "azure":
        server = request.getfixturevalue("azurite")
        monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", server.connection_string())
        return f"az://{server.create_container(f'prep-{uuid.uuid4().hex[:10]}')}/corpora/syn"
    return (tmp_path / "bucket").as_uri()


@pytest.mark.parametrize("kind", ["dir", "s3", "azure"])
def test_prepare_writes_a_manifest_once_and_again_is_a_no_op(kind, request, tmp_path, monkeypatch):
    url = bucket_url(kind, request, tmp_path, monkeypatch)
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
