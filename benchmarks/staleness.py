"""Which results files are stale: their benchmark's declared sources changed since the commit
their `Code:` line names.

Each `benchmarks/bench_*.py` declares in a module constant `SOURCES` the paths whose code its
measurement runs, as git pathspecs relative to the repository root (a folder, a file, a glob):
every file it imports, transitively, but its results file's header (`benchmarks/output.py`) and
its temporary folder (`benchmarks/harness/home.py`) (`tests/test_benchmark_sources.py` checks the
cover), what it runs without importing it (a model by import path; `*SOURCE` unpacks
`benchmarks.output.SOURCE`, the whole project, for a benchmark that runs the train flow, and
`*HOST_SOURCE` the whole project but the worker image's recipe, for one whose workers never run in
a container), and `requirements.lock` for the libraries.

A results file is stale when:

- `git diff --name-only <commit> HEAD -- <SOURCES>` names a file, `<commit>` being the first
  commit its `Code:` line names (the one checked out when the benchmark started);
- or its script changed since that commit outside its `SOURCES` declaration (a change to what a
  script declares does not change what it measured; nor does a comment or the layout: the scripts
  are compared as parsed);
- or its header names no commit this repository knows.

Everything is read with `ast` and git: no benchmark is imported or run.
"""
from __future__ import annotations

import ast
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from benchmarks.output import HOST_SOURCE, SOURCE

_UNPACKED = {"SOURCE": SOURCE, "HOST_SOURCE": HOST_SOURCE}
"""What a declaration may unpack (`*NAME`), from `benchmarks.output`."""

REPO = Path(__file__).resolve().parent.parent
_CODE = re.compile(r"^Code: `?([0-9a-f]{7,40})\b", re.M)


@dataclass(frozen=True)
class Staleness:
    """One results file against its script's declared sources."""

    result: Path
    script: Path
    commit: str | None
    """The commit its `Code:` line names (None: it names none)."""
    changed: tuple[str, ...] = ()
    """Files changed since that commit among the sources (the script itself included)."""
    reason: str = ""
    """Why it is stale; empty when it is current."""

    @property
    def stale(self) -> bool:
        return bool(self.reason)


def _sources_node(tree: ast.Module) -> ast.stmt | None:
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == "SOURCES" for t in targets):
            return node
    return None


def declared_sources(script_text: str) -> tuple[str, ...]:
    """A script's `SOURCES`: a tuple or list of strings, `*SOURCE` and `*HOST_SOURCE` allowed; () when it
    declares none."""
    node = _sources_node(ast.parse(script_text))
    if node is None or node.value is None:
        return ()
    if not isinstance(node.value, (ast.Tuple, ast.List)):
        raise ValueError(f"line {node.lineno}: SOURCES must be a tuple or list of paths")
    out: list[str] = []
    for item in node.value.elts:
        if isinstance(item, ast.Constant) and isinstance(item.value, str):
            out.append(item.value)
        elif isinstance(item, ast.Starred) and getattr(item.value, "id", None) in _UNPACKED:
            out.extend(_UNPACKED[item.value.id])
        else:
            raise ValueError(f"line {item.lineno}: SOURCES holds strings, *SOURCE and *HOST_SOURCE only")
    return tuple(out)


def _measured(script_text: str) -> str:
    """The script as it runs, less its `SOURCES` declaration, that constant's docstring and the
    import of `SOURCE` or `HOST_SOURCE` it may use: an AST dump, so comments and layout do not count
    either."""
    tree = ast.parse(script_text)
    declared = _sources_node(tree)
    body: list[ast.stmt] = []
    for node in tree.body:
        after_declared = bool(body) and body[-1] is declared
        if after_declared and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) \
                and isinstance(node.value.value, str):
            continue
        if isinstance(node, ast.ImportFrom) and node.module == "benchmarks.output":
            node.names = [a for a in node.names if a.name not in _UNPACKED]
        body.append(node)
    tree.body = [node for node in body if node is not declared]
    return ast.dump(tree)


def code_commit(results_text: str) -> str | None:
    """The commit a results file's `Code:` line names first (the one its run started at)."""
    found = _CODE.search(results_text)
    return found.group(1) if found else None


def _git(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)


def staleness(result: Path, script: Path, root: Path = REPO) -> Staleness:
    """Whether `result` (a results file) is stale against `script` (its benchmark) at HEAD."""
    commit = code_commit(result.read_text())
    if commit is None:
        return Staleness(result, script, None, reason="its header names no Code: commit")
    if _git(root, "cat-file", "-e", f"{commit}^{{commit}}").returncode != 0:
        return Staleness(result, script, commit, reason=f"commit {commit} is not in this repository")
    rel = script.resolve().relative_to(root.resolve()).as_posix()
    now = _git(root, "show", f"HEAD:{rel}")
    sources = declared_sources(now.stdout if now.returncode == 0 else script.read_text())
    diff = _git(root, "diff", "--name-only", commit, "HEAD", "--", *sources) if sources else None
    if diff is not None and diff.returncode != 0:
        raise RuntimeError(f"git diff {commit} HEAD failed: {diff.stderr.strip()}")
    changed = [] if diff is None else [line for line in diff.stdout.splitlines() if line]
    then = _git(root, "show", f"{commit}:{rel}")
    if rel not in changed and (then.returncode != 0 or _measured(then.stdout) != _measured(now.stdout)):
        changed.append(rel)
    if not changed:
        return Staleness(result, script, commit)
    return Staleness(result, script, commit, tuple(changed),
                     reason=f"{len(changed)} source file(s) changed since {commit}")
