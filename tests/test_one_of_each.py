"""One of each concept: each lives in one place, the others call it.

One test per concept. Each checks that the one implementation gives the right answer where
its callers use it, and, by reading the project's source with `ast`, that no second
definition has come back:

1. stage bounds: `core.stage_memory.stage_bounds`;
2. a stage's memory: `core.stage_memory` (`stage_memory`, through `stage_need_bytes`);
3. micro-batch counts: `planners.strategy.job_microbatches` and
   `planners.hybrid.microbatches_per_replica`, two different computations named apart;
4. errors: every project exception derives from `core.errors.ZooidError`;
5. store blocks: one base (`blocks.store_block.StoreBlock`), one reference format
   (`block:<type slug>/<name>`), one opener (`blocks.store_refs.open_store_ref`);
6. strategies, pipeline schedules and compute-target kinds: one enum each in `core.kinds`
   (`Strategy`, `PipelineSchedule`, `TargetKind` with its per-kind facts); no other module
   lists two of their names or compares with one spelled as a string.
7. transfer stats: one type, `comm.bandwidth.TransferStats`, for a store's link and a rank's
   collectives alike;
8. the benchmarks' scaffolding: one machine line and one money format (`benchmarks.output`);
9. a cloud's timestamps: one reading, `clouds.timestamps.epoch_seconds`, for every provider.

The co-optimiser (`planners/co_optimize*.py`) still has its own `stage_bounds` and stage
memory: its owner switches it to core; until then its files are the ones these checks leave
out.
"""
from __future__ import annotations

import ast
import os
import pickle
import random
import re

import pytest

from tests.source_tree import ROOT, sources

BENCHMARKS = ROOT / "benchmarks"


def definitions(name: str) -> list[str]:
    """The modules that define a function, class or module-level name called `name`."""
    found = []
    for rel, tree in sources().items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
                found.append(rel)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    found.append(rel)
    return found


def function(rel: str, name: str) -> ast.FunctionDef:
    """The function `name` defined in module `rel`."""
    return next(n for n in ast.walk(sources()[rel]) if isinstance(n, ast.FunctionDef) and n.name == name)


def called_names(node: ast.AST) -> set[str]:
    """Names of everything called inside `node`."""
    return {c.func.id if isinstance(c.func, ast.Name) else getattr(c.func, "attr", "")
            for c in ast.walk(node) if isinstance(c, ast.Call)}


def test_stage_bounds_live_in_core_only():
    from torch import nn

    from core.stage_memory import stage_bounds
    from engine.stages import split_stages
    from planners.partition import PartitionProblem, PipelineLayer, pipeline_runtime
    from planners.pipeline_time import stage_times

    rng = random.Random(7)
    for _ in range(50):
        n = rng.randint(1, 9)
        cuts = sorted(rng.sample(range(1, n), rng.randint(0, n - 1)))
        bounds = stage_bounds(cuts, n)
        # contiguous, non-empty, covering every layer, each stage starting at its cut
        assert [a for a, _ in bounds] == [0] + cuts
        assert all(a <= b for a, b in bounds) and bounds[-1][1] == n - 1
        assert all(b + 1 == a for (_, b), (a, _) in zip(bounds, bounds[1:]))
        # the engine splits a model along them
        model = nn.Sequential(*[nn.Linear(1, 1) for _ in range(n)])
        assert [len(s) for s in split_stages(model, cuts)] == [b - a + 1 for a, b in bounds]
        # planners (cut c after layer c) group layers along them
        params = [rng.randint(0, 100) for _ in range(n)]
        layers = [{"forward_s": 1.0, "backward_s": 1.0, "output_bytes": 1.0, "param_bytes": p} for p in params]
        after = [c - 1 for c in cuts]
        assert [s["param_bytes"] for s in stage_times(layers, after, 1, 1)] == [sum(params[a:b + 1]) for a, b in bounds]
        fwd = [rng.random() for _ in range(n)]
        problem = PartitionProblem(layers=tuple(PipelineLayer(forward_s=f, backward_s=0.0, output_bytes=0.0) for f in fwd),
                                   bandwidth_bytes_per_s=1.0, microbatches=1, max_stages=n)
        assert pipeline_runtime(problem, after) == pytest.approx(sum(fwd))
    with pytest.raises(ValueError, match="^cuts: "):
        split_stages(nn.Sequential(nn.ReLU(), nn.ReLU()), [2])

    assert definitions("stage_bounds") == ["core/stage_memory.py"]
    assert definitions("_stage_bounds") == []
    inline = re.compile(r"\[0\]\s*\+\s*\[?\s*\w+\s*\+\s*1\s+for|\[0,\s*\*cuts")  # starts built by hand
    hand_made = [rel for rel in sources() if rel != "core/stage_memory.py"
                 and inline.search((ROOT / rel).read_text())]
    assert hand_made == []


