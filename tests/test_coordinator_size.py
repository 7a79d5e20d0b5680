"""The coordinator's size (`core.coordinator_size`): the memory a model needs it to have, the
target's own size refused in one line when too small, and the coordinator billed at its size,
on-demand, not at a worker's."""
from __future__ import annotations

import pytest

from core.coordinator_size import BASE_GB, GB, MODEL_COPIES, coordinator_memory_gb, coordinator_need_bytes
from core.errors import ZooidValueError


def test_the_need_is_the_process_and_the_model_held_several_times():
    assert coordinator_need_bytes(0) == BASE_GB * GB
    assert coordinator_need_bytes(2**30) == BASE_GB * GB + MODEL_COPIES * 2**30


def test_left_empty_the_memory_is_the_whole_gb_that_holds_the_model():
    assert coordinator_memory_gb(None, 100_000) == 1.0  # digits_cnn: the smallest
    # bert_large's 335M parameters in fp32: 0.5 + 5 x 1.25 GiB = 6.74 -> 7 GB
    assert coordinator_memory_gb(None, 335_000_000 * 4) == 7.0


def test_a_size_too_small_is_refused_naming_the_field():
    assert coordinator_memory_gb(2.0, 100_000) == 2.0
    with pytest.raises(ZooidValueError) as err:
        coordinator_memory_gb(1.0, 124_000_000 * 4)  # gpt2_small: 3.0 GB
    assert err.value.field == "coordinator_memory_gb" and "at least 3 GB" in str(err.value)
    assert "\n" not in str(err.value)


def test_a_job_resolves_its_coordinators_size_and_prices_it_on_demand_without_a_gpu():
    from blocks.compute import ComputeTarget
    from coordinator.run.job import TrainJob
    from coordinator.run.validate import check_coordinator, check_model_and_data
    from planners.catalog import get_offer

    job = TrainJob(model="digits_cnn", dataset="digits", target="inline")
    found = check_model_and_data(job)
    assert 0 < found["parameter_bytes"] < 2**20  # digits_cnn: a few thousand parameters in fp32
    gpu = ComputeTarget(kind="k8s", offer="ec2-g5.xlarge", worker_gpu=1, coordinator_offer="fargate-cpu",
                        coordinator_vcpu=0.25, coordinator_memory_gb=2.0)
    resolved = check_coordinator(gpu, found["parameter_bytes"])
    assert resolved["coordinator_offer"].name == "fargate-cpu" and resolved["coordinator_memory_gb"] == 2.0
    assert get_offer("fargate-cpu").price_per_s(0.25, 2.0, 0) < get_offer("fargate-cpu").price_per_s(1.0, 2.0, 0)
    with pytest.raises(ZooidValueError) as err:
        check_coordinator(ComputeTarget(coordinator_offer="no-such-offer"), 0)
    assert err.value.field == "coordinator_offer"
