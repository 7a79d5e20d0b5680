"""`python -m runtime.array_cut_main --cut-json '<job>'`: write one cut of a prepare's
files-of-arrays source as a process of its own (`flows.prepare_cuts` starts it for `target=inline`,
with `--cut-json -` and the job on stdin: a cut over many files outgrows an argument's 128 KB).

The job is `flows.prepare_cuts.cut_job`'s: the cut (its shards and the source parts that hold their
rows) and the source's and destination's store references. It is written by
`engine.array_cuts.run_cut_job`; the last line on stdout is its result as JSON. A refusal or a
failure of the project's (a `ZooidError`: a store that fails, a file shorter than its header) is one
`error: ...` line on stderr and exit status 1. No Prefect here: stores are opened by URL
(`comm.store.open_store`); a job that names a store block runs through `flows.prepare_cuts` instead,
which passes the opener that loads blocks from the API.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Callable

from comm.store import Store, open_store
from core.errors import ZooidError
from engine.array_cuts import run_cut_job


def main(argv: list[str] | None = None, open_ref: Callable[[str], Store] = open_store) -> int:
    """Write the cut `--cut-json` describes; print its result as one JSON line."""
    parser = argparse.ArgumentParser(prog="python -m runtime.array_cut_main", description=__doc__.splitlines()[0])
    parser.add_argument("--cut-json", required=True, help="the job as JSON, or - to read it from stdin")
    args = parser.parse_args(argv)
    try:
        result = run_cut_job(json.loads(sys.stdin.read() if args.cut_json == "-" else args.cut_json), open_ref)
    except ZooidError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