def test_stage_memory_is_computed_by_core_only():
    from core.stage_memory import check_plan_memory, stage_memory
    from planners.partition import LayerMemoryProfile, search_microbatching, stage_memory_fits

    rng = random.Random(11)
    for _ in range(40):
        n = rng.randint(1, 7)
        layers = [LayerMemoryProfile(forward_s_per_sample=rng.random(), backward_s_per_sample=rng.random(),
                                     output_bytes_per_sample=rng.randint(1, 50),
                                     activation_bytes_per_sample=rng.randint(0, 100),
                                     resident_bytes=2 * rng.randint(0, 300)) for _ in range(n)]
        size, count = rng.randint(1, 4), rng.randint(1, 4)
        memory, base = rng.randint(100, 3000), rng.randint(0, 200)
        allowed = stage_memory_fits(layers, size, count, memory, base)
        for a in range(n):
            for b in range(a, n):
                span = layers[a:b + 1]
                # resident bytes are weights and gradients of resident / 2 parameter bytes at D = 1
                (one,) = stage_memory(activation_bytes=[x.activation_bytes_per_sample * size for x in span],
                                      param_bytes=[x.resident_bytes / 2 for x in span], cuts=[],
                                      microbatches=count, available_bytes=memory, base_memory_bytes=base)
                assert allowed[a, b] == one.fits, (a, b)
        plan = search_microbatching(layers, memory_bytes=memory, bandwidth_bytes_per_s=10.0, max_stages=n,
                                    base_memory_bytes=base)
        if plan is not None:  # the chosen partition fits by core's own check
            check_plan_memory(activation_bytes=[x.activation_bytes_per_sample * plan.microbatch_size for x in layers],
                              param_bytes=[x.resident_bytes / 2 for x in layers],
                              cuts=[c + 1 for c in plan.partition.cuts], microbatches=plan.microbatches,
                              available_bytes=memory, base_memory_bytes=base)

    for name in ("stage_memory_fits", "_fits_in"):
        assert "stage_need_bytes" in called_names(function("planners/partition.py", name)), name
    # no planner adds up a stage's memory by hand
    for rel in ("planners/partition.py", "planners/hybrid.py", "planners/strategy.py", "planners/pipeline_time.py"):
        for node in ast.walk(sources()[rel]):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
                text = ast.unparse(node)
                assert not re.search(r"resident|activation|memory_factor", text), f"{rel}: {text}"
    for name in ("stage_memory", "stage_need_bytes", "parameter_copies", "check_plan_memory"):
        assert definitions(name) == ["core/stage_memory.py"], name


def test_microbatch_counts_are_two_named_computations():
    from planners.hybrid import HybridProblem, microbatches_per_replica
    from planners.partition import PartitionProblem, PipelineLayer
    from planners.strategy import job_microbatches

    for batch in range(1, 40):
        chosen = job_microbatches(batch, None)
        assert batch % chosen == 0
        assert all(batch % m for m in (4, 2, 1) if m > chosen)
        for asked in (1, 3, 8):
            assert job_microbatches(batch, asked) == asked
    pipe = PartitionProblem(layers=(PipelineLayer(forward_s=1.0, backward_s=1.0, output_bytes=1.0),),
                            bandwidth_bytes_per_s=1.0, microbatches=1, max_stages=1)
    for global_batch in (12, 30, 64):
        for size in (1, 2, 3, 4):
            problem = HybridProblem(pipeline=pipe, cluster_size=8, global_batch=global_batch, microbatch_size=size)
            for replicas in range(1, 9):
                m = microbatches_per_replica(problem, replicas)
                if global_batch % (replicas * size):
                    assert m is None
                else:
                    assert m * replicas * size == global_batch

    assert definitions("microbatch_count") == []
    assert definitions("job_microbatches") == ["planners/strategy.py"]
    assert definitions("microbatches_per_replica") == ["planners/hybrid.py"]
    # each docstring says how it differs from the other
    assert "microbatches_per_replica" in job_microbatches.__doc__
    assert "job_microbatches" in microbatches_per_replica.__doc__


