"""Spot capacity: the catalog's spot offers, the job field `capacity` and its refusals, the `auto`
choice between on-demand and spot, billing at either capacity, and the job variables that ask for
spot on each provider, held to the provider's own SDK schema (`tests.provider_schemas`)."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from clouds.provider import FLOW_RUN_COMMAND, JobVariablesError, WorkerResources
from clouds.registry import job_variables
from core.errors import ZooidValueError
from core.notice import work_through_s
from core.plan import Plan
from planners.catalog import get_offer, spot_offer, spot_offers
from planners.spot import (HANDOVER, RERUN, choice_words, choose_capacity, recovery_of, redo_worker_s, replaced_share,
                           waits_for_startup)
from tests.cloud_fixtures import flow_run, render, template

# -- the catalog ------------------------------------------------------------------------------


def test_each_spot_offer_names_its_price_notice_rate_and_sources():
    offers = spot_offers()
    assert set(offers) == {"fargate-spot-cpu", "aci-spot-cpu", "k8s-spot-node-pool"}
    for o in offers.values():
        assert o.source and o.rate_source and o.date and o.assumed and o.interruptions_per_worker_hour > 0
    assert (offers["fargate-spot-cpu"].notice_s, offers["aci-spot-cpu"].notice_s,
            offers["k8s-spot-node-pool"].notice_s) == (120, 30, 30)
    # Fargate Spot at its own list prices: 1 vCPU + 2 GB an hour
    assert spot_offer("fargate-cpu", "ecs").offer().price_per_hour(vcpu=1, memory_gb=2) == pytest.approx(
        0.01334053 + 2 * 0.00146489, rel=1e-12)
    # ACI Spot at 70 % below the ACI container it shadows
    aci = get_offer("aci-cpu").price_per_s(1, 1.5)
    assert spot_offer("aci-cpu", "aci").price_per_s(1, 1.5) == pytest.approx(0.3 * aci, rel=1e-12)


def test_a_target_kind_takes_the_spot_offer_of_its_on_demand_offer_or_none():
    assert spot_offer("fargate-cpu", "ecs").name == "fargate-spot-cpu"
    assert spot_offer("fargate-cpu", "docker").name == "fargate-spot-cpu"  # docker is priced as Fargate
    assert spot_offer("aci-cpu", "aci").name == "aci-spot-cpu"
    assert spot_offer("aci-cpu", "k8s").name == "k8s-spot-node-pool"
    for offer, kind in (("aci-cpu", "inline"), ("aci-cpu", "process"), ("aci-gpu-k80", "aci"),
                        ("ec2-g4dn.xlarge", "ecs")):
        assert spot_offer(offer, kind) is None, (offer, kind)


# -- the job field ----------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["inline", "local"])
def test_a_target_with_no_spot_offer_refuses_capacity_spot_naming_it(target):
    from coordinator.run.job import TrainJob
    from coordinator.run.validate import check_capacity, check_target_and_offer

    job = TrainJob(target=target, capacity="spot")
    with pytest.raises(ZooidValueError) as refused:
        check_capacity(job, *check_target_and_offer(job))
    assert refused.value.field == "capacity" and "\n" not in str(refused.value)
    assert str(refused.value).startswith("capacity: spot: target")
    for capacity in ("on_demand", "auto"):  # on-demand everywhere; auto plans on-demand there
        assert check_capacity(TrainJob(target=target, capacity=capacity), *check_target_and_offer(job)) is None


def test_the_refusal_comes_before_anything_starts():
    """`make run`'s check (no Prefect API, nothing started) refuses it in one line."""
    from coordinator.run.job_fields import check_fields

    with pytest.raises(ZooidValueError, match=r"^capacity: spot: target 'inline'"):
        check_fields({"target": "inline", "capacity": "spot", "epochs": 1}, api=False)
    with pytest.raises(ZooidValueError, match=r"^capacity: "):
        check_fields({"capacity": "cheap"}, api=False)


