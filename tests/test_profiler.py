"""The profiler measures what the planners need, and the memory check refuses with numbers.

Byte figures are asserted exactly (they are arithmetic on shapes); measured times only for
sign, since the machine is shared and one sample may land in a busy window (the layers'
scaling to the chain is asserted exactly on a fake clock, in test_links; the store fit and the
contention factor here, on a fake clock and on scripted timings).
"""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import comm.store_base as store_base
import profiling.store_probe as store_probe
from core.errors import ZooidValueError
from core.stage_memory import GB, check_plan_memory, stage_bounds, stage_memory
from engine.models import build_model
from profiling.estimate import DeviceFigures, estimate_profile
from profiling.memory import measure_base_memory
from profiling.profiler import ModelProfile, hardware_fingerprint, profile_model, to_planner_layers
from profiling.timing import fit_serial_fraction, profile_layers, vcpu_factor
from profiling.store_probe import measure_contention, probe_sizes, profile_store
from tests.lm_helpers import tiny_regressor
from tests.memory_store import MemoryStore
from tests.fake_clock import FakeClock

F32 = 4


@pytest.fixture(autouse=True)
def one_thread():
    """Workers run one torch thread; so do these measurements (and the shared machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def cnn_profile() -> ModelProfile:
    torch.set_num_threads(1)
    return profile_model(build_model("digits_cnn", 0), "digits_cnn", (64,), 10, 64,
                         repeats=5, microbatch_size=32, base_memory=False, thread_counts=(1,))


def test_digits_mlp_bytes_are_exact():
    b = 16
    model = build_model("digits_mlp", 0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    p = profile_model(model, "digits_mlp", (64,), 10, b, repeats=3, base_memory=False,
                      thread_counts=(1,))
    assert [layer.output_bytes for layer in p.layers] == [b * 64 * F32, b * 64 * F32, b * 10 * F32]
    assert [layer.param_bytes for layer in p.layers] == [(64 * 64 + 64) * F32, 0, (64 * 10 + 10) * F32]
    assert p.param_bytes == sum(layer.param_bytes for layer in p.layers)
    # Whole model keeps the input and the ReLU output (the second Linear's input is the same tensor);
    # the loss adds the logits, the log-softmax it keeps and its scalar weight.
    loss = 2 * b * 10 * F32 + F32
    assert p.activation_bytes == b * 64 * F32 + b * 64 * F32 + loss
    assert p.layers[-1].activation_bytes == b * 64 * F32 + loss  # the head's stage holds the loss's share
    # CPU peak: params + grads + (no SGD state) + activations + the batch (x float, y int64).
    assert p.peak_memory_method == "cpu_accounted"
    assert p.peak_memory_bytes == 2 * p.param_bytes + p.activation_bytes + b * 64 * F32 + b * 8
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_digits_cnn_bytes_and_times(cnn_profile):
    p, b = cnn_profile, 32
    c = 16
    outputs = [b * 64, b * c * 64, b * c * 64, b * 2 * c * 64, b * 2 * c * 64, b * 2 * c * 16,
               b * 2 * c * 16, b * 64, b * 64, b * 10]
    assert [layer.output_bytes for layer in p.layers] == [n * F32 for n in outputs]
    params = [0, 9 * c + c, 0, 9 * c * 2 * c + 2 * c, 0, 0, 0, 2 * c * 16 * 64 + 64, 0, 64 * 10 + 10]
    assert [layer.param_bytes for layer in p.layers] == [n * F32 for n in params]
    # The max-pool keeps its input and its int64 argmax indices.
    assert p.layers[5].activation_bytes == b * 2 * c * 64 * F32 + b * 2 * c * 16 * 8
    assert p.microbatch_size == 32 and p.batch_size == 64
    assert all(layer.forward_s > 0 for layer in p.layers)
    assert p.layers[0].backward_s == 0.0  # reshaping the data input: nothing to differentiate
    assert all(layer.backward_s > 0 for layer in p.layers[1:])
    assert p.step_s > 0 and p.threads == 1
    # timed at the thread counts asked for (1 only), keyed by name; one point: no speed-up assumed
    assert list(p.step_s_by_threads) == ["1"] and p.step_s_by_threads["1"] > 0 and p.serial_fraction == 1.0


def test_a_custom_loss_job_is_profiled_on_float_targets_with_its_own_loss():
    """A regression under a custom loss (`tests.lm_helpers:mse`): float targets [B], the step and
    the head's memory those of its loss (the [B, 1] output and the difference it squares), not a
    cross-entropy's; the dataset's label count is not used."""
    b = 16
    p = profile_model(tiny_regressor(), "tests.lm_helpers:tiny_regressor", (8,), 0, b, repeats=1,
                      base_memory=False, thread_counts=(1,), target_dtype="float32", loss="tests.lm_helpers:mse")
    assert p.layers[-1].activation_bytes == b * 16 * F32 + b * 1 * F32 + b * F32
    assert p.peak_memory_bytes == 2 * p.param_bytes + p.activation_bytes + b * 8 * F32 + b * F32
    figures = DeviceFigures(flops_per_s=1e9, bytes_per_s=1e8, forward_call_s=0, backward_call_s=0, base_memory_bytes=0)
    est = estimate_profile(tiny_regressor, "tests.lm_helpers:tiny_regressor", (8,), b, b, "sgd", 0, figures, 1,
                           target_dtype="float32", loss="tests.lm_helpers:mse")  # the loss traced on `meta` too
    assert [l.activation_bytes for l in est.layers] == [l.activation_bytes for l in p.layers]


def test_activation_bytes_of_a_linear_relu_stack_are_exact():
    b = 7
    model = nn.Sequential(nn.Linear(20, 30), nn.ReLU(), nn.Linear(30, 5), nn.ReLU())
    layers = profile_layers(model, torch.randn(b, 20), repeats=1)
    # Linear keeps its input (the weight is a parameter, not an activation); ReLU its output.
    assert [layer.activation_bytes for layer in layers] == [b * 20 * F32, b * 30 * F32,
                                                            b * 30 * F32, b * 5 * F32]


def test_the_store_probe_is_sized_by_the_largest_tensor_the_job_moves_and_a_typical_activation():
    """A worker sizes its store probe from its own model (no model profile needed first): the
    largest of one sync (weights and momentum) and the layers' outputs on the micro-batch;
    the median output only where a pipeline may be planned."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    params = (64 * 32 + 32 + 32 * 10 + 10) * F32
    x = torch.randn(4, 64)
    assert probe_sizes(net, x, "momentum", pipeline=False) == (2 * params, 0.0)
    assert probe_sizes(net, x, "sgd", pipeline=True) == (params, 4 * 32 * F32)  # outputs 512, 512, 160 B
    wide = torch.randn(4096, 64)  # an output larger than a sync: 4096 x 32 x 4 B
    assert probe_sizes(net, wide, "adam", pipeline=True) == (4096 * 32 * F32, 4096 * 32 * F32)


