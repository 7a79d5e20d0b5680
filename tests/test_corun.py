"""The co-run probe: a worker's step timed alone and beside a second worker process."""
from __future__ import annotations

import os

import pytest

from training.corun import CoRun, measure_corun


def _probe_children() -> list[int]:
    """Pids of this process's live children running the probe (to check for leaks only)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == os.getpid() and b"training.corun" in cmd:
            found.append(int(pid))
    return found


def test_factor_is_the_together_over_alone_ratio_and_never_below_one():
    assert CoRun(2, 0.010, 0.012).factor == pytest.approx(1.2)
    assert CoRun(2, 0.010, 0.009).factor == 1.0  # faster together is noise, not a speed-up
    assert CoRun(2, 0.010, 0.012).to_dict()["factor"] == pytest.approx(1.2)


def test_transfer_extra_is_half_the_trips_difference_and_never_negative():
    assert CoRun(2, 0.01, 0.01, 0.0005, 0.0013).transfer_extra_s == pytest.approx(0.0004)
    assert CoRun(2, 0.01, 0.01, 0.0013, 0.0005).transfer_extra_s == 0.0
    assert CoRun(2, 0.01, 0.01).transfer_extra_s == 0.0  # not measured


def test_two_real_worker_processes_time_the_models_step_and_leave_nothing_behind():
    got = measure_corun("digits_mlp", (64,), 10, 32, min_seconds=0.1, rounds=2)
    assert got.processes == 2
    assert 0 < got.alone_s < 0.5 and 0 < got.together_s < 0.5
    assert got.factor >= 1.0
    assert (got.transfer_tight_s, got.transfer_busy_s, got.transfer_extra_s) == (None, None, 0.0)
    assert _probe_children() == []


def test_transfer_trips_are_timed_back_to_back_and_under_load_and_leave_no_files():
    import tempfile
    from pathlib import Path

    before = set(Path(tempfile.gettempdir()).glob("zooid-corun-*"))
    got = measure_corun("digits_mlp", (64,), 10, 32, min_seconds=0.1, rounds=1, transfer_bytes=64 << 10)
    # a 64 KiB trip (put with fsync, get, delete, decode) takes tens of microseconds at least
    assert 1e-5 < got.transfer_tight_s < 0.5 and 1e-5 < got.transfer_busy_s < 0.5
    assert got.transfer_extra_s == pytest.approx(max(0.0, got.transfer_busy_s - got.transfer_tight_s) / 2)
    assert set(Path(tempfile.gettempdir()).glob("zooid-corun-*")) == before
    assert _probe_children() == []


def test_a_probe_process_that_fails_gives_a_clear_error_and_is_not_left_running():
    with pytest.raises(RuntimeError, match="co-run probe process failed.*no_such_model"):
        measure_corun("no_such_model", (64,), 10, 32, min_seconds=0.1)
    assert _probe_children() == []


@pytest.mark.parametrize("kwargs, name", [({"processes": 1}, "processes"), ({"batch_size": 0}, "batch_size")])
def test_bad_arguments_name_the_parameter(kwargs, name):
    args = {"model": "digits_mlp", "input_shape": (64,), "classes": 10, "batch_size": 32, **kwargs}
    with pytest.raises(ValueError, match=f"^{name}:"):
        measure_corun(args.pop("model"), args.pop("input_shape"), args.pop("classes"), args.pop("batch_size"),
                      **args)


def test_a_probe_that_does_not_answer_in_time_is_stopped():
    import time

    began = time.monotonic()
    with pytest.raises(RuntimeError, match="co-run probe process failed.*no answer"):
        measure_corun("digits_mlp", (64,), 10, 32, timeout_s=0.2)  # not even ready by then
    assert time.monotonic() - began < 10
    assert _probe_children() == []
