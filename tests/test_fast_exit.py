"""A command's process ends without the interpreter's teardown (`core.fast_exit`), but as
`sys.exit` would for everything the program can see: its status, its non-daemon threads
finished (an idle thread pool's told to stop first, as the interpreter does), its `atexit`
handlers run, its buffered output written. The subprocess's timeout guards a hang."""
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PROGRAM = textwrap.dedent('''
    import atexit, sys, threading
    from concurrent.futures import ThreadPoolExecutor
    from core.fast_exit import exit_now

    out = sys.argv[1]
    release = threading.Event()

    def late_writer():
        release.wait()
        with open(out + ".thread", "w") as fh:
            fh.write("thread done")

    threading.Thread(target=late_writer).start()  # not a daemon: the end waits for it
    pool = ThreadPoolExecutor(1)  # kept: an idle pool whose worker is told to stop only at the end
    pool.submit(int).result()
    atexit.register(lambda: open(out + ".atexit", "w").write("atexit ran"))
    sys.stdout.write("buffered, no newline")
    release.set()
    exit_now(3)
''')


def test_exit_now_keeps_the_status_threads_handlers_and_output(tmp_path):
    out = tmp_path / "marker"
    proc = subprocess.run([sys.executable, "-c", PROGRAM, str(out)], capture_output=True, text=True,
                          cwd=REPO, timeout=60)
    assert proc.returncode == 3
    assert proc.stdout == "buffered, no newline"
    assert (tmp_path / "marker.thread").read_text() == "thread done"
    assert (tmp_path / "marker.atexit").read_text() == "atexit ran"