def test_a_model_that_cannot_be_split_is_profiled_whole():
    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 3)

        def forward(self, x):
            return self.b(self.a(x) + x)

    p = profile_model(Residual(), "residual", (8,), 3, 4, repeats=2, base_memory=False,
                      thread_counts=(1,))
    assert [layer.name for layer in p.layers] == ["model"]
    assert p.layers[0].param_bytes == p.param_bytes == (8 * 8 + 8 + 8 * 3 + 3) * F32
    assert p.layers[0].output_bytes == 4 * 3 * F32


def test_profile_round_trips_through_json_and_reads_the_old_form(cnn_profile):
    again = ModelProfile.from_dict(json.loads(json.dumps(cnn_profile.to_dict())))
    assert again == cnn_profile
    old = {k: cnn_profile.to_dict()[k] for k in ("model", "input_shape", "batch_size", "step_s",
                                                 "param_bytes", "peak_rss_bytes", "hardware")}
    old["layers"] = [{k: v for k, v in layer.items() if k != "activation_bytes"}
                     for layer in cnn_profile.to_dict()["layers"]]
    assert ModelProfile.from_dict({**old, "unknown_later_field": 1}).layers[3].activation_bytes == 0


def test_hardware_fingerprint_is_stable_and_names_torch_and_threads():
    assert hardware_fingerprint() == hardware_fingerprint()
    assert hardware_fingerprint(3) != hardware_fingerprint(4)
    assert "/3t/" in hardware_fingerprint(3) and torch.__version__ in hardware_fingerprint(3)


def test_base_memory_is_measured_once_in_a_fresh_process(monkeypatch):
    import subprocess

    s0 = measure_base_memory()
    assert 50 << 20 < s0 < 4 << 30  # torch alone is tens of MB resident

    def no_second_process(*args, **kwargs):
        raise AssertionError("measured again instead of cached")

    monkeypatch.setattr(subprocess, "run", no_second_process)
    assert measure_base_memory() == s0