def exception_classes() -> dict[str, tuple[str, ast.ClassDef]]:
    """Every class in the project's source that derives from an exception, by name."""
    import builtins

    classes = {node.name: (rel, node) for rel, tree in sources().items()
               for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}

    def base_names(node: ast.ClassDef) -> list[str]:
        return [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]

    def is_exception(name: str, seen=()) -> bool:
        builtin = getattr(builtins, name, None)
        if isinstance(builtin, type) and issubclass(builtin, BaseException):
            return True
        if name in classes and name not in seen:
            return any(is_exception(b, seen + (name,)) for b in base_names(classes[name][1]))
        return False

    return {name: (rel, node) for name, (rel, node) in classes.items()
            if any(is_exception(b) for b in base_names(node))}


def test_every_project_exception_is_a_zooid_error():
    from clouds.provider import JobVariablesError, WorkerResources
    from coordinator.workers.launchers import WorkerOutcome, WorkersFailed
    from core.errors import ZooidError, ZooidValueError
    from planners.prestart import PrestartError, startup_estimate

    found = exception_classes()
    assert {"WorkersFailed", "JobVariablesError", "PrestartError"} <= set(found)
    outside = []
    for name, (rel, node) in found.items():
        module = __import__(rel[:-3].replace("/", "."), fromlist=[name])
        cls = getattr(module, name)
        if issubclass(cls, ZooidError):
            continue
        # a private exception is allowed only when documented and never seen outside its module
        used_elsewhere = [r for r in sources() if r != rel and name in (ROOT / r).read_text()]
        if not (name.startswith("_") and ast.get_docstring(node) and not used_elsewhere):
            outside.append(f"{rel}:{name}")
    assert outside == []

    # each still is the builtin its callers catch, and names the field like any ZooidValueError
    with pytest.raises(ValueError) as err:
        WorkerResources(vcpu=0, memory_gb=1.0)
    assert isinstance(err.value, JobVariablesError) and isinstance(err.value, ZooidValueError)
    assert err.value.field == "vcpu"
    with pytest.raises(ValueError) as err:
        startup_estimate([1.0], quantile=2.0)
    assert isinstance(err.value, PrestartError) and err.value.field == "quantile"
    failed = WorkersFailed([WorkerOutcome(rank=0, attempt=1, started_at=0.0, status="failed", error="boom")], "rank 0 failed")
    assert isinstance(failed, RuntimeError) and isinstance(failed, ZooidError)
    # and survives a pickle round trip (Prefect may persist a failed task's exception)
    for error in (err.value, failed):
        again = pickle.loads(pickle.dumps(error))
        assert type(again) is type(error) and str(again) == str(error)
        assert again.__dict__.keys() == error.__dict__.keys()


