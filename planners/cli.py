"""`python -m planners COMMAND FILE`: JSON in (FILE or `-` for standard input), JSON out.

Exit status 0 with the answer on standard output (including `{"feasible": false, ...}`),
2 with a one-line message naming the field on standard error for invalid input: an
unknown command, a missing or unreadable file, text that is not JSON, or a document the
planner refuses.
"""
from __future__ import annotations

import json
import math
import sys
from typing import Callable, Sequence, TextIO

from core.errors import PlannerInputError
from planners.co_optimize import co_optimize
from planners.hybrid import hybrid
from planners.partition import partition
from planners.sync_time import sync_time
from planners.worker_count import provision

USAGE = "usage: python -m planners partition|hybrid|co-optimize|provision|sync-time FILE"

COMMANDS: dict[str, Callable[[dict], dict]] = {
    "partition": partition, "hybrid": hybrid, "co-optimize": co_optimize,
    "provision": provision, "sync-time": sync_time}


def _refuse_constant(name: str):
    # NaN and Infinity are not JSON; Python's parser accepts them unless told otherwise
    raise ValueError(f"{name} is not a JSON number")


def read_document(path: str, stdin: TextIO) -> dict:
    """The JSON object in `path` (or standard input for `-`)."""
    try:
        text = stdin.read() if path == "-" else open(path, encoding="utf-8").read()
    except OSError as exc:
        raise PlannerInputError("FILE", f"cannot read {path!r}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise PlannerInputError("FILE", f"{path!r} is not UTF-8 text") from None
    try:
        doc = json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as exc:
        raise PlannerInputError("input", f"invalid JSON at line {exc.lineno} column {exc.colno}: "
                                         f"{exc.msg}") from None
    except ValueError as exc:
        raise PlannerInputError("input", f"invalid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise PlannerInputError("input", "must be a JSON object")
    return doc


def run(argv: Sequence[str], stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout,
        stderr: TextIO = sys.stderr) -> int:
    """Run one command; returns the exit status."""
    try:
        if len(argv) != 2:
            raise PlannerInputError("command", f"expected COMMAND FILE. {USAGE}")
        command, path = argv
        if command not in COMMANDS:
            raise PlannerInputError("command", f"unknown command {command!r}; valid: "
                                               f"{', '.join(COMMANDS)}")
        answer = COMMANDS[command](read_document(path, stdin))
    except ValueError as exc:  # PlannerInputError and any other refusal of the input
        stderr.write(_one_line(str(exc)) + "\n")
        return 2
    stdout.write(json.dumps(_finite(answer), indent=2) + "\n")
    return 0


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _finite(value):
    """JSON has no Infinity: infinite numbers (e.g. a Pareto delta) become the string
    "inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return "inf" if value > 0 else ("-inf" if value < 0 else "nan")
    if isinstance(value, dict):
        return {k: _finite(x) for k, x in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(x) for x in value]
    return value


def main() -> None:
    """Entry point for `python -m planners`."""
    sys.exit(run(sys.argv[1:]))