def test_spot_targets_resolve_their_spot_offer():
    from coordinator.run.job import TrainJob
    from coordinator.run.validate import check_capacity, check_target_and_offer

    for target, name in (("docker", "fargate-spot-cpu"), ("ecs", "fargate-spot-cpu"), ("aci", "aci-spot-cpu"),
                         ("k8s", "k8s-spot-node-pool")):
        job = TrainJob(target=target, capacity="spot", store="s3://b/p")
        assert check_capacity(job, *check_target_and_offer(job)).name == name


# -- auto: the expected re-done work against the discount -------------------------------------

COMMON = dict(workers=4, run_s=3600.0, epoch_s=360.0, steps_per_epoch=100, startup_s=60.0,
              price_on_demand_per_s=1e-5, price_spot_per_s=0.7e-5, rate_per_worker_hour=2.0, rate_measured=False)


def test_auto_chooses_spot_where_a_handover_loses_one_step():
    """Local-SGD over the store: a preemption costs the replacement's start-up, the other three's
    wait for it and one step (3.6 s): 4 x 60 + 3.6 = 243.6 worker-s; 2 an hour over 4 workers x 1 h
    is 8 preemptions: 14400 + 8 x 243.6 = 16348.8 worker-s at 70 % of the price."""
    choice = choose_capacity(asked="auto", strategy="local_sgd", collective="store", **COMMON)
    assert choice.recovery == HANDOVER and choice.redo_worker_s == pytest.approx(243.6, rel=1e-12)
    assert choice.expected_preemptions == pytest.approx(8.0, rel=1e-12)
    assert choice.on_demand_usd == pytest.approx(0.144, rel=1e-12)
    assert choice.spot_usd == pytest.approx(0.7e-5 * 16348.8, rel=1e-12)  # $0.1144416
    assert choice.capacity == "spot"


def test_auto_chooses_on_demand_where_each_preemption_reruns_half_an_epoch():
    """The ring (and a pipeline) reruns the epoch attempt: 4 x (60 + 360 / 2) = 960 worker-s a
    preemption; 14400 + 8 x 960 = 22080 worker-s at 70 % is $0.15456, above on-demand's $0.144."""
    for strategy, collective in (("local_sgd", "ring"), ("pipeline", "store"), ("hybrid", "store")):
        choice = choose_capacity(asked="auto", strategy=strategy, collective=collective, **COMMON)
        assert choice.recovery == RERUN and choice.redo_worker_s == pytest.approx(960.0, rel=1e-12)
        assert choice.spot_usd == pytest.approx(0.7e-5 * 22080, rel=1e-12)
        assert choice.capacity == "on_demand", (strategy, collective)


def test_a_spare_saves_the_start_up_wait_of_the_preemptions_that_find_it_ready():
    """Preemptions come as a Poisson process (2 a worker-hour x 4 workers: 8 an hour); one spare
    is missing only while the last preemption's new spare starts (60 s): P(N >= 1) with mean
    8 x 60 / 3600; two spares only when two came within it."""
    mean = 8 * 60 / 3600
    assert waits_for_startup(0, 2.0, 4, 60.0) == 1.0
    assert waits_for_startup(1, 2.0, 4, 60.0) == pytest.approx(1 - math.exp(-mean), rel=1e-12)
    assert waits_for_startup(2, 2.0, 4, 60.0) == pytest.approx(1 - math.exp(-mean) * (1 + mean), rel=1e-12)
    one = choose_capacity(asked="auto", strategy="local_sgd", collective="store", spares=1, **COMMON)
    redo = 3.6 + (1 - math.exp(-mean)) * 240
    assert one.redo_worker_s == pytest.approx(redo, rel=1e-12)
    assert one.spot_usd == pytest.approx(0.7e-5 * (14400 + 3600 + 8 * redo), rel=1e-12)  # the spare's hour, billed
    assert "1 warm spare(s) included" in choice_words(one.to_dict())
    # preemptions faster than a spare starts: nearly every one waits, as without a spare
    assert waits_for_startup(1, 3600.0, 4, 60.0) == pytest.approx(1.0, abs=1e-12)