def test_store_blocks_are_one_family_with_one_reference_and_one_opener(prefect_api, tmp_path):
    from prefect_aws import AwsCredentials
    from prefect_aws.s3 import S3Bucket
    from prefect_azure.credentials import AzureBlobStorageCredentials
    from prefect_redis.blocks import RedisDatabase
    from pydantic import SecretStr

    from blocks.store_block import BLOCK_PREFIX, StoreBlock, block_ref, parse_block_ref
    from blocks.store_refs import ZooidStore, load_store_block, open_store_ref, store_block_types

    secret = "s3cr3t-one-of-each"
    blocks = {
        "zooid-store": ZooidStore(url="redis://h:1/0", password=SecretStr(secret)),
        "zooid-s3-store": store_block_types()[1](
            bucket=S3Bucket(bucket_name="b", credentials=AwsCredentials(
                aws_access_key_id="AKIAONE", aws_secret_access_key=secret, region_name="eu-west-1"))),
        "zooid-redis-store": store_block_types()[2](database=RedisDatabase(host="h", port=1, password=secret)),
        "zooid-azure-blob-store": store_block_types()[3](container="c0n", credentials=AzureBlobStorageCredentials(
            connection_string=f"AccountName=a;AccountKey={secret};BlobEndpoint=http://h:1/a")),
    }
    # every store block type is a StoreBlock with the one interface, and none leaks its secret
    assert {cls.get_block_type_slug() for cls in store_block_types()} == set(blocks)
    for slug, block in blocks.items():
        assert isinstance(block, StoreBlock) and block.get_block_type_slug() == slug
        shown = block.url() + repr(block) + str(block.worker_environment())
        assert secret not in shown, slug
    assert secret not in ZooidStore(url=f"redis://user:{secret}@h:1/0").url()  # a password typed into the URL
    store_classes = [(rel, node.name) for rel, tree in sources().items() for node in ast.walk(tree)
                     if isinstance(node, ast.ClassDef) and node.name.endswith("Store") and rel.startswith("blocks/")]
    assert sorted(name for _, name in store_classes) == sorted(c.__name__ for c in store_block_types())

    # one reference format; the older block:<name> means a zooid-store block
    for name in ("runs", "zooid-s3-store/runs", "block:runs", "block:zooid-redis-store/runs"):
        slug, block_name = parse_block_ref(block_ref(name))
        assert block_ref(name) == f"{BLOCK_PREFIX}{slug}/{block_name}" and block_name == "runs"
    assert parse_block_ref("block:runs") == ("zooid-store", "runs")
    with pytest.raises(ValueError, match="^store: "):
        parse_block_ref("runs")

    # one opener: a saved block opens from its ref and from the older form, with no env change
    env = dict(os.environ)
    saved = ZooidStore(url=f"file://{tmp_path}/store")
    saved.save("one-of-each", overwrite=True)
    assert saved.ref() == "block:zooid-store/one-of-each"
    assert isinstance(load_store_block("block:one-of-each"), ZooidStore)
    writer, reader = open_store_ref(saved.ref()), open_store_ref("block:one-of-each")
    try:
        writer.put("runs/r1/x", b"\x01\x02")
        assert reader.get("runs/r1/x") == b"\x01\x02"
    finally:
        writer.close()
        reader.close()
    assert dict(os.environ) == env

    for gone in ("BLOCK_REF", "STORE_BLOCKS", "worker_store_ref", "open_block_store", "resolved_url"):
        assert definitions(gone) == [], gone
    for one in ("open_store_ref", "load_store_block", "StoreBlock", "BLOCK_PREFIX", "parse_block_ref"):
        assert len(definitions(one)) == 1, one
    literal = [rel for rel, tree in sources().items() for node in ast.walk(tree)
               if isinstance(node, ast.Constant) and node.value == BLOCK_PREFIX]
    assert literal == ["blocks/store_block.py"]


def named_choices() -> tuple[set[str], list[str], list[str]]:
    """The names of `core.kinds` (strategies, schedules, target kinds, built-in targets; `auto`
    aside: it means other things too), and where the project's source outside `core/kinds.py`
    lists two or more of them (a tuple, list, set, `Literal[...]` or dict keys) or compares
    with one spelled as a string (`==`, `!=`, `in (...)`, `case`; `auto` counts where the other
    side is a strategy or a schedule)."""
    from core.kinds import AUTO, BUILTIN_TARGETS, PipelineSchedule, Strategy, TargetKind

    names = {str(m) for m in (*Strategy, *PipelineSchedule, *TargetKind, *BUILTIN_TARGETS)} - {AUTO}
    names.discard("local")  # the `local` target's name is also the local deployment's and more

    def named(node) -> bool:
        return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names

    def auto_choice(node, other) -> bool:
        return (isinstance(node, ast.Constant) and node.value == AUTO
                and re.search(r"strateg|schedule", ast.unparse(other)) is not None)

    lists, compares = [], []
    for rel, tree in sources().items():
        if rel == "core/kinds.py":
            continue
        for node in ast.walk(tree):
            elements = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", None)
            if isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)):
                found = [e.value for e in elements if named(e)]
                if len(found) >= 2:
                    lists.append(f"{rel}:{node.lineno}: {found}")
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                for op, left, right in zip(node.ops, operands, operands[1:]):
                    if isinstance(op, (ast.Eq, ast.NotEq, ast.Is, ast.IsNot)):
                        hit = named(left) or named(right) or auto_choice(left, right) or auto_choice(right, left)
                    elif isinstance(op, (ast.In, ast.NotIn)) and isinstance(right, (ast.Tuple, ast.List, ast.Set)):
                        hit = any(named(e) or auto_choice(e, left) for e in right.elts)
                    else:
                        hit = False
                    if hit:
                        compares.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
            if isinstance(node, ast.MatchValue) and named(node.value):
                compares.append(f"{rel}:{node.lineno}: case {node.value.value!r}")
    return names, lists, compares


