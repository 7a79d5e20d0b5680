"""Repeats, medians, value formats and markdown tables, as every results file shows them, and
results files kept in parts (one section per part, a run rewriting only the parts it ran)."""
from __future__ import annotations

import re
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from benchmarks.output import code_state


def rounds(ops: dict[str, Callable[[], object]], repeats: int, *, warm_up: bool = False,
           clock: Callable[[], float] = time.perf_counter, alternate: bool = False) -> dict[str, list[float]]:
    """Each op's seconds by `clock` over `repeats` rounds, after one unclocked round when
    `warm_up`. The ops run round-robin, one call of each a round, rather than one block each, so
    a burst of load from other processes on the machine hits them alike. With `alternate`, every
    other round runs them in reverse order (A B, B A, A B, ...), so a load that rises or falls
    over a round favours none of them."""
    if warm_up:
        for fn in ops.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in ops}
    for i in range(repeats):
        order = list(ops.items())
        for name, fn in (order[::-1] if alternate and i % 2 else order):
            start = clock()
            fn()
            times[name].append(clock() - start)
    return times


def median(values: Iterable, default=None):
    """The median of `values`, None among them left out; `default` when none is left."""
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else default


def fmt(value, spec: str = "{:.2f}", none: str = "-") -> str:
    """`value` formatted with `spec`, or `none` when it is None."""
    return none if value is None else spec.format(value)


def pct(value, none: str = "-", signed: bool = False) -> str:
    """A fraction as a percentage with one decimal (`12.3 %`; `signed`: `+12.3 %`), or `none`
    when it is None."""
    return fmt(None if value is None else 100 * value, "{:+.1f} %" if signed else "{:.1f} %", none)


def row(cells: Iterable) -> str:
    """One markdown table row of `cells` (each shown with `str`)."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


def table(columns: Sequence[str], rows: Iterable[Iterable] = ()) -> list[str]:
    """A markdown table's lines: the head of `columns`, its rule, then each of `rows`."""
    return [row(columns), "|" + "---|" * len(columns), *(row(r) for r in rows)]


# --- a results file in parts ----------------------------------------------------------------

_SECTION = re.compile(r"^## ([a-z])\. ", re.MULTILINE)


def sections(text: str) -> dict[str, str]:
    """The part sections of a results file's text, by letter (each from its `## x. ` line to the
    next part's, stripped)."""
    marks = list(_SECTION.finditer(text))
    return {m.group(1): text[m.start():(marks[i + 1].start() if i + 1 < len(marks) else len(text))].strip()
            for i, m in enumerate(marks)}


def merged_body(path: Path, new: dict[str, str]) -> str:
    """The body to write to `path`: the parts in `new` replaced, the file's other parts kept, in
    letter order."""
    old = sections(path.read_text()) if path.exists() else {}
    kept = {**old, **{part: body.strip() for part, body in new.items()}}
    return "\n\n".join(kept[part] for part in sorted(kept))


def run_line(command: str, where: str = "") -> str:
    """A part's own first line: its command, the commit checked out and when it ran (the file's
    header names only the last run's)."""
    state = code_state()
    dirty = f", {len(state.dirty)} source file(s) uncommitted" if state.dirty else ""
    return (f"Run: `{command}`{(' on ' + where) if where else ''}, at `{state.head[:12]}`{dirty}, "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.")