def test_working_through_the_notice_hides_the_start_up_it_covers():
    """A warm run's workers work through the notice while their successor starts: a preemption
    costs the successor's start-up (60 s, billed beside the worker it succeeds), the others wait
    only for what the notice's working time does not cover, and one step (3.6 s). Fargate Spot's
    120 s give 90 s of work: 60 + 4 x 0 + 3.6; a 30 s notice gives 22.5 s: 60 + 4 x 37.5 + 3.6;
    the ring reruns half an epoch of every worker besides. A notice in the run's last working time
    (90 s of its 3600: 2.5 % of them) is worked through to the end and costs nothing."""
    assert [work_through_s(n) for n in (120, 30, 10, 5, 0)] == [90.0, 22.5, 5.0, 0.0, 0.0]
    fargate = choose_capacity(asked="auto", strategy="local_sgd", collective="store", notice_s=120, **COMMON)
    assert fargate.redo_worker_s == pytest.approx(63.6 * (1 - 90 / 3600), rel=1e-12)
    assert fargate.spot_usd == pytest.approx(0.7e-5 * (14400 + 8 * 63.6 * 0.975), rel=1e-12)
    short = choose_capacity(asked="auto", strategy="local_sgd", collective="store", notice_s=30, **COMMON)
    assert short.redo_worker_s == pytest.approx((60 + 4 * 37.5 + 3.6) * (1 - 22.5 / 3600), rel=1e-12)
    ring = choose_capacity(asked="auto", strategy="local_sgd", collective="ring", notice_s=120, **COMMON)
    assert ring.redo_worker_s == pytest.approx((60 + 4 * 180.0) * 0.975, rel=1e-12)
    # a run no longer than the working time: every notice is worked through to its end
    brief = choose_capacity(asked="auto", strategy="local_sgd", collective="store", notice_s=120,
                            **{**COMMON, "run_s": 80.0})
    assert brief.redo_worker_s == 0.0 and replaced_share(80.0, 120) == 0.0 and replaced_share(3600.0, 0) == 1.0
    # a notice no longer than the margin: the workers leave at once, as in a cold run
    assert redo_worker_s(HANDOVER, 4, 60.0, 3.6, 360.0, notice_s=5) == redo_worker_s(HANDOVER, 4, 60.0, 3.6, 360.0)


def test_a_capacity_the_job_names_is_kept_with_both_bills():
    for asked in ("spot", "on_demand"):
        choice = choose_capacity(asked=asked, strategy="local_sgd", collective="ring", **COMMON)
        assert choice.capacity == asked and choice.reason == "the job's capacity"
        assert choice.spot_usd == pytest.approx(0.15456, rel=1e-12)
    words = choice_words(choice.to_dict())
    assert "on-demand $0.1440" in words and "$0.1546" in words and "8.00 expected preemptions" in words
    assert recovery_of("local_sgd", "store") == HANDOVER and redo_worker_s(HANDOVER, 2, 10.0, 1.0, 50.0) == 21.0


def _ctx(tmp_path, target_kind="docker", capacity="auto", rate_samples=None, monkeypatch=None, spot_spares=0):
    from comm.store import open_store
    from coordinator.plan.profile_cache import ProfileCache
    from coordinator.run.context import RunContext

    offer = get_offer("fargate-cpu")
    target = SimpleNamespace(kind=target_kind, worker_vcpu=1.0, worker_memory_gb=2.0, worker_gpu=0)
    resolved = SimpleNamespace(target=target, offer=offer, spot=spot_offer("fargate-cpu", target_kind),
                               target_name=target_kind)
    job = SimpleNamespace(capacity=capacity, collective="store", spot_spares=spot_spares)
    url = f"file://{tmp_path}/durable"
    monkeypatch.setattr("coordinator.plan.capacity.timings_key", lambda ctx: "target-key")
    if rate_samples is not None:
        ProfileCache(lambda: open_store(url)).put("timings", "target-key",
                                                  {"interruptions_per_worker_hour": rate_samples})
    ctx = RunContext(run_id="zspot", job=job, resolved=resolved)
    object.__setattr__(ctx, "open_durable", lambda: open_store(url))
    return ctx


