"""The link side of a profile: a worker's put and get costs, and the store collective timed
among real worker processes, with the fits the planners read."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from comm.store import open_store
from profiling.timing import profile_layers
from profiling.store_probe import fit_endpoints, profile_transfers, time_steps_between_checkpoints, transfer_sizes
from tests.fake_clock import FakeClock


def test_relative_fit_recovers_latency_and_bandwidth_exactly():
    bw, lat = 250e6, 2e-3
    samples = [(s, lat + s / bw) for s in (1 << 10, 1 << 16, 1 << 20, 1 << 24) for _ in range(3)]
    got_bw, got_lat = fit_endpoints(samples + [(1 << 10, 1.0)])  # one outlier: the median ignores it
    assert got_bw == pytest.approx(bw, rel=1e-9) and got_lat == pytest.approx(lat, rel=1e-9)


def test_probe_sizes_reach_the_largest_tensor_within_bounds():
    assert transfer_sizes(0)[-1] == 4 << 20 and transfer_sizes(0)[0] == 1 << 10
    assert transfer_sizes(37e6)[-1] == int(37e6)
    assert transfer_sizes(1e12)[-1] == 64 << 20


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    """One clock for the emulated links, the stores' waits and the probes that time them."""
    import comm.bandwidth
    import comm.store_base
    import profiling.store_probe

    fake = FakeClock()
    for module in (comm.bandwidth, comm.store_base, profiling.store_probe):
        monkeypatch.setattr(module, "time", fake)
    monkeypatch.setattr(comm.bandwidth, "sleep_until", fake.sleep_until)
    return fake


def test_put_and_get_fits_recover_emulated_links_per_direction(tmp_path, clock):
    """On the test's clock a transfer takes exactly what the emulated link charges: the fits
    find each direction's rate (within the bucket's small burst and the codec's header) and
    no latency (the link has none)."""
    up, down = 30e6, 60e6
    store = open_store(str(tmp_path), upload_bytes_per_s=up, download_bytes_per_s=down)
    t = profile_transfers(store, "runs/t/probe", max_bytes=2 << 20, repeats=2, handoff_s=0.0)
    assert t.put_bandwidth == pytest.approx(up, rel=0.05) and t.get_bandwidth == pytest.approx(down, rel=0.05)
    assert t.put_latency_s < 1e-5 and t.get_latency_s < 1e-5
    assert store.list("runs/") == []


def test_steps_between_checkpoint_writes_are_timed_and_leave_no_trace(tmp_path, clock):
    """On the test's clock a step's forward takes 3 ms and a checkpoint's put 7 ms: the probe
    reports exactly those, and restores the model and optimizer."""
    from engine.models import build_model
    from engine.optimizers import build_optimizer

    store = open_store(str(tmp_path))
    real_put = store.put
    store.put = lambda *args, **kwargs: (clock.advance(0.007), real_put(*args, **kwargs))[1]
    net = build_model("digits_mlp", 0)
    net.register_forward_pre_hook(lambda module, args: clock.advance(0.003))
    opt = build_optimizer("adam", net, 0.01)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    step_s, write_s = time_steps_between_checkpoints(store, "runs/k/probe", net, opt, x, y, repeats=2)
    assert step_s == pytest.approx(0.003) and write_s == pytest.approx(0.007)
    assert store.list("runs/") == []
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())  # weights restored
    assert opt.state_dict()["state"] == {}  # and the optimizer as it was


