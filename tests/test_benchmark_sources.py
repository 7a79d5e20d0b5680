"""Every benchmark declares the sources it measures, and `run_all --stale` names the results files
whose sources changed since the commit they were measured at (`benchmarks.staleness`).

The declarations are read with `ast` (no benchmark is imported or run); staleness is checked in a
small git repository made here, and `run_all` is driven with its subprocess replaced.
"""
from __future__ import annotations

import ast
import subprocess
from fnmatch import fnmatch
from functools import cache
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks import run_all
from benchmarks.output import HOST_SOURCE, IMAGE_RECIPE, SOURCE
from benchmarks.staleness import code_commit, declared_sources, staleness

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("bench_*.py")))
def test_every_benchmark_declares_the_sources_it_measures(script):
    sources = declared_sources((BENCH / script).read_text())
    assert sources, f"benchmarks/{script} declares no SOURCES (the paths whose code it measures)"
    for spec in sources:
        found = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "--", spec], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout
        assert found.strip(), f"benchmarks/{script}: SOURCES names {spec!r}, which matches no file"


NOT_MEASURED = ("benchmarks/output.py", "benchmarks/harness/home.py")
"""Modules a script imports that change no figure: the results file's header, the temporary folder."""


def _module_file(name: str) -> Path | None:
    path = ROOT.joinpath(*name.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


@cache
def _imports(path: Path) -> frozenset[str]:
    """Every module `path` imports, at any depth of its code (a lazy import counts)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return frozenset(out)


def imported_files(script: Path) -> set[str]:
    """The repository's files a script imports, transitively (each package's `__init__` too)."""
    seen: set[Path] = set()
    todo = [script]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for name in _imports(path):
            parts = name.split(".")
            todo += [f for f in (_module_file(".".join(parts[:i])) for i in range(1, len(parts) + 1)) if f]
    return {p.relative_to(ROOT).as_posix() for p in seen - {script}}


def _covered(path: str, specs: tuple[str, ...]) -> bool:
    return any(path == s or path.startswith(s.rstrip("/") + "/") or fnmatch(path, s) for s in specs)


def _docstring_only(path: str) -> bool:
    body = ast.parse((ROOT / path).read_text()).body
    return all(isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) for n in body)


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("bench_*.py")))
def test_the_declared_sources_cover_everything_the_script_imports(script):
    """What a script imports, transitively, it measures: its SOURCES cover every such file but the
    header and the temporary folder, and packages' `__init__` files that hold no code."""
    sources = declared_sources((BENCH / script).read_text())
    missing = sorted(f for f in imported_files(BENCH / script)
                     if f not in NOT_MEASURED and not _covered(f, sources) and not _docstring_only(f))
    assert not missing, f"benchmarks/{script} imports {missing}, which its SOURCES do not name"


def test_a_declaration_may_unpack_the_whole_project():
    text = 'from benchmarks.output import SOURCE\nSOURCES = (*SOURCE, "benchmarks/harness/train.py")\n'
    assert declared_sources(text) == (*SOURCE, "benchmarks/harness/train.py")
    assert declared_sources("RESULTS = 'x.md'\n") == ()
    with pytest.raises(ValueError, match="strings, \\*SOURCE and \\*HOST_SOURCE only"):
        declared_sources("SOURCES = (ROOT / 'engine',)\n")


def test_the_host_s_project_is_the_whole_project_but_the_image_recipe():
    assert declared_sources("SOURCES = (*HOST_SOURCE, 'x.py')\n") == (*HOST_SOURCE, "x.py")
    assert set(SOURCE) - set(HOST_SOURCE) == set(IMAGE_RECIPE) == {"worker_images/Dockerfile.cpu"}
    assert "deployments" in HOST_SOURCE  # deployments.images, the build, is imported by the stack: still declared


def _runs_containers(script: str) -> bool:
    """Whether a script trains on the docker target: the stack's container half (`docker=True`, a
    `--docker` flag) or the target named "docker"."""
    tree = ast.parse((BENCH / script).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "docker" and not (
                isinstance(node.value, ast.Constant) and node.value.value is False):
            return True
        if isinstance(node, ast.Constant) and node.value in ("docker", "--docker"):
            return True
    return False


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("bench_*.py")))
def test_a_benchmark_that_runs_containers_declares_the_image_recipe(script):
    """A script whose workers may be containers of the worker image measures its recipe too: only a
    script that never runs the docker target may declare `*HOST_SOURCE` and leave the recipe out."""
    sources = declared_sources((BENCH / script).read_text())
    if _runs_containers(script):
        assert all(_covered(recipe, sources) for recipe in IMAGE_RECIPE), script


@pytest.mark.parametrize("line, commit", [
    ("Code: `95a13bcec7ce`; no change to the project's source under way.", "95a13bcec7ce"),
    ("Code: `3d60ecd21f7b` at the start, `5039fa6cf997` at the end (committed during the run).", "3d60ecd21f7b"),
    ("Code: 23734c123960  ", "23734c123960"),
    ("Command: `x`", None),
])
def test_the_commit_a_results_file_names(line, commit):
    assert code_commit(f"# T\n\nCommand: `c`\n{line}\n") == commit


