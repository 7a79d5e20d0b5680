"""Where a benchmark's markdown goes: `benchmarks/results/<name>.md` (or `--out`), which
`python -m benchmarks.run_all --assemble-only` gathers into BENCHMARKS.md."""
from __future__ import annotations

from pathlib import Path


def write_result(path: str | Path, text: str, *, echo: bool = False) -> None:
    """Write `text` to `path`, creating its folder; with `echo`, print it too."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    if echo:
        print(text)
