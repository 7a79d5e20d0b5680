"""A module for `tests/test_flow_forks.py` to run through the flow-run fork server: it reports
what process it became and exits as told (`exit N`), or waits for a signal (`wait`)."""
import json
import os
import signal
import sys


def main(args: list[str]) -> int:
    seen = {"pid": os.getpid(), "ppid": os.getppid(), "cwd": os.getcwd(), "argv": sys.argv,
            "value": os.environ.get("ZOOID_PROBE_VALUE"),
            "preloaded": "torch" in sys.modules and "flows.train" in sys.modules}
    print("to stderr", file=sys.stderr, flush=True)
    if args[:1] == ["wait"]:
        def stop(signum, frame):
            print(f"got signal {signum}", flush=True)
            os._exit(128 + signum)

        signal.signal(signal.SIGTERM, stop)
        print(json.dumps({**seen, "waiting": True}), flush=True)
        while True:
            signal.pause()
    print(json.dumps(seen), flush=True)
    return int(args[1]) if args[:1] == ["exit"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