def test_vcpu_scaling_fit_is_amdahl():
    # t(n) = s + (1 - s) / n with s = 0.25, t1 = 2 s.
    times = {1: 2.0, 2: 2.0 * 0.625, 4: 2.0 * 0.4375}
    assert fit_serial_fraction(times) == pytest.approx(0.25)
    assert fit_serial_fraction({1: 1.0}) == 1.0  # one point: no speed-up assumed
    assert vcpu_factor(4, 0.25) == pytest.approx(0.4375)
    assert vcpu_factor(0.5, 0.25) == 2.0  # a half-CPU quota halves the speed
    with pytest.raises(ZooidValueError, match="vcpu"):
        vcpu_factor(0, 0.1)


class EmulatedLink(MemoryStore):
    """A store whose every put and every read of n bytes takes `latency + n / rate` seconds
    of a fake clock."""

    def __init__(self, clock: FakeClock, rate: float, latency: float):
        super().__init__()
        self.clock, self.rate, self.latency = clock, rate, latency

    def _write(self, key: str, data: bytes) -> None:
        self.clock.sleep(self.latency + len(data) / self.rate)
        super()._write(key, data)

    def _read(self, key: str) -> bytes | None:
        data = super()._read(key)
        if data is not None:
            self.clock.sleep(self.latency + len(data) / self.rate)
        return data


def test_store_fit_recovers_an_emulated_bandwidth(monkeypatch):
    """Timed on a fake clock that only the emulated link moves: the fit gives back the link's
    bandwidth and latency, the latency carrying half the hand-off delay it was given."""
    clock = FakeClock()
    monkeypatch.setattr(store_probe, "time", clock)
    monkeypatch.setattr(store_base, "time", clock)
    store = EmulatedLink(clock, rate=40e6, latency=0.003)
    bandwidth, latency = profile_store(store, "runs/p", handoff_s=0.004)
    assert bandwidth == pytest.approx(40e6, rel=1e-9)
    assert latency == pytest.approx(0.003 + 0.004 / 2, rel=1e-9)
    assert len(store.puts) == 5 * 3 and store.list("runs/") == []  # 3 of each of the 5 sizes, deleted


@pytest.mark.parametrize("alone, loaded, factor", [((1.0, 1.2), 1.65, 1.5), ((1.0, 1.2), 0.99, 1.0)])
def test_contention_factor_compares_compute_alone_and_under_transfers(monkeypatch, alone, loaded, factor):
    """The compute runs (on a real model) and is timed by script: alone before any transfer,
    under load once the transfers have begun, alone again once they have stopped (events the
    store's puts show). beta = loaded / mean(alone), never below 1; the bytes moved are the
    transfers' puts and gets."""
    store, payload = MemoryStore(), 1 << 16
    timings, seen = iter([0.0, alone[0], loaded, alone[1]]), []  # the warm-up, then the three phases

    def scripted(fn, repeats, device, **kwargs):
        fn()
        seen.append(len(store.puts))
        return next(timings)

    monkeypatch.setattr(store_probe, "_median_time", scripted)
    r = measure_contention(build_model("digits_cnn", 0), (64,), 10, 32, store, "runs/c", payload_bytes=payload)
    warmup, before, during, after = seen
    assert warmup == before == 0 and during >= 1 and after == len(store.puts)  # no put once the load stopped
    assert (r.alone_s, r.loaded_s) == (pytest.approx(sum(alone) / 2), loaded)
    assert r.factor == pytest.approx(factor)
    assert r.bytes_moved == 2 * payload * len(store.puts)
    assert store.list("runs/") == []


def test_planner_layers_are_accepted_by_the_planners(cnn_profile):
    from planners.co_optimize import parse_problem
    from planners.partition import partition

    layers = to_planner_layers(cnn_profile, "partition")
    answer = partition({"layers": layers, "bandwidth_bytes_per_s": 1e8, "microbatches": 4,
                        "max_stages": 3, "transport": "store", "latency_s": 1e-3})
    assert set(answer["by_stages"]) == {"1", "2", "3"}
    fast = ModelProfile.from_dict({**cnn_profile.to_dict(), "serial_fraction": 0.25})
    co = to_planner_layers(fast, "co-optimize", vcpus=[1, 4])
    assert co[3]["forward_s"] == pytest.approx([cnn_profile.layers[3].forward_s,
                                                cnn_profile.layers[3].forward_s * 0.4375])
    problem = parse_problem({"layers": co, "memory_options_bytes": [2 * GB, 4 * GB],
                             "bandwidth_bytes_per_s": [7e7, 7e7], "latency_s": 1e-3,
                             "contention": 1.2, "base_memory_bytes": 3e8, "dp_degrees": [1, 2],
                             "microbatches": 4, "price_per_byte_s": 1e-12, "weights": [1, 1]})
    assert len(problem.activation_bytes) == len(cnn_profile.layers)
    with pytest.raises(ZooidValueError, match="kind"):
        to_planner_layers(cnn_profile, "ring")


