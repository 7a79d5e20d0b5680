"""WorkerSpec and its typed groups: plain JSON both ways, unknown keys refused by name, and no
module reading the old untyped `extra` dict of a spec."""
from __future__ import annotations

import ast
import json

import pytest

from core.errors import ZooidValueError
from core.specs import ComputeSpec, StageSpec, SyncSpec, WarmSpec, WorkerResult, WorkerSpec
from tests.test_architecture import project_files


def hybrid_stage_spec() -> WorkerSpec:
    """Stage worker 1 of replica 1 in a 2 x 2 interleaved hybrid over a direct ring, with
    every group set away from its defaults."""
    return WorkerSpec(
        run_id="run-1", epoch=3, rank=3, world=4, store_url="file:///tmp/store", model="digits_cnn",
        dataset="digits", subsets=(4, 5), steps=12, batch_size=32, lr=0.1, optimizer="momentum",
        sync_period=1, seed=5, init_key="runs/run-1/ckpt/e2", out_key="runs/run-1/ckpt/e3",
        sync_timeout_s=30.0, evaluate=False, attempt=2, resume=True, checkpoint_store="s3://bucket/zooid",
        stage=StageSpec(index=1, cuts=(2, 4, 8), microbatches=4, replica=1, replicas=2, chunks=2,
                        schedule="interleaved", actions=("0F0 2F0 2B0 0B0 2SYNC 0SYNC",
                                                         "1F0 3F0 3B0 1B0 3SYNC 1SYNC"), val_chunk=128),
        sync=SyncSpec(collective="ring", ring_host="auto", ring_timeout_s=90.0, repost_s=0.5,
                      checkpoint_every=0, group="runs/run-1/sync/custom"),
        compute=ComputeSpec(device="cpu", dtype="float64", threads=2, model_kwargs={"hidden": [64, 32]}),
        warm=WarmSpec(worker="r3-w0", lease_s=30.0, check_s=0.5, grace_s=10.0))


def base_dict() -> dict:
    return WorkerSpec(run_id="r", epoch=0, rank=0, world=1, store_url="file:///x", model="digits_mlp",
                      dataset="digits", subsets=(), steps=1, batch_size=8, lr=0.1).to_dict()


def test_a_full_pipeline_hybrid_spec_round_trips_as_plain_json():
    spec = hybrid_stage_spec()
    d = spec.to_dict()
    assert json.loads(json.dumps(d)) == d  # plain JSON types only: no tuples, no dataclasses
    assert d["stage"]["cuts"] == [2, 4, 8] and d["sync"]["collective"] == "ring"
    assert d["warm"]["worker"] == "r3-w0" and d["compute"]["model_kwargs"] == {"hidden": [64, 32]}
    again = WorkerSpec.from_dict(json.loads(json.dumps(d)))
    assert again == spec
    assert isinstance(again.stage, StageSpec) and again.stage.cuts == (2, 4, 8)
    assert (again.stage.stages, again.stage.workers) == (4, 2)
    assert isinstance(again.subsets, tuple) and isinstance(again.stage.actions, tuple)


def test_defaults_round_trip_and_keep_todays_behaviour():
    spec = WorkerSpec.from_dict(base_dict())
    assert spec.stage is None and spec.warm is None and not spec.resume and spec.checkpoint_store == ""
    assert spec.sync == SyncSpec(collective=None, ring_host="127.0.0.1", ring_timeout_s=None, repost_s=5.0,
                                 checkpoint_every=1, group="")
    assert spec.compute == ComputeSpec(device="", dtype="float32", threads=None, model_kwargs={})
    assert WorkerSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


