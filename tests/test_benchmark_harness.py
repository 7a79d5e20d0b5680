"""benchmarks/ on one harness (`benchmarks/harness/`): the scripts share its scaffolding instead
of copying it or importing each other.

Read from the source with `ast` (no benchmark runs): no module under benchmarks/ imports a
`bench_*` script, makes a temporary folder outside the harness, defines a median of its own or
spells a store key; and the harness's pieces behave: the train command's parameters read back
as the job's fields, the temporary home is restored and removed, medians and tables.
"""
from __future__ import annotations

import ast
import os
from pathlib import Path

from benchmarks.harness.home import scratch
from benchmarks.harness.tables import fmt, median, merged_body, pct, rounds, row, table
from benchmarks.harness.train import digits_job, param_args, train_command
from coordinator.run.job_fields import fields_from_args

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
HARNESS = BENCH / "harness"


def modules() -> dict[str, ast.Module]:
    """Every module under benchmarks/, by path relative to the root."""
    return {str(p.relative_to(ROOT)): ast.parse(p.read_text(), filename=str(p))
            for p in sorted(BENCH.rglob("*.py")) if "__pycache__" not in p.parts}


def imported(tree: ast.Module) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def test_no_module_imports_a_script():
    bad = [f"{rel}: {name}" for rel, tree in modules().items() for name in sorted(imported(tree))
           if name.startswith("benchmarks.bench_") or name.startswith("benchmarks.run_all")]
    assert not bad, "move what two scripts share into benchmarks/harness/:\n" + "\n".join(bad)


def test_a_script_part_belongs_to_one_script():
    """A module under benchmarks/ that is neither a script, the harness nor the header is a part of
    at most one script."""
    scripts = {rel: tree for rel, tree in modules().items() if Path(rel).name.startswith("bench_")}
    shared = ("benchmarks/harness/", "benchmarks/output.py", "benchmarks/run_all.py")
    parts = [rel for rel in modules() if not Path(rel).name.startswith(("bench_", "__init__"))
             and not rel.startswith(shared)]
    for rel in parts:
        name = rel.removesuffix(".py").replace("/", ".")
        users = [script for script, tree in scripts.items()
                 if any(i == name or i.startswith(name + ".") for i in imported(tree))]
        assert len(users) <= 1, f"{rel} is imported by {users}: move it into benchmarks/harness/"


def test_the_harness_imports_no_script_part():
    bad = [f"{rel}: {name}" for rel, tree in modules().items() if rel.startswith("benchmarks/harness/")
           for name in sorted(imported(tree)) if name.startswith("benchmarks.")
           and not name.startswith(("benchmarks.harness", "benchmarks.output"))]
    assert not bad, bad


def test_scaffolding_lives_in_the_harness_only():
    outside = {rel: tree for rel, tree in modules().items() if not rel.startswith("benchmarks/harness/")}
    temp = [f"{rel}:{n.lineno}" for rel, tree in outside.items() for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and n.attr in ("mkdtemp", "TemporaryDirectory")]
    assert not temp, f"use benchmarks.harness.home.scratch: {temp}"
    medians = [f"{rel}:{n.name}" for rel, tree in modules().items() for n in ast.walk(tree)
               if isinstance(n, ast.FunctionDef) and n.name.lstrip("_") in ("median", "med")]
    assert medians == ["benchmarks/harness/tables.py:median"]
    stats = [f"{rel}:{n.lineno}" for rel, tree in outside.items() for n in ast.walk(tree)
             if isinstance(n, ast.Attribute) and n.attr == "median"]
    assert not stats, f"use benchmarks.harness.tables.median: {stats}"


def test_no_benchmark_spells_a_store_key():
    spelt = [f"{rel}:{n.lineno} {n.value!r}" for rel, tree in modules().items() for n in ast.walk(tree)
             if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.startswith("runs/")]
    joined = [f"{rel}:{n.lineno}" for rel, tree in modules().items() for n in ast.walk(tree)
              if isinstance(n, ast.JoinedStr) and n.values and isinstance(n.values[0], ast.Constant)
              and str(n.values[0].value).startswith("runs/")]
    assert not spelt and not joined, f"build keys with core.keys: {spelt + joined}"


def test_the_train_command_parameters_read_back_as_the_job_fields(tmp_path):
    params = digits_job(2, 3, True, store=f"file://{tmp_path}/store", target_accuracy=0.9, resume=None,
                        stage_memory_gb=[1.5, 2])
    args = param_args(params)
    assert args[:2] == ["--param", "model=digits_mlp"] and len(args) == 2 * len(params)
    assert fields_from_args(args[1::2]) == params
    command = train_command(params, tmp_path / "s.json")
    assert command[1:3] == ["-m", "flows.train"] and command[-2:] == ["--summary-out", str(tmp_path / "s.json")]


def test_scratch_restores_the_environment_and_removes_the_folder(monkeypatch):
    monkeypatch.setenv("ZOOID_HOME", "/before")
    with scratch("t", home=True) as home:
        assert home.is_dir() and home.name.startswith("zooid-bench-t-")
        assert os.environ["ZOOID_HOME"] == str(home) and os.environ["PREFECT_HOME"] == str(home / "prefect")
        os.environ["SET_INSIDE"] = "1"
    assert not home.exists() and os.environ["ZOOID_HOME"] == "/before" and "SET_INSIDE" not in os.environ
    with scratch("t", keep=lambda: True) as kept:
        pass
    assert kept.is_dir()
    kept.rmdir()


def test_scratch_keeps_a_given_folder(tmp_path):
    folder = tmp_path / "mine"
    with scratch("t", folder=folder) as got:
        assert got == folder and folder.is_dir()
    assert folder.is_dir()


def test_medians_formats_and_tables():
    assert median([3, None, 1, 2]) == 2 and median([]) is None and median([None], 0.0) == 0.0
    assert fmt(None) == "-" and fmt(1.234) == "1.23" and fmt(3, "{}") == "3"
    assert pct(0.1234) == "12.3 %" and pct(None) == "-"
    assert table(["a", "b"], [[1, "x"]]) == ["| a | b |", "|---|---|", "| 1 | x |"]
    assert row(["only"]) == "| only |"


def test_rounds_run_the_ops_round_robin_after_a_warm_up():
    calls = []
    ticks = iter(range(100))
    times = rounds({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, 2, warm_up=True,
                   clock=lambda: next(ticks))
    assert calls == ["a", "b"] * 3
    assert times == {"a": [1, 1], "b": [1, 1]}
    assert rounds({"a": lambda: None}, 3, clock=lambda: 0.0) == {"a": [0.0, 0.0, 0.0]}


def test_alternate_rounds_reverse_every_other_round():
    calls = []
    rounds({name: (lambda n=name: calls.append(n)) for name in "abc"}, 3, alternate=True)
    assert calls == list("abc" "cba" "abc")


def test_merged_body_keeps_the_parts_not_rerun(tmp_path):
    path = tmp_path / "r.md"
    path.write_text("# T\n\n## a. A\n\nold a\n\n## b. B\n\nold b\n")
    assert merged_body(path, {"a": "## a. A\n\nnew a\n"}) == "## a. A\n\nnew a\n\n## b. B\n\nold b"