def test_strategies_schedules_and_target_kinds_are_named_once():
    import json

    from blocks.compute import BUILTIN, ComputeTarget, resolve_target
    from clouds.provider import WorkerResources
    from clouds.registry import adapter_for, is_cloud, job_variables
    from coordinator.run.job import BUILTIN_TARGETS, TrainJob
    from core.kinds import (AUTO, CLOUD_KINDS, PIPELINED_STRATEGIES, SHARED_HOST_KINDS, PipelineSchedule, Strategy,
                            TargetKind, builtin_kind)
    from core.plan import Plan
    from core.schedules import SCHEDULES, build_schedule
    from deployments.bootstrap import POOL_TYPES

    # members are their strings: what users pass and what JSON files hold stays as it was
    assert Strategy("pipeline") is Strategy.PIPELINE and Strategy.LOCAL_SGD == "local_sgd"
    assert json.dumps([Strategy.HYBRID, PipelineSchedule.ONE_F_ONE_B, TargetKind.K8S]) == '["hybrid", "1f1b", "k8s"]'
    assert "pipeline" in PIPELINED_STRATEGIES and f"{TargetKind.PROCESS}" == "process"
    plan = Plan(strategy=Strategy.HYBRID, data_parallel=2, stages=2, pipeline_schedule=PipelineSchedule.INTERLEAVED)
    assert json.loads(json.dumps(plan.to_dict()))["strategy"] == "hybrid"
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan

    # the job's form offers exactly the enums' values, as a choice list
    props = TrainJob.model_json_schema()["properties"]
    assert props["strategy"]["enum"] == [s.value for s in Strategy]
    assert props["pipeline_schedule"]["enum"] == [AUTO] + [s.value for s in PipelineSchedule]
    job = TrainJob(strategy="pipeline", pipeline_schedule="1f1b", target="local")
    assert json.loads(job.model_dump_json())["strategy"] == "pipeline"
    assert job.strategy == Strategy.PIPELINE and job.pipeline_schedule == PipelineSchedule.ONE_F_ONE_B
    assert ComputeTarget.model_json_schema()["properties"]["kind"]["enum"] == [k.value for k in TargetKind]
    assert tuple(SCHEDULES) == tuple(PipelineSchedule)
    for name in PipelineSchedule:
        assert build_schedule(name, 2, 4, chunks=2 if name is PipelineSchedule.INTERLEAVED else 1)

    # every per-kind list is the one table's
    assert tuple(BUILTIN) == BUILTIN_TARGETS == tuple(k.builtin for k in TargetKind)
    for kind in TargetKind:
        target = resolve_target(kind.builtin)
        assert target.kind == kind and builtin_kind(kind.builtin) is kind and target.offer == kind.offer
        assert target.remote == (kind.pool_type is not None) == (kind.builtin in POOL_TYPES)
        assert POOL_TYPES.get(kind.builtin) == kind.pool_type
        assert is_cloud(target) == kind.cloud == (kind in CLOUD_KINDS) == (adapter_for(target) is not None)
        assert (kind in SHARED_HOST_KINDS) == kind.shared_host
        if kind.cloud:  # a cloud kind has its job variables
            assert job_variables(kind, WorkerResources(vcpu=1.0, memory_gb=1.0), "r1")["zooid_run_id"] == "r1"

    for name in ("Strategy", "PipelineSchedule", "TargetKind", "BUILTIN_TARGETS", "SHARED_HOST_KINDS",
                 "CLOUD_KINDS", "PIPELINED_STRATEGIES"):
        assert definitions(name) == ["core/kinds.py"], name
    for gone in ("SUPPORTED_STRATEGIES", "STRATEGIES", "KINDS"):
        assert definitions(gone) in ([], ["engine/chaos.py"]), gone  # chaos's KINDS are fault kinds

    _, lists, compares = named_choices()
    assert lists == []
    assert compares == []
