"""Every results file has a writer, and every writer goes through the shared header.

Read from the source with `ast`, without importing or running a benchmark:

- each `benchmarks/bench_*.py` names its results file in a module constant `RESULTS`, and every
  `benchmarks/results/*.md` is named by exactly one of them;
- each script writes it with `benchmarks.output.write_result(path, title, command, provenance, body)`,
  whose header names the command, the machine, the load and the commit measured; no script
  writes a header line of its own or writes to its results path by another route;
- `benchmarks/run_all.py`'s `SECTIONS` (what `make bench` runs) names every results file once,
  with an existing script, and the arguments it runs the script with are those the results file's
  `Command:` names.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
RESULTS = BENCH / "results"
HEADER_PARAMS = ["path", "title", "command", "prov", "body"]
HEADER_WORDS = ("Command:", "Machine:", "Code:")


def scripts() -> dict[str, ast.Module]:
    return {p.stem: ast.parse(p.read_text(), str(p)) for p in sorted(BENCH.glob("bench_*.py"))}


def results_names(tree: ast.Module) -> list[str]:
    """The file names in `RESULTS = ... / "<name>.md"` and in any other `<X>_RESULTS` constant
    (a script whose GPU run, taken on another machine, has a results file of its own)."""
    out = []
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and (t.id == "RESULTS" or t.id.endswith(
                "_RESULTS")) for t in node.targets):
            names = [c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant)
                     and isinstance(c.value, str) and c.value.endswith(".md")]
            out += names[-1:]
    return out


def calls(tree: ast.Module, name: str) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call)
            and (getattr(n.func, "id", None) == name or getattr(n.func, "attr", None) == name)]


def mentions_results(node: ast.AST) -> bool:
    """An expression naming `RESULTS`, `args.out` or a path under benchmarks/results."""
    for n in ast.walk(node):
        if isinstance(n, ast.Name) and n.id == "RESULTS":
            return True
        if isinstance(n, ast.Attribute) and n.attr == "out" and getattr(n.value, "id", None) == "args":
            return True
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and "results" in n.value:
            return True
    return False


def sections() -> list[dict]:
    """run_all's SECTIONS, each `Section(title, module, result, args)` read as literals."""
    tree = ast.parse((BENCH / "run_all.py").read_text())
    value = next(n.value for n in tree.body if isinstance(n, ast.Assign)
                 and any(getattr(t, "id", None) == "SECTIONS" for t in n.targets))
    out = []
    for call in value.elts:
        assert isinstance(call, ast.Call) and getattr(call.func, "id", None) == "Section", ast.dump(call)
        values = [ast.literal_eval(a) for a in call.args] + [()] * (4 - len(call.args))
        fields = dict(zip(("title", "module", "result", "args"), values))
        fields.update({k.arg: ast.literal_eval(k.value) for k in call.keywords})
        out.append(fields)
    return out


def recorded_command(path: Path) -> str | None:
    """The module and arguments the results file's command names (`benchmarks.x --flag ...`)."""
    text = path.read_text()
    found = re.search(r"Command: `([^`]*)`", text) or re.search(r"^\s+(\S*python -m benchmarks\.\S+.*)$", text, re.M)
    if not found:
        return None
    return found.group(1).split(" -m ", 1)[-1].strip()


def test_every_results_file_has_exactly_one_writer():
    writers: dict[str, list[str]] = {}
    for module, tree in scripts().items():
        names = results_names(tree)
        assert names, f"benchmarks/{module}.py declares no RESULTS = .../'<name>.md' constant"
        for name in names:
            writers.setdefault(name, []).append(module)
    for path in sorted(RESULTS.glob("*.md")):
        assert len(writers.get(path.name, [])) == 1, (
            f"{path.relative_to(ROOT)} is written by {writers.get(path.name) or 'no script'}; it needs exactly one")


@pytest.mark.parametrize("module", sorted(p.stem for p in BENCH.glob("bench_*.py")))
def test_script_writes_through_the_shared_header(module):
    tree = scripts()[module]
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "benchmarks.output"
                for a in n.names}
    assert "write_result" in imported, f"{module} does not write with benchmarks.output.write_result"
    writes = calls(tree, "write_result")
    assert writes, f"{module} never calls write_result"
    for call in writes:
        given = len(call.args) + sum(k.arg in HEADER_PARAMS for k in call.keywords)
        assert given >= len(HEADER_PARAMS), (
            f"{module}:{call.lineno} calls write_result without {', '.join(HEADER_PARAMS)}")
    assert calls(tree, "provenance"), f"{module} never captures its provenance when it starts"
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str):
            assert not n.value.lstrip().startswith(HEADER_WORDS), (
                f"{module}:{n.lineno} writes a header line of its own ({n.value[:40]!r})")
    for call in calls(tree, "write_text") + calls(tree, "write_bytes"):
        assert not mentions_results(call.func), f"{module}:{call.lineno} writes a results path directly"
    for call in calls(tree, "open"):
        mode = call.args[1] if len(call.args) > 1 else next((k.value for k in call.keywords if k.arg == "mode"), None)
        writing = isinstance(mode, ast.Constant) and any(c in str(mode.value) for c in "wax+")
        assert not (writing and call.args and mentions_results(call.args[0])), (
            f"{module}:{call.lineno} opens a results path for writing")


def test_write_result_requires_the_header():
    tree = ast.parse((BENCH / "output.py").read_text())
    func = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "write_result")
    required = [a.arg for a in func.args.args][:len(func.args.args) - len(func.args.defaults)]
    assert required == HEADER_PARAMS


def test_make_bench_regenerates_every_results_file_with_its_recorded_command():
    entries = sections()
    named = [e["result"] for e in entries]
    assert len(named) == len(set(named)), f"a results file is named twice in SECTIONS: {named}"
    on_disk = sorted(p.stem for p in RESULTS.glob("*.md"))
    assert sorted(named) == on_disk, f"SECTIONS {sorted(named)} != results files {on_disk}"
    by_module = {m: results_names(t) for m, t in scripts().items()}
    assert sorted({e["module"] for e in entries}) == sorted(by_module), "a bench script is missing from SECTIONS"
    for e in entries:
        assert (BENCH / f"{e['module']}.py").exists(), f"SECTIONS names a missing script {e['module']}"
        assert f"{e['result']}.md" in by_module[e["module"]], (
            f"{e['module']} writes {by_module[e['module']]}, SECTIONS expects {e['result']}.md")
        wanted = " ".join([f"benchmarks.{e['module']}", *e["args"]])
        assert recorded_command(BENCH / "results" / f"{e['result']}.md") == wanted, (
            f"{e['result']}.md was produced by `{recorded_command(RESULTS / (e['result'] + '.md'))}`, "
            f"make bench would run `{wanted}`")