def _plan(price: float) -> Plan:
    return Plan(strategy="local_sgd", data_parallel=4, steps_per_epoch=100, price_per_worker_s=price,
                predicted_epoch_s=360.0, predicted_run_s=3600.0, predicted_run_cost_usd=0.2,
                predicted_cost_by_epoch_usd=(0.1, 0.2), run_terms={"startup_s": 60.0})


def test_the_plan_carries_the_chosen_capacity_its_price_and_both_bills(tmp_path, monkeypatch):
    from coordinator.plan.capacity import with_capacity

    od = get_offer("fargate-cpu").price_per_s(1.0, 2.0)
    spot = spot_offer("fargate-cpu", "docker").price_per_s(1.0, 2.0)
    # the measured rate (the mean of the run terms' samples, 1.5 an hour) replaces the assumed 0.05
    plan = with_capacity(_ctx(tmp_path, rate_samples=[1.0, 2.0], monkeypatch=monkeypatch), _plan(od))
    choice = plan.capacity_choice
    assert choice["rate_per_worker_hour"] == 1.5 and choice["rate_measured"] is True
    assert choice["expected_preemptions"] == pytest.approx(6.0, rel=1e-12)
    assert plan.capacity == "spot" and plan.price_per_worker_s == pytest.approx(spot, rel=1e-12)
    # no spare (the default): each preemption waits for a new worker's start
    assert choice["spares"] == 0 and choice["spot_usd"] == pytest.approx(spot * (14400 + 6 * 243.6), rel=1e-12)
    assert plan.predicted_run_cost_usd == pytest.approx(0.2 - od * 14400 + choice["spot_usd"], rel=1e-12)
    # one asked for: billed the whole run; a preemption waits for a start-up only where another
    # came within the last 60 s (P = 1 - exp(-1.5 x 4 x 60 / 3600) = 1 - e^-0.1)
    one = with_capacity(_ctx(tmp_path / "a", rate_samples=[1.0, 2.0], monkeypatch=monkeypatch, spot_spares=1),
                        _plan(od)).capacity_choice
    waits = 1 - math.exp(-0.1)
    assert one["spares"] == 1 and one["redo_worker_s"] == pytest.approx(3.6 + waits * 240, rel=1e-12)
    assert one["spot_usd"] == pytest.approx(spot * (14400 + 3600 + 6 * (3.6 + waits * 240)), rel=1e-12)
    # none measured: the catalog's assumed rate
    plan = with_capacity(_ctx(tmp_path / "b", capacity="spot", monkeypatch=monkeypatch), _plan(od))
    assert plan.capacity_choice["rate_per_worker_hour"] == 0.05 and not plan.capacity_choice["rate_measured"]
    # on-demand asked: the plan as it was
    plan = with_capacity(_ctx(tmp_path / "c", capacity="on_demand", monkeypatch=monkeypatch), _plan(od))
    assert (plan.capacity, plan.capacity_choice, plan.price_per_worker_s) == ("on_demand", {}, od)


