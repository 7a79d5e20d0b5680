"""The temporary folder a benchmark works in, and the repository it runs from."""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
"""The repository root: workers, the train command and the stack run from here."""


@contextmanager
def scratch(name: str, *, keep: bool | Callable[[], bool] = False, home: bool = False,
            folder: Path | None = None) -> Iterator[Path]:
    """A new temporary folder `zooid-bench-<name>-*` for the block (or `folder`, created where
    missing and never removed). With `home`, it is this process's Zooid home for the block:
    `ZOOID_HOME` is the folder, `PREFECT_HOME` its `prefect/`, Prefect's analytics off. Either
    way `os.environ` is restored when the block ends, and the folder removed, however the block
    ends, unless `keep` (or `keep()`, asked then) is true: then its path is printed."""
    path = Path(folder) if folder is not None else Path(tempfile.mkdtemp(prefix=f"zooid-bench-{name}-"))
    path.mkdir(parents=True, exist_ok=True)
    saved = dict(os.environ)
    if home:
        os.environ.update(ZOOID_HOME=str(path), PREFECT_HOME=str(path / "prefect"), DO_NOT_TRACK="1",
                          PREFECT_SERVER_ANALYTICS_ENABLED="false")
    try:
        yield path
    finally:
        os.environ.clear()
        os.environ.update(saved)
        if folder is None and not (keep() if callable(keep) else keep):
            shutil.rmtree(path, ignore_errors=True)
        else:
            print(f"scratch kept in {path}", flush=True)
