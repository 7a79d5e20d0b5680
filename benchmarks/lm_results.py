"""The language-model benchmark's results files hold one section per part (`## a. ...`,
`## b. ...`, `## c. ...`): a run rewrites the sections of the parts it ran and keeps the last
section of every other part from the file as it was."""
from __future__ import annotations

import re
import time
from pathlib import Path

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
    """A section's own first line: its command, the commit checked out and when it ran (the file's
    header names only the last run's)."""
    from benchmarks.output import code_state

    state = code_state()
    dirty = f", {len(state.dirty)} source file(s) uncommitted" if state.dirty else ""
    return (f"Run: `{command}`{(' on ' + where) if where else ''}, at `{state.head[:12]}`{dirty}, "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.")