def test_a_rank_is_billed_at_the_plans_capacity_or_the_one_it_is_told(tmp_path, monkeypatch):
    import dataclasses

    ctx = _ctx(tmp_path, monkeypatch=monkeypatch)
    od = get_offer("fargate-cpu").price_per_s(1.0, 2.0)
    spot = spot_offer("fargate-cpu", "docker").price_per_s(1.0, 2.0)
    plan = dataclasses.replace(_plan(od), capacity="spot")
    assert ctx.price_of(plan)(1) == pytest.approx(spot, rel=1e-12)
    assert ctx.price_of(plan, "on_demand")(1) == od  # a replacement moved to on-demand
    assert ctx.price_of(_plan(od))(0) == od
    staged = dataclasses.replace(plan, stages=2, data_parallel=1, stage_memory_gb=(4.0, 2.0))
    assert ctx.price_of(staged)(0) == pytest.approx(spot_offer("fargate-cpu", "docker").price_per_s(1.0, 4.0))


# -- the job variables on each provider, held to its SDK's schema ------------------------------

RES = WorkerResources(vcpu=1, memory_gb=1.2)
ENGINE = FLOW_RUN_COMMAND.split()
"""The container process of every worker: the flow run's engine (`clouds.provider.FLOW_RUN_COMMAND`)."""


def test_ecs_spot_is_a_fargate_spot_strategy_without_a_launch_type():
    """Rendered through prefect-aws's own ECS worker: the RunTask request passes botocore's model,
    asks for FARGATE_SPOT and has no `launchType` (RunTask refuses both together); the task
    definition is Fargate's, with the notice's 120 s stopTimeout."""
    from prefect_aws.workers.ecs_worker import ECSJobConfiguration, ECSWorker

    from tests.provider_schemas import ecs as schemas

    network = {"awsvpcConfiguration": {"subnets": ["subnet-0a1b2c3d"], "assignPublicIp": "ENABLED"}}
    values = job_variables("ecs", RES, "zrunspot", image="zooid-worker:cpu", capacity="spot",
                           extra={"cluster": "zooid", "family": "zooid-worker", "vpc_id": "vpc-0a1b2c3d",
                                  "network_configuration": network})
    cfg = render(ECSJobConfiguration, template("ecs"), values)
    fr = flow_run("zrunspot-e0-r0-a0")
    cfg.prepare_for_flow_run(fr)
    worker = ECSWorker(work_pool_name="zooid-ecs")
    taskdef = worker._prepare_task_definition(cfg, region="us-east-1", flow_run=fr)
    worker._validate_task_definition(taskdef, cfg)
    assert taskdef["requiresCompatibilities"] == ["FARGATE"] and taskdef["containerDefinitions"][0]["stopTimeout"] == 120
    schemas.check_input("RegisterTaskDefinition", taskdef)
    arn = "arn:aws:ecs:us-east-1:123456789012:task-definition/zooid-worker:1"
    worker._custom_network_configuration = lambda vpc_id, network, cfg: network  # (its subnets' look-up is EC2's)
    request = worker._prepare_task_run_request(cfg, taskdef, arn, True)
    schemas.check_input("RunTask", request)
    assert request["capacityProviderStrategy"] == [{"capacityProvider": "FARGATE_SPOT", "weight": 1}]
    assert "launchType" not in request
    # the flow run's engine is the container's process (the notice's SIGTERM reaches the worker's handler)
    assert request["overrides"]["containerOverrides"][0]["command"] == ENGINE
    on_demand = render(ECSJobConfiguration, template("ecs"),
                       job_variables("ecs", RES, "zrunod", image="zooid-worker:cpu", extra={"cluster": "zooid"}))
    assert on_demand.task_run_request["launchType"] == "FARGATE"
    assert "stopTimeout" not in on_demand.task_definition["containerDefinitions"][0]
    with pytest.raises(JobVariablesError, match="^capacity"):  # EC2 GPU workers have no Fargate Spot
        job_variables("ecs", WorkerResources(vcpu=4, memory_gb=8, gpu=1, gpu_type="T4"), "r", capacity="spot")