class Repo:
    """A git repository with a benchmark, the code it measures, and its results file."""

    SCRIPT = 'SOURCES = ("engine",)\n"""What it measures."""\n\nRESULTS = "x.md"\n\n\ndef main():\n    return 1\n'

    def __init__(self, root: Path):
        self.root = root
        self.git("init", "-q")
        self.write("engine/a.py", "A = 1\n")
        self.write("docs/x.md", "x\n")
        self.write("benchmarks/bench_x.py", self.SCRIPT)
        self.measured = self.commit("first")
        self.result = root / "results.md"
        self.result.write_text(f"# X\n\nCommand: `c`\nCode: `{self.measured[:12]}`; no change.\n")

    def git(self, *args: str) -> str:
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=self.root,
                              capture_output=True, text=True, check=True).stdout.strip()

    def write(self, name: str, text: str) -> None:
        (self.root / name).parent.mkdir(parents=True, exist_ok=True)
        (self.root / name).write_text(text)

    def commit(self, message: str) -> str:
        self.git("add", "-A")
        self.git("commit", "-q", "-m", message)
        return self.git("rev-parse", "HEAD")

    def staleness(self):
        return staleness(self.result, self.root / "benchmarks" / "bench_x.py", self.root)


def test_a_results_file_goes_stale_when_a_declared_source_changes(tmp_path):
    repo = Repo(tmp_path)
    assert not repo.staleness().stale

    repo.write("docs/x.md", "y\n")  # not a declared source
    repo.write("benchmarks/bench_x.py", Repo.SCRIPT.replace('("engine",)', '("engine", "comm")')
               .replace("def main():", "# the entry point\ndef main():"))  # its declaration and a comment
    repo.commit("docs, declaration")
    assert not repo.staleness().stale

    repo.write("engine/a.py", "A = 2\n")
    repo.commit("engine")
    found = repo.staleness()
    assert found.stale and found.changed == ("engine/a.py",)
    assert found.reason == f"1 source file(s) changed since {repo.measured[:12]}"


@pytest.mark.parametrize("declared, not_measured, measured", [
    # a benchmark whose workers are processes here: not the image's recipe, but a worker's code
    ("HOST_SOURCE", "worker_images/Dockerfile.cpu", "runtime/w.py"),
    # the whole project: the CPU recipe that deployments.images builds, not the CUDA one, which none builds
    ("SOURCE", "worker_images/Dockerfile.cuda", "worker_images/Dockerfile.cpu"),
])
def test_the_image_recipes_stale_only_the_benchmarks_that_build_them(tmp_path, declared, not_measured, measured):
    repo = Repo(tmp_path)
    repo.write(not_measured, "A = 1\n")
    repo.write(measured, "A = 1\n")
    repo.write("benchmarks/bench_x.py", Repo.SCRIPT.replace('SOURCES = ("engine",)',
                                                           f'from benchmarks.output import {declared}\n'
                                                           f'SOURCES = (*{declared},)'))
    repo.measured = repo.commit(f"{declared} declared")
    repo.result.write_text(f"# X\n\nCommand: `c`\nCode: `{repo.measured[:12]}`; no change.\n")

    repo.write(not_measured, "A = 2\n")
    repo.commit("what it does not measure")
    assert not repo.staleness().stale

    repo.write(measured, "A = 2\n")
    repo.commit("what it measures")
    assert repo.staleness().changed == (measured,)


def test_a_change_to_the_script_itself_makes_it_stale(tmp_path):
    repo = Repo(tmp_path)
    repo.write("benchmarks/bench_x.py", Repo.SCRIPT.replace("return 1", "return 2"))
    repo.commit("measure otherwise")

    assert repo.staleness().changed == ("benchmarks/bench_x.py",)


def test_a_results_file_without_a_known_commit_is_stale(tmp_path):
    repo = Repo(tmp_path)
    repo.result.write_text("# X\n\nCommand: `c`\n")
    assert repo.staleness().reason == "its header names no Code: commit"
    repo.result.write_text("# X\n\nCode: `0123456789ab`\n")
    assert repo.staleness().reason == "commit 0123456789ab is not in this repository"


def _fake_sections(monkeypatch, tmp_path, stale: set[str]):
    """run_all with two sections, `stale` of them stale, its subprocess recorded and its BENCHMARKS.md in tmp."""
    sections = [run_all.Section("A", "bench_planners", "planners_partition_provision"),
                run_all.Section("B", "bench_ring", "ring")]
    monkeypatch.setattr(run_all, "SECTIONS", sections)
    monkeypatch.setattr(run_all, "ROOT", tmp_path)

    def fake_staleness(result, script, root):
        reason = "1 source file(s) changed since abc" if result.stem in stale else ""
        return run_all.Staleness(result, script, "abc", ("comm/x.py",) if reason else (), reason)

    monkeypatch.setattr(run_all, "staleness", fake_staleness)
    ran: list[list[str]] = []
    monkeypatch.setattr(run_all, "subprocess", SimpleNamespace(run=lambda cmd, **kw: ran.append(cmd[2:])))
    return ran


def test_stale_lists_and_runs_nothing(monkeypatch, tmp_path, capsys):
    ran = _fake_sections(monkeypatch, tmp_path, {"ring"})

    assert run_all.main(["--stale"]) == 0

    assert ran == [] and not (tmp_path / "BENCHMARKS.md").exists()
    assert capsys.readouterr().out.splitlines() == [
        "stale  benchmarks/results/ring.md: 1 source file(s) changed since abc (comm/x.py)",
        "1 of 2 results files stale"]


def test_only_stale_reruns_only_the_stale_results(monkeypatch, tmp_path):
    ran = _fake_sections(monkeypatch, tmp_path, {"ring"})

    assert run_all.main(["--only-stale"]) == 0

    assert ran == [["benchmarks.bench_ring"]]
    assert (tmp_path / "BENCHMARKS.md").read_text().startswith("# Zooid benchmarks")