@pytest.mark.parametrize("change, field", [
    ({"extra": {}}, "extra"),  # the old untyped dict: refused, not silently dropped
    ({"sync_peroid": 2}, "sync_peroid"),
    ({"sync": {"colective": "ring"}}, "sync.colective"),
    ({"stage": {"index": 0, "cuts": [2], "microbatches": 2, "pipeline_schedule": "1f1b"}}, "stage.pipeline_schedule"),
    ({"compute": {"dtype": "float64", "thread": 2}}, "compute.thread"),
    ({"warm": {"worker": "r0-w0", "lease": 3}}, "warm.lease"),
])
def test_an_unknown_key_is_refused_in_one_line_naming_it(change, field):
    with pytest.raises(ZooidValueError) as info:
        WorkerSpec.from_dict({**base_dict(), **change})
    assert info.value.field == field
    assert "\n" not in str(info.value) and str(info.value).startswith(f"{field}: unknown field")


@pytest.mark.parametrize("change, field", [
    ({"stage": {"cuts": [2], "microbatches": 2}}, "stage.index"),
    ({"stage": {"index": 0, "cuts": "2,4", "microbatches": 2}}, "stage.cuts"),
    ({"stage": {"index": 0, "cuts": [2], "microbatches": True}}, "stage.microbatches"),
    ({"stage": [0, [2], 2]}, "stage"),
    ({"sync": {"ring_host": 7}}, "sync.ring_host"),
    ({"sync": {"ring_timeout_s": 0}}, "sync.ring_timeout_s"),
    ({"sync": {"repost_s": -1}}, "sync.repost_s"),
    ({"sync": {"checkpoint_every": 1.5}}, "sync.checkpoint_every"),
    ({"compute": {"threads": 0}}, "compute.threads"),
    ({"compute": {"dtype": 64}}, "compute.dtype"),
    ({"resume": "yes"}, "resume"),
])
def test_a_bad_value_is_refused_naming_its_path(change, field):
    with pytest.raises(ZooidValueError) as info:
        WorkerSpec.from_dict({**base_dict(), **change})
    assert info.value.field == field


def test_a_missing_field_is_named():
    d = base_dict()
    del d["store_url"]
    with pytest.raises(ZooidValueError, match="^store_url: is required"):
        WorkerSpec.from_dict(d)


def test_a_result_drops_unknown_keys_on_purpose():
    """A result is read, not obeyed: a newer worker's extra metric must not fail the epoch."""
    result = WorkerResult(run_id="r", epoch=0, rank=0, started_at=1.0, stopped_at=2.0, train_loss=0.5, samples=8)
    assert WorkerResult.from_dict({**result.to_dict(), "gpu_util": 0.9}) == result


def _spec_like(node: ast.AST) -> bool:
    """Whether an expression names a spec (`spec`, `self.spec`, `specs[0]`, `base_spec`...)."""
    return "spec" in ast.unparse(node).lower()


def _extra_reads(tree: ast.AST) -> list[ast.AST]:
    """`<spec>.extra`, `<spec>.get("extra")` and `<spec>["extra"]` in one module."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "extra" and _spec_like(node.value):
            found.append(node)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
              and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value == "extra"
              and _spec_like(node.func.value)):
            found.append(node)
        elif (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
              and node.slice.value == "extra" and _spec_like(node.value)):
            found.append(node)
    return found


def test_the_extra_finder_finds_extra_reads():
    tree = ast.parse("spec.extra.get('x'); self.spec.extra; d.get('extra'); spec_dict.get('extra'); "
                     "specs[0]['extra']; outcome.extra['log']")
    assert sorted(ast.unparse(n) for n in _extra_reads(tree)) == [
        "self.spec.extra", "spec.extra", "spec_dict.get('extra')", "specs[0]['extra']"]


def test_no_project_module_reads_extra_on_a_spec():
    assert "extra" not in WorkerSpec.__dataclass_fields__
    offenders = [f"{path.relative_to(path.parents[1])}:{node.lineno}: {ast.unparse(node)}"
                 for module, path in project_files().items()
                 for node in _extra_reads(ast.parse(path.read_text(), str(path)))]
    assert offenders == []