def test_memory_report_is_the_co_optimisers_arithmetic():
    acts, params = [100, 200, 300, 400], [10, 0, 20, 30]
    report = stage_memory(activation_bytes=acts, param_bytes=params, cuts=[1, 3], microbatches=4,
                          available_bytes=10_000, base_memory_bytes=1000,
                          optimizer_state_factor=2, data_parallel=2)
    assert [(s.first_layer, s.last_layer) for s in report] == [(0, 0), (1, 2), (3, 3)]
    # mu * sum a + (4 - 0 + 2) * sum s + s0
    assert [s.needed_bytes for s in report] == [400 + 60 + 1000, 2000 + 120 + 1000, 1600 + 180 + 1000]
    single = stage_memory(activation_bytes=acts, param_bytes=params, cuts=[], microbatches=1,
                          available_bytes=10_000)
    assert single[0].needed_bytes == 1000 + 2 * 60  # D = 1: weights and gradients only
    assert stage_bounds([2], 5) == [(0, 1), (2, 4)]
    with pytest.raises(ZooidValueError, match="cuts"):
        stage_bounds([0], 5)


def test_memory_check_refuses_with_the_numbers_per_stage():
    gb = int(GB)
    kwargs = dict(activation_bytes=[gb, gb // 2, gb // 4], param_bytes=[0, gb // 8, 0], cuts=[1, 2],
                  microbatches=3, base_memory_bytes=gb // 4, data_parallel=1)
    with pytest.raises(ZooidValueError) as err:
        check_plan_memory(available_bytes=2 * gb, **kwargs)
    message = str(err.value)
    assert err.value.field == "memory"
    assert "stage 0 (layers 0-0) needs 3.25 GB" in message and "worker has 2.00 GB" in message
    assert "stage 1 (layers 1-1) needs 2.00 GB" not in message  # 1.5 + 0.25 + 0.25 fits
    assert "stage 2" not in message
    report = check_plan_memory(available_bytes=[4 * gb, 2 * gb, gb], **kwargs)
    assert [s.fits for s in report] == [True, True, True]
    with pytest.raises(ZooidValueError, match="available_bytes"):
        check_plan_memory(available_bytes=[gb], **kwargs)


@pytest.mark.gpu
def test_cuda_peak_memory_is_the_allocators_peak():
    model = build_model("digits_cnn", 0).cuda()
    p = profile_model(model, "digits_cnn", (64,), 10, 64, repeats=2, base_memory=False)
    assert p.peak_memory_method == "cuda_max_allocated"
    # The allocator holds at least the weights, their gradients and the kept activations.
    assert p.peak_memory_bytes >= 2 * p.param_bytes + p.activation_bytes
    assert list(p.step_s_by_threads) == [str(p.threads)]


def test_per_offer_step_time_and_activations_scale(cnn_profile):
    p = ModelProfile.from_dict({**cnn_profile.to_dict(), "serial_fraction": 0.5, "threads": 1})
    assert p.step_s_at(2) == pytest.approx(p.step_s * 0.75)
    assert p.step_s_at(0.25) == pytest.approx(p.step_s * 4)
    assert p.layer_activation_bytes(64) == [2 * layer.activation_bytes for layer in p.layers]


def test_sampling_runs_for_a_least_duration_and_stops_when_stable(monkeypatch):
    from types import SimpleNamespace

    import profiling.timing as timing

    clock = [0.0]
    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=lambda: clock[0]))  # this module's clock only

    def timed(durations):
        calls = []

        def fn():
            clock[0] += durations(len(calls))
            calls.append(1)
        return fn, calls

    steady, calls = timed(lambda i: 0.004)
    assert timing._median_time(steady, 3, torch.device("cpu"), warmup=1) == pytest.approx(0.004)
    assert len(calls) == 1 + 3 + 3  # warm-up, a round, and one more that moved nothing
    steady, calls = timed(lambda i: 0.004)
    timing._median_time(steady, 3, torch.device("cpu"), warmup=1, min_time_s=0.06)
    assert len(calls) == 1 + 15 + 3  # sampled until 0.06 s, then one round to see it stable
    drifting, calls = timed(lambda i: 0.004 * 1.5 ** i)
    timing._median_time(drifting, 3, torch.device("cpu"), warmup=1, max_rounds=4)
    assert len(calls) == 1 + 3 * 4  # never stable: stops at the most rounds
def test_malloc_thresholds_are_pinned_where_workers_and_profiles_run():
    import platform

    from engine import malloc

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt is glibc's")
    assert malloc.pin_malloc_thresholds() is True
    assert malloc.pin_malloc_thresholds() is True  # idempotent
    assert malloc._pinned