def fields_of(node: ast.ClassDef) -> set[str]:
    """The annotated class-level names of a class (a dataclass's fields)."""
    return {n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def test_transfer_stats_are_one_type():
    import dataclasses
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from comm.bandwidth import TransferStats
    from comm.collectives import allreduce_mean
    from tests.memory_store import MemoryStore

    # a store's link counts into it, and so do a rank's collectives
    store = MemoryStore()
    assert type(store.stats) is TransferStats
    store.put("runs/t/x", b"abcd")
    assert store.get("runs/t/x") == b"abcd"
    assert (store.stats.bytes_up, store.stats.bytes_down) == (4, 4)
    before = store.stats.copy()
    stats = [TransferStats(), TransferStats()]
    with ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda r: allreduce_mean(store, "runs/t/sync/e0", r, 2, {"w": torch.full((4,), float(r))},
                                                      10.0, stats=stats[r]), range(2)))
    assert all(torch.equal(out["w"], torch.full((4,), 0.5)) for out in outs)
    for s in stats:
        assert s.calls == 1 and s.seconds > 0 and s.bytes_up > 0 and s.bytes_down > 0
        assert s.bytes_total == s.bytes_up + s.bytes_down
    moved = store.stats - before
    assert type(moved) is TransferStats and moved.bytes_up == sum(s.bytes_up for s in stats)
    # the fields its readers use (worker results read upload_s, download_s, seconds, reposts, bytes_total)
    names = {f.name for f in dataclasses.fields(TransferStats)}
    assert {"bytes_up", "bytes_down", "upload_s", "download_s", "seconds_waiting", "seconds", "calls",
            "reposts"} <= names
    assert set(stats[0].to_dict()) == names

    assert definitions("TransferStats") == ["comm/bandwidth.py"]
    for gone in ("SyncStats", "LinkStats", "CollectiveStats"):
        assert definitions(gone) == [], gone
    # no other class counts bytes per direction
    counters = [f"{rel}:{node.name}" for rel, tree in sources().items() for node in ast.walk(tree)
                if isinstance(node, ast.ClassDef) and {"bytes_up", "bytes_down"} <= fields_of(node)]
    assert counters == ["comm/bandwidth.py:TransferStats"]


def benchmark_sources() -> dict[str, ast.Module]:
    """Every module under benchmarks/, by path relative to the root."""
    return {str(p.relative_to(ROOT)): ast.parse(p.read_text(), filename=str(p))
            for p in sorted(BENCHMARKS.rglob("*.py")) if "__pycache__" not in p.parts}


def benchmark_definitions(name: str) -> list[str]:
    return [rel for rel, tree in benchmark_sources().items() for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name]


def test_benchmarks_share_one_machine_line_and_one_money_format():
    from benchmarks.output import Provenance, code_state, machine_line, money

    prov = Provenance(code=code_state(), load_start=0.5, began=0.0)
    line = machine_line(prov, "one torch thread")
    assert line.startswith(f"Machine: {os.cpu_count()} CPU cores (") and line.endswith("; one torch thread.")
    assert machine_line(prov).endswith("at the end).")
    assert money(0.0012345) == "$1.234m" and money(0) == "$0.000m"

    for gone in ("machine_note", "_machine_note", "_money"):
        assert benchmark_definitions(gone) == [], gone
    assert benchmark_definitions("machine_line") == ["benchmarks/output.py"]
    assert benchmark_definitions("money") == ["benchmarks/output.py"]
    # no script writes a machine line of its own
    own = [rel for rel, tree in benchmark_sources().items() if rel != "benchmarks/output.py"
           for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
           and node.value.startswith("Machine:")]
    assert own == []


def test_cloud_timestamps_are_read_in_one_place():
    from datetime import datetime, timezone

    from clouds.timestamps import epoch_seconds

    moment = datetime(2026, 11, 20, 10, 0, 5, tzinfo=timezone.utc)
    for same in (moment, moment.timestamp(), "2026-11-20T10:00:05Z", "2026-11-20T10:00:05.000000000Z",
                 "2026-11-20T11:00:05+01:00"):
        assert epoch_seconds(same) == moment.timestamp(), same
    for never in (None, "", "0001-01-01T00:00:00Z"):
        assert epoch_seconds(never) is None

    assert definitions("epoch_seconds") == ["clouds/timestamps.py"]
    for gone in ("_ts", "parse_time"):
        assert definitions(gone) == [], gone
    # no other cloud module turns a clock reading into seconds by itself
    by_hand = [rel for rel, tree in sources().items() if rel.startswith("clouds/") and rel != "clouds/timestamps.py"
               for node in ast.walk(tree)
               if isinstance(node, ast.Attribute) and node.attr in ("timestamp", "fromisoformat", "strptime")]
    assert by_hand == []