def test_layer_times_split_into_per_call_and_per_row_parts(monkeypatch):
    """On a clock the layer itself moves (forward 4 ms a call + 10 us a row, backward 2 ms +
    5 us a row), the fit recovers the per-call parts exactly; one size fits none."""
    from types import SimpleNamespace

    import profiling.timing as timing

    clock = [0.0]
    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=lambda: clock[0]))

    def advance(seconds: float) -> None:
        clock[0] += seconds

    class Affine(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(256, 256)

        def forward(self, x):
            advance(0.004 + 1e-5 * len(x))
            out = self.lin(x)
            if out.requires_grad:
                out.register_hook(lambda g: advance(0.002 + 5e-6 * len(g)))
            return out

    torch.manual_seed(0)
    model = nn.Sequential(Affine(), nn.ReLU())
    [first, _] = profile_layers(model, torch.randn(64, 256), repeats=5, fit_rows=8)
    assert first.forward_fixed_s == pytest.approx(0.004, rel=1e-6)
    assert first.backward_fixed_s == pytest.approx(0.002, rel=1e-6)
    assert first.forward_s == pytest.approx(0.004 + 64e-5, rel=1e-6)
    [plain, _] = profile_layers(model, torch.randn(64, 256), repeats=3)
    assert plain.forward_fixed_s == plain.backward_fixed_s == 0.0


def test_layer_times_are_scaled_to_the_chain_they_run_in_keeping_their_shares(monkeypatch):
    """A layer timed alone finds its data in the caches; in the chain it runs after another
    layer and is slower. On a clock that charges a layer 1 ms (forward) and 0.5 ms
    (backward) after itself and 50 % more after another layer, the layers' times sum to
    the chain's and keep their shares (the second layer costs twice the first)."""
    from types import SimpleNamespace

    import profiling.timing as timing

    clock, last = [0.0], [None]
    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=lambda: clock[0]))

    class Costed(nn.Module):
        def __init__(self, weight: float):
            super().__init__()
            self.weight, self.lin = weight, nn.Linear(16, 16)

        def charge(self, seconds: float) -> None:
            clock[0] += seconds * self.weight * (1.0 if last[0] is self else 1.5)
            last[0] = self

        def forward(self, x):
            self.charge(0.001)
            out = self.lin(x)
            if out.requires_grad:
                out.register_hook(lambda g: self.charge(0.0005))
            return out

    torch.manual_seed(0)
    layers = profile_layers(nn.Sequential(Costed(1.0), Costed(2.0)), torch.randn(8, 16), repeats=3)
    # the chain, per call: forward 1.5 + 3 ms (each layer after the other); backward 1 ms for
    # the second layer (right after its own forward) + 0.75 ms for the first (after the second)
    assert sum(layer.forward_s for layer in layers) == pytest.approx(0.0045, rel=1e-9)
    assert sum(layer.backward_s for layer in layers) == pytest.approx(0.00175, rel=1e-9)
    assert layers[1].forward_s == pytest.approx(2 * layers[0].forward_s, rel=1e-9)
    assert layers[1].backward_s == pytest.approx(2 * layers[0].backward_s, rel=1e-9)
    alone = profile_layers(nn.Sequential(Costed(1.0), Costed(2.0)), torch.randn(8, 16), repeats=3,
                           calibrate=False)
    assert [layer.forward_s for layer in alone] == pytest.approx([0.001, 0.002], rel=1e-9)


def test_thread_handoff_probe_measures_the_notice_delay_and_leaves_no_keys(tmp_path, monkeypatch):
    """On a clock the test moves: a reader already waiting sees each put a known delay after
    the writer finished it (1, 2, ... 12 ms); the probe reports their mean exactly."""
    import threading
    from types import SimpleNamespace

    import profiling.store_probe as store_probe
    from profiling.store_probe import measure_handoff

    notices = [0.001 * (i + 1) for i in range(12)]
    clock = SimpleNamespace(now=100.0)
    written, recorded = threading.Event(), threading.Event()

    def perf_counter() -> float:
        if threading.current_thread() is not threading.main_thread():
            recorded.set()  # the writer has taken the time its put finished
        return clock.now

    def sleep(seconds: float) -> None:
        clock.now += seconds

    class NoticingStore:  # a reader in `get` notices a put `notices[i]` after it finished
        poll_max_s = 0.05

        def __init__(self):
            self.keys, self.waits = {}, iter(notices)

        def put(self, key, data, scratch=False):
            self.keys[key] = data
            written.set()

        def get(self, key, timeout=None):
            assert written.wait(10) and recorded.wait(10)
            written.clear(), recorded.clear()
            clock.now += next(self.waits)
            return self.keys[key]

        def delete_prefix(self, prefix):
            doomed = [k for k in self.keys if k.startswith(prefix)]
            for k in doomed:
                del self.keys[k]
            return len(doomed)

    monkeypatch.setattr(store_probe, "time", SimpleNamespace(perf_counter=perf_counter, sleep=sleep))
    fake = NoticingStore()
    assert measure_handoff(fake, "runs/h/probe", repeats=12) == pytest.approx(sum(notices) / 12)
    assert fake.keys == {}
    monkeypatch.undo()
    store = open_store(str(tmp_path))  # a real store: the probe's keys are gone afterwards
    measure_handoff(store, "runs/h/probe", repeats=3)
    assert store.list("runs/") == []
