"""The project's own modules as parsed trees, for the tests that read the source (one of each,
one key layout)."""
from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@lru_cache(maxsize=None)
def sources() -> dict[str, ast.Module]:
    """Every project module outside tests/ and benchmarks/, by path relative to the root."""
    out = {}
    for folder in sorted(ROOT.iterdir()):
        if not (folder / "__init__.py").exists() or folder.name in ("tests", "benchmarks"):
            continue
        for path in sorted(folder.rglob("*.py")):
            if "__pycache__" not in path.parts:
                rel = str(path.relative_to(ROOT))
                out[rel] = ast.parse(path.read_text(), filename=rel)
    return out