def test_aci_spot_is_the_container_groups_priority():
    from prefect_azure.workers.container_instance import AzureContainerJobConfiguration

    from tests.provider_schemas import aci as schemas

    def group(capacity: str) -> dict:
        values = job_variables("aci", RES, "zrunspot", image="zooid-worker:cpu", capacity=capacity,
                               extra={"resource_group_name": "rg", "subscription_id": "sub"})
        cfg = render(AzureContainerJobConfiguration, template("azure-container-instance"), values)
        cfg.prepare_for_flow_run(flow_run("zrunspot-e0-r0-a0"))  # the command as a list, as the worker sends it
        schemas.check_template_group(cfg.arm_template["resources"][0])
        return cfg.arm_template["resources"][0]

    spot = group("spot")
    assert spot["properties"]["priority"] == "Spot" and spot["apiVersion"] == "2023-05-01"
    assert spot["properties"]["containers"][0]["properties"]["command"] == ENGINE  # no entrypoint script first
    on_demand = group("on_demand")["properties"]
    assert "priority" not in on_demand and on_demand["containers"][0]["properties"]["command"] == ENGINE
    with pytest.raises(JobVariablesError, match="^capacity"):
        job_variables("aci", WorkerResources(vcpu=4, memory_gb=5, gpu=1, gpu_type="K80"), "r", capacity="spot")


def test_kubernetes_spot_selects_and_tolerates_the_spot_node_pool():
    import copy

    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    from clouds.kubernetes import K8S_SPOT_LABEL
    from tests.provider_schemas import k8s as schemas

    def pod_spec(res: WorkerResources, capacity: str) -> dict:
        values = job_variables("k8s", res, "zrunspot", image="zooid-worker:cpu", capacity=capacity,
                               extra={"namespace": "zooid"})
        cfg = render(KubernetesWorkerJobConfiguration, template("kubernetes"), values)
        cfg.prepare_for_flow_run(flow_run("zrunspot-e0-r0-a0"))
        manifest = copy.deepcopy(cfg.job_manifest)
        manifest["metadata"]["name"] = "zrunspot-job"
        for c in manifest["spec"]["template"]["spec"]["containers"]:  # quantities as the server answers them
            c["resources"] = {k: {n: str(v) for n, v in part.items()} for k, part in c["resources"].items()}
        schemas.check("V1Job", manifest)
        return manifest["spec"]["template"]["spec"]

    key, value = K8S_SPOT_LABEL
    spec = pod_spec(RES, "spot")
    assert spec["nodeSelector"] == {key: value}
    assert spec["containers"][0]["args"] == ENGINE and "command" not in spec["containers"][0]  # the image's none
    assert spec["tolerations"] == [{"key": key, "operator": "Equal", "value": value, "effect": "NoSchedule"}]
    on_demand = pod_spec(RES, "on_demand")
    assert "nodeSelector" not in on_demand and on_demand["containers"][0]["args"] == ENGINE
    gpu = pod_spec(WorkerResources(vcpu=4, memory_gb=10, gpu=1, gpu_type="T4"), "spot")  # beside the GPU's own
    assert gpu["nodeSelector"] == {"nvidia.com/gpu.product": "Tesla-T4", key: value} and len(gpu["tolerations"]) == 2


def test_docker_labels_the_containers_capacity_and_the_launcher_follows_each_spec():
    from coordinator.workers.launchers import PoolLauncher

    assert job_variables("docker", RES, "r", capacity="spot")["labels"] == {"zooid-run": "r", "zooid.capacity": "spot"}
    with pytest.raises(JobVariablesError, match="^capacity"):
        job_variables("docker", RES, "r", capacity="auto")  # resolved by the plan, never launched as such
    launcher = PoolLauncher("r", "zooid-worker/docker", capacity="spot",
                            rank_job_variables=lambda rank, capacity: job_variables("docker", RES, "r",
                                                                                    capacity=capacity))
    assert launcher.variables_of(0)["labels"]["zooid.capacity"] == "spot"
    assert launcher.variables_of(0, "on_demand")["labels"]["zooid.capacity"] == "on_demand"



