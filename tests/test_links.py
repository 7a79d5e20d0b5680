"""The link side of a profile: a worker's put and get costs, and the store collective timed
among real worker processes, with the fits the planners read."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from planners.sync_time import scatter_reduce
from training.links import (fit_endpoints, fit_scatter_reduce, profile_transfers, replica_tensors,
                            time_steps_between_checkpoints, time_store_collective, transfer_sizes)
from training.profiler import profile_layers
from training.store import open_store


def test_relative_fit_recovers_latency_and_bandwidth_exactly():
    bw, lat = 250e6, 2e-3
    samples = [(s, lat + s / bw) for s in (1 << 10, 1 << 16, 1 << 20, 1 << 24) for _ in range(3)]
    got_bw, got_lat = fit_endpoints(samples + [(1 << 10, 1.0)])  # one outlier: the median ignores it
    assert got_bw == pytest.approx(bw, rel=1e-9) and got_lat == pytest.approx(lat, rel=1e-9)


def test_scatter_reduce_fit_inverts_the_model():
    bw, lat = 400e6, 5e-3
    samples = [(s, n, scatter_reduce(s, n, bw, lat)) for s in (4e6, 32e6) for n in (2, 4)]
    got_bw, got_lat = fit_scatter_reduce(samples)
    assert got_bw == pytest.approx(bw, rel=1e-9) and got_lat == pytest.approx(lat, rel=1e-9)


def test_probe_sizes_reach_the_largest_tensor_within_bounds():
    assert transfer_sizes(0)[-1] == 4 << 20 and transfer_sizes(0)[0] == 1 << 10
    assert transfer_sizes(37e6)[-1] == int(37e6)
    assert transfer_sizes(1e12)[-1] == 64 << 20


def test_put_and_get_fits_recover_emulated_links_per_direction(tmp_path):
    up, down = 30e6, 60e6
    store = open_store(str(tmp_path), upload_bytes_per_s=up, download_bytes_per_s=down)
    t = profile_transfers(store, "runs/t/probe", max_bytes=2 << 20, repeats=2)
    assert abs(t.put_bandwidth - up) / up < 0.3
    assert abs(t.get_bandwidth - down) / down < 0.3
    assert 0 < t.put_latency_s < 0.05 and 0 < t.get_latency_s < 0.05 and t.handoff_s >= 0
    assert store.list("runs/") == []


def test_store_collective_timed_among_two_processes_on_the_models_replica_state(tmp_path):
    url = tmp_path.as_uri()
    state = replica_tensors("digits_cnn", {}, "momentum")
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    assert any(k.startswith("optim/") for k in state)  # the moments travel with the weights
    timing = time_store_collective(url, "runs/c/probe", model="digits_cnn", optimizer="momentum",
                                   worlds=(2,), repeats=2,
                                   step={"input_shape": [64], "classes": 10, "batch_size": 16})
    assert [(s, n) for s, n, _ in timing.samples] == [(nbytes // 32 * 4, 2), (nbytes, 2)]
    assert all(0 < sec < 10 for _, _, sec in timing.samples)
    # the directory store polls every 2 ms: a waiting process hears of a key ~1 ms late
    assert 0.0002 < timing.handoff_s < 0.004
    assert 0 < timing.synced_step_s < 1  # a digits_cnn step after each full-size sync
    assert open_store(url).list("runs/") == []  # barrier and round keys are gone
    with pytest.raises(ValueError, match="nbytes"):
        time_store_collective(url, "runs/c/probe")


def test_steps_between_checkpoint_writes_are_timed_and_leave_no_trace(tmp_path):
    from training.models import build_model
    from training.optimizers import build_optimizer

    store = open_store(str(tmp_path))
    net = build_model("digits_mlp", 0)
    opt = build_optimizer("adam", net, 0.01)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    step_s, write_s = time_steps_between_checkpoints(store, "runs/k/probe", net, opt, x, y, repeats=2)
    assert 0 < step_s < 5 and 0 < write_s < 5
    assert store.list("runs/") == []
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())  # weights restored
    assert opt.state_dict()["state"] == {}  # and the optimizer as it was


class _FixedCost(nn.Module):
    """A layer whose forward costs a fixed wait (a sleep: no CPU to be preempted from)
    plus real per-row work."""

    def __init__(self, fixed_s: float):
        super().__init__()
        self.fixed_s, self.lin = fixed_s, nn.Linear(256, 256)

    def forward(self, x):
        import time

        time.sleep(self.fixed_s)
        return self.lin(x)


def test_layer_times_split_into_per_call_and_per_row_parts():
    torch.manual_seed(0)
    model = nn.Sequential(_FixedCost(0.004), nn.ReLU())
    [first, _] = profile_layers(model, torch.randn(64, 256), repeats=5, fit_rows=8)
    assert first.forward_fixed_s == pytest.approx(0.004, abs=0.0015)
    [plain, _] = profile_layers(model, torch.randn(64, 256), repeats=3)
    assert plain.forward_fixed_s == plain.backward_fixed_s == 0.0


def test_handoff_is_the_mean_notice_delay_less_a_present_fetch():
    from training.links import _handoff_from_ping_pong

    # rank 1 reads rounds 0 and 2 (written by rank 0), rank 0 reads round 1
    rank0 = {"put_end": {"0": 10.0, "2": 30.0}, "seen": {"1": 20.003}, "present": [0.0005, 0.0005]}
    rank1 = {"put_end": {"1": 20.0}, "seen": {"0": 10.002, "2": 30.0015}, "present": [0.0004]}
    delays = (0.002 + 0.0015 + 0.003) / 3
    assert _handoff_from_ping_pong([rank0, rank1]) == pytest.approx(delays - 0.0005)
    rank1["seen"] = {"0": 10.0001, "2": 30.0001}
    rank0["seen"] = {"1": 20.0001}
    assert _handoff_from_ping_pong([rank0, rank1]) == 0.0  # never negative


def test_thread_handoff_probe_sees_about_half_a_poll_interval(tmp_path):
    from training.links import measure_handoff

    store = open_store(str(tmp_path))
    assert 0.0002 < measure_handoff(store, "runs/h/probe") < 0.004  # polls every 2 ms
    assert store.list("runs/") == []


def _running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie waiting to be reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return False


def test_a_probe_rank_in_its_own_session_exits_when_its_parent_dies():
    import os
    import signal
    import subprocess
    import sys
    import time

    from training.subprocess_env import one_thread_env

    rank = ("import os, time; from training.subprocess_env import exit_when_orphaned; "
            "exit_when_orphaned(os.getppid(), 0.1); time.sleep(60)")
    parent = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time\n"
         f"child = subprocess.Popen([sys.executable, '-c', {rank!r}], start_new_session=True)\n"
         "print(child.pid, flush=True)\ntime.sleep(60)\n"],
        stdout=subprocess.PIPE, text=True, env=one_thread_env(), start_new_session=True)
    child = int(parent.stdout.readline())
    try:
        time.sleep(1.0)
        assert _running(child)  # its parent lives: it stays
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 10
        while _running(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _running(child)
    finally:
        if _running(child):
            os.kill(child, signal.SIGKILL)
