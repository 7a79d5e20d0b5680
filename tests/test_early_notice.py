"""A notice before the worker's own handler is in place (`core.early_notice`): the `.pth` file a
worker image runs makes the interpreter record SIGTERM instead of dying, only where `ENV` is set
and not in the processes it starts; `engine.preemption` takes the recorded notice where the worker
begins to act on notices: a warm spot worker works through it, an epoch hands over at its first
step boundary, a worker with no working time leaves at once with status 6. Real processes, real
signals; every wait is for a line on a pipe or a process's exit."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from core import early_notice

ROOT = Path(__file__).resolve().parent.parent


def _noticed_while_starting(site: Path, body: str, env_set: bool = True) -> subprocess.Popen:
    """A Python process that processes `site` as the image's interpreter processes its
    site-packages (the `.pth` there runs), says `ready`, gets SIGTERM, then runs `body` once it
    reads `go` (the signal was handled by then: it came while the read waited)."""
    env = {k: v for k, v in os.environ.items() if k != early_notice.ENV}
    if env_set:
        env[early_notice.ENV] = "1"
    script = textwrap.dedent("""
        import site, sys
        site.addsitedir(sys.argv[1])
        print("ready", flush=True)
        sys.stdin.readline()
    """) + textwrap.dedent(body)
    proc = subprocess.Popen([sys.executable, "-c", script, str(site)], cwd=ROOT, env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    proc.stdin.write("go\n")
    proc.stdin.flush()
    return proc


def _site(tmp_path: Path) -> Path:
    site = tmp_path / "site"
    site.mkdir()
    assert Path(early_notice.write_pth(str(site))).name == early_notice.PTH_NAME
    return site


def test_a_notice_while_it_starts_is_recorded_and_a_spot_worker_works_through_it(tmp_path):
    proc = _noticed_while_starting(_site(tmp_path), """
        import os, subprocess, time
        from core import early_notice
        from engine import preemption
        print("env", early_notice.ENV in os.environ, flush=True)
        child = subprocess.run([sys.executable, "-c", "import signal, site, sys; site.addsitedir(sys.argv[1]); "
                                "print(signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)", sys.argv[1]],
                               capture_output=True, text=True)
        print("child", child.stdout.strip(), flush=True)
        with preemption.overlapping(90.0, lambda: False):
            print("noticed", preemption.noticed_at() > 0, preemption.due(), flush=True)
        print("taken", early_notice.take(), flush=True)
    """)
    out = proc.communicate(timeout=120)[0].splitlines()
    assert proc.returncode == 0, out
    # the worker's own environment no longer names it, so the processes it starts die on SIGTERM
    assert out[0] == "env False" and out[1] == "child True"
    # working through: noticed, not yet due (not released, its working time not spent); taken once
    assert out[2] == "noticed True False" and out[3] == "taken 0.0"


def test_a_notice_while_it_starts_makes_the_epoch_hand_over_at_its_first_step(tmp_path):
    proc = _noticed_while_starting(_site(tmp_path), """
        from engine import preemption
        with preemption.listening():
            print("due", preemption.requested(), preemption.due(), flush=True)
        with preemption.listening():  # the next epoch: the notice was that one's
            print("next", preemption.requested(), flush=True)
    """)
    out = proc.communicate(timeout=120)[0].splitlines()
    assert proc.returncode == 0 and out == ["due True True", "next False"], out


def test_a_notice_while_it_starts_with_no_working_time_leaves_at_once_with_6(tmp_path):
    proc = _noticed_while_starting(_site(tmp_path), """
        from engine import preemption
        def hook():
            print("marked", flush=True)
        with preemption.leaving(hook), preemption.overlapping(0.0, lambda: False):
            print("never", flush=True)
    """)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 6 and "marked" in out and "never" not in out, out


def test_without_the_environment_the_pth_installs_nothing_and_sigterm_ends_the_process(tmp_path):
    proc = _noticed_while_starting(_site(tmp_path), 'print("alive", flush=True)\n', env_set=False)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == -signal.SIGTERM and "alive" not in out