def test_the_dry_run_shows_both_bills():
    from coordinator.run.job import TrainJob
    from flows.dry_run import plan_report

    choice = choose_capacity(asked="auto", strategy="local_sgd", collective="store", spot_offer="fargate-spot-cpu",
                             **COMMON)
    plan = Plan(strategy="local_sgd", data_parallel=4, steps_per_epoch=100, price_per_worker_s=0.7e-5,
                predicted_epoch_s=360.0, predicted_run_s=3600.0, capacity="spot", capacity_choice=choice.to_dict())
    lines = plan_report(TrainJob(target="docker", capacity="auto"), plan.to_dict()).splitlines()
    assert ("Capacity: spot (spot's expected bill, re-done work included, is below on-demand's): on-demand "
            "$0.1440, spot (fargate-spot-cpu) $0.1144 with 8.00 expected preemptions at 2 interruptions per "
            "worker-hour (assumed), each 243.6 worker-s redone (handover).") in lines


@pytest.mark.parametrize("strategy, stages", [("local_sgd", 1), ("pipeline", 2)])
def test_every_workers_spec_runs_on_the_plans_capacity(strategy, stages):
    """What the workers' side reads (`WorkerSpec.capacity`) is the plan's resolved capacity."""
    from coordinator.run.job import TrainJob
    from coordinator.workers.worker_specs import worker_specs

    job = TrainJob(strategy=strategy, workers=2)
    ctx = SimpleNamespace(job=job, run_id="zspot", store_ref="file:///tmp/s", durable_ref="file:///tmp/d",
                          resolved=SimpleNamespace(target=SimpleNamespace(remote=False, kind="inline"), model_kwargs={}),
                          state=SimpleNamespace(dataset={"n_train": 256}))
    plan = Plan(strategy=strategy, data_parallel=2 if stages == 1 else 1, stages=stages, batch_size=16,
                cuts=(0,) if stages == 2 else (), microbatches=2, capacity="spot")
    specs = worker_specs(ctx, plan, epoch=0, init="", lr=0.05, attempt=0)
    assert len(specs) == 2 and {s.capacity for s in specs} == {"spot"}


def test_auto_chooses_once_per_plan_not_once_per_epoch(tmp_path, monkeypatch):
    """The plan in force, predicted again after an epoch, keeps its capacity even where the bills
    would now say otherwise (here: a measured rate that makes spot dearer)."""
    from coordinator.plan.capacity import with_capacity

    od = get_offer("fargate-cpu").price_per_s(1.0, 2.0)
    ctx = _ctx(tmp_path, rate_samples=[50.0], monkeypatch=monkeypatch)
    assert with_capacity(ctx, _plan(od)).capacity == "on_demand"
    kept = with_capacity(ctx, _plan(od), keep="spot")
    assert kept.capacity == "spot" and kept.capacity_choice["reason"] == "auto's choice when the plan was made, kept"


def test_the_first_warm_workers_start_on_the_capacity_the_plan_will_most_likely_choose():
    """They start before the plan (to take the profile); a plan on another capacity replaces them."""
    from coordinator.workers.warm_pool import provisional_plan

    def ctx(capacity, spot):
        from coordinator.run.job import TrainJob

        target = SimpleNamespace(worker_vcpu=1.0, worker_memory_gb=2.0, worker_gpu=0)
        return SimpleNamespace(job=TrainJob(capacity=capacity), resolved=SimpleNamespace(target=target, spot=spot))

    fargate = spot_offer("fargate-cpu", "docker")
    assert provisional_plan(ctx("spot", fargate)).capacity == "spot"
    assert provisional_plan(ctx("auto", fargate)).capacity == "spot"
    assert provisional_plan(ctx("auto", None)).capacity == "on_demand"
    assert provisional_plan(ctx("on_demand", fargate)).capacity == "on_demand"
