"""A profile estimated from the catalog's figures (a dry run told to rent nothing, with nothing
cached): the model's shapes and bytes are exact, its seconds follow the stated formula, and
nothing runs on real data."""
from __future__ import annotations

import pytest
from torch import nn

from engine.models import build_model, resolve_model
from planners.catalog import device_figures, store_figures
from profiling.estimate import DeviceFigures, estimate_profile
from profiling.profiler import profile_model

FIG = DeviceFigures(flops_per_s=1e9, bytes_per_s=1e8, forward_call_s=1e-6, backward_call_s=2e-6,
                    base_memory_bytes=123, source="test figures")


def test_shapes_and_bytes_are_those_a_measured_profile_finds():
    est = estimate_profile(resolve_model("digits_cnn"), "digits_cnn", (64,), 16, 4, "momentum", 1, FIG, 1)
    real = profile_model(build_model("digits_cnn"), "digits_cnn", (64,), 10, 16, repeats=1, microbatch_size=4,
                         optimizer="momentum", base_memory=False, thread_counts=[1])
    assert [l.name for l in est.layers] == [l.name for l in real.layers]
    assert [l.output_bytes for l in est.layers] == [l.output_bytes for l in real.layers]
    assert [l.param_bytes for l in est.layers] == [l.param_bytes for l in real.layers]
    assert est.param_bytes == real.param_bytes and est.optimizer_state_bytes == real.optimizer_state_bytes
    assert est.base_memory_bytes == 123 and est.peak_memory_method == "estimated"


def test_a_linear_layer_costs_its_flops_and_bytes_at_the_figures_rates():
    est = estimate_profile(lambda: nn.Sequential(nn.Linear(10, 20)), "lin", (10,), 8, 8, "sgd", 0, FIG, 1)
    (layer,) = est.layers
    rows, params = 8, (10 * 20 + 20) * 4
    touched = rows * 10 * 4 + rows * 20 * 4 + params
    assert layer.forward_s == pytest.approx(1e-6 + 2 * rows * 10 * 20 / 1e9 + touched / 1e8)
    # backward: the first layer's input is the job's data, which needs no gradient: the weight's
    # matmul alone
    assert layer.backward_s == pytest.approx(2e-6 + 2 * rows * 10 * 20 / 1e9 + 2 * touched / 1e8)
    assert layer.output_bytes == rows * 20 * 4 and layer.param_bytes == params
    assert est.step_s == pytest.approx(layer.forward_s + layer.backward_s + est.optimizer_step_s)


def test_the_model_lives_on_meta_only():
    built = []

    def factory():
        built.append(resolve_model("resnet18")())
        return built[-1]

    est = estimate_profile(factory, "resnet18", (3, 32, 32), 32, 8, "adam", 2, FIG, 1)
    assert {p.device.type for p in built[0].parameters()} == {"meta"}
    assert est.param_bytes > 4e7 and est.optimizer_state_bytes == 2 * est.param_bytes


def test_the_catalog_has_figures_for_its_offers_gpus_and_stores():
    from planners.catalog import offers

    for offer in offers().values():
        fig = device_figures(offer.gpu_type, offer.vcpu)
        assert fig["flops_per_s"] > 0 and fig["bytes_per_s"] > 0 and fig["source"]
    assert device_figures(None, 2)["flops_per_s"] == 2 * device_figures(None, 1)["flops_per_s"]
    with pytest.raises(ValueError, match="^gpu_type: no figures for 'Z9'"):
        device_figures("Z9", 1)
    assert store_figures("s3", network_bytes_per_s=1e6)["bandwidth_bytes_per_s"] == 1e6
    assert store_figures("rediss")["latency_s"] == store_figures("redis")["latency_s"]
