"""The layout's arrows point one way (DESIGN.md, docs/ARCHITECTURE.md).

The project's import graph is read from the source with `ast`, without importing anything:
every `import` and `from ... import` of every .py file under the project folders, at module
level and inside functions alike (a lazy import is an arrow too), with relative imports
resolved and `from x import y` taken as an import of module `x.y` when `x/y.py` (or a
package `x/y/`) exists. Calls to `importlib.import_module` are not followed.

- no import circles among the project's modules;
- each folder is one layer and imports only the layers below it (`LAYERS`);
- core/ is the standard library only; planners/ add numpy and the solvers, nothing else;
- the worker side (core, comm, engine, profiling, runtime) and planners never import Prefect;
- no import by string of the project's own modules (user models by import path excepted).
"""
from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("blocks", "deployments", "flows", "planners", "coordinator", "tasks", "core", "comm", "engine", "profiling", "runtime",
            "clouds", "benchmarks")


@dataclass(frozen=True)
class Import:
    """One import statement's target as written (dotted, relative imports resolved)."""

    source: str
    """The importing module, e.g. `tasks.run_epoch`."""
    target: str
    """The imported name, e.g. `prefect.task` or `coordinator.workers.warm_prestart`."""
    path: str
    line: int


def module_name(path: Path) -> str:
    """`tasks/run_epoch.py` -> `tasks.run_epoch`; `tasks/__init__.py` -> `tasks`."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@lru_cache(maxsize=None)
def project_files() -> dict[str, Path]:
    """Every project module (by dotted name) and its file."""
    files = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "__pycache__" not in path.parts:
                files[module_name(path)] = path
    return files


def _resolve_relative(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute module of `from <level dots><name> import ...` written in `module`."""
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        base = base[:len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


@lru_cache(maxsize=None)
def all_imports() -> tuple[Import, ...]:
    """Every import of every project module, module-level and function-level."""
    modules = project_files()
    found = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        rel = str(path.relative_to(ROOT))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found += [Import(module, alias.name, rel, node.lineno) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = _resolve_relative(module, path.name == "__init__.py", node.level, node.module)
                for alias in node.names:
                    candidate = f"{base}.{alias.name}" if base else alias.name
                    # `from x import y`: the module x.y when there is one, else a name from x
                    target = candidate if alias.name != "*" and candidate in modules else base
                    found.append(Import(module, target, rel, node.lineno))
    return tuple(found)


def _project_module(target: str) -> str | None:
    """The project module an import lands in (the longest dotted prefix that is one), or None."""
    modules = project_files()
    parts = target.split(".")
    for end in range(len(parts), 0, -1):
        name = ".".join(parts[:end])
        if name in modules:
            return name
    return None


def import_graph() -> dict[str, dict[str, list[Import]]]:
    """module -> imported project module -> the imports that make that arrow."""
    graph: dict[str, dict[str, list[Import]]] = {m: {} for m in project_files()}
    for imp in all_imports():
        dest = _project_module(imp.target)
        if dest is not None and dest != imp.source:
            graph[imp.source].setdefault(dest, []).append(imp)
    return graph


def import_circles(graph: dict[str, dict[str, list[Import]]]) -> list[list[str]]:
    """One circle (a closed path of modules) for every strongly connected group of modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    counter = 0

    def connect(root: str) -> None:  # Tarjan's algorithm, iterative (no recursion limit)
        nonlocal counter
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            connect(module)
    return sorted(_cycle_in(graph, set(group)) for group in groups)


def _cycle_in(graph: dict[str, dict[str, list[Import]]], group: set[str]) -> list[str]:
    """A shortest closed path through the group's first module, staying inside the group."""
    start = min(group)
    came_from = {start: None}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node]):
                if child == start:
                    path = [node]
                    while came_from[path[-1]] is not None:
                        path.append(came_from[path[-1]])
                    return path[::-1] + [start]
                if child in group and child not in came_from:
                    came_from[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no cycle through {start} in {sorted(group)}")  # cannot happen for an SCC


def describe_circle(graph: dict[str, dict[str, list[Import]]], circle: list[str]) -> str:
    lines = [" -> ".join(circle)]
    for a, b in zip(circle, circle[1:]):
        where = ", ".join(dict.fromkeys(f"{i.path}:{i.line}" for i in graph[a][b]))
        lines.append(f"    {a} -> {b} ({where})")
    return "\n".join(lines)


def layer_violations(folder: str, banned: tuple[str, ...]) -> list[str]:
    """Imports (module- or function-level) in `folder` of any package in `banned` or below it."""
    def is_banned(target: str) -> bool:
        return any(target == b or target.startswith(b + ".") for b in banned)

    return list(dict.fromkeys(f"{i.path}:{i.line}: {i.source} imports {i.target}" for i in all_imports()
                              if (i.source == folder or i.source.startswith(folder + ".")) and is_banned(i.target)))


# ----------------------------------------------------------------------------- the rules

def test_the_reader_sees_the_project():
    """The graph has the arrows we know are there (a reader that sees nothing passes nothing)."""
    graph = import_graph()
    assert len(graph) > 50
    assert "comm.store_base" in graph["comm.store_dir"]
    assert "clouds.ecs" in graph["clouds.registry"]  # a function-level import
    assert "comm.heartbeat" in graph["comm.store_base"]  # `from comm import heartbeat`


def test_the_circle_finder_finds_circles():
    def imp(a, b):
        return [Import(a, b, f"{a}.py", 1)]

    graph = {"a": {"b": imp("a", "b")}, "b": {"c": imp("b", "c")}, "c": {"a": imp("c", "a"), "d": imp("c", "d")},
             "d": {}, "e": {"e2": imp("e", "e2")}, "e2": {"e": imp("e2", "e")}}
    assert import_circles(graph) == [["a", "b", "c", "a"], ["e", "e2", "e"]]
    assert "c -> a (c.py:1)" in describe_circle(graph, ["a", "b", "c", "a"])


def test_no_import_circles():
    graph = import_graph()
    circles = import_circles(graph)
    assert not circles, ("import circles (one per tangle of modules that reach each other):\n"
                         + "\n".join(describe_circle(graph, c) for c in circles))


PREFECT = ("prefect", "prefect_aws", "prefect_azure", "prefect_redis", "prefect_kubernetes")

LAYERS = {
    "core": (),
    "comm": ("core",),
    "engine": ("core", "comm"),
    "profiling": ("core", "comm", "engine"),
    "runtime": ("core", "comm", "engine", "profiling"),
    "planners": ("core",),
    "clouds": ("core",),
    "blocks": ("core", "comm"),
    "coordinator": ("core", "comm", "engine", "profiling", "runtime", "planners", "clouds", "blocks"),
    "tasks": ("core", "comm", "engine", "profiling", "runtime", "planners", "clouds", "blocks", "coordinator"),
    "deployments": ("core", "comm", "engine", "profiling", "runtime", "planners", "clouds", "blocks", "coordinator",
                    "tasks"),
    "flows": ("core", "comm", "engine", "profiling", "runtime", "planners", "clouds", "blocks", "coordinator",
              "tasks", "deployments"),
}
"""Each folder (one layer) and the project folders it may import: arrows point down only."""


def test_every_folder_is_a_layer():
    assert set(LAYERS) == set(PACKAGES) - {"benchmarks"}


COORDINATOR_ROOMS = ("run", "bill", "workers", "plan", "report")
"""coordinator/'s sub-packages, lowest first: each imports only the rooms before it (the bill
never imports the report; the plan may read the workers, which take the profile)."""


def test_the_coordinator_is_rooms_whose_arrows_point_down():
    modules = [m for m in project_files() if m.startswith("coordinator.")]
    assert modules and all(m.split(".")[1] in COORDINATOR_ROOMS for m in modules), \
        [m for m in modules if m.split(".")[1] not in COORDINATOR_ROOMS]
    bad = []
    for i, room in enumerate(COORDINATOR_ROOMS):
        bad += layer_violations(f"coordinator.{room}", tuple(f"coordinator.{r}" for r in COORDINATOR_ROOMS[i + 1:]))
    assert not bad, "imports against the coordinator's rooms:\n" + "\n".join(bad)
    assert "coordinator.bill.cost" in import_graph()["coordinator.workers.epoch_run"]  # the reader sees rooms


def test_arrows_point_down_only():
    """No folder imports a folder above it (docs/ARCHITECTURE.md draws the same picture)."""
    bad = []
    for folder, allowed in LAYERS.items():
        banned = tuple(f for f in LAYERS if f != folder and f not in allowed) + ("benchmarks",)
        bad += layer_violations(folder, banned)
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def test_the_core_is_the_standard_library_only():
    """Typed specs and formulas: nothing to install, importable anywhere."""
    bad = [f"{i.path}:{i.line}: {i.target}" for i in all_imports()
           if i.source.split(".")[0] == "core" and _project_module(i.target) is None
           and i.target.split(".")[0] not in sys.stdlib_module_names]
    assert not bad, "core/ imports beyond the standard library:\n" + "\n".join(bad)


def test_planners_are_pure():
    """Planners take and return plain data: numpy and the solvers, never torch, a store client
    or Prefect (every planner runs and is tested without a server or torch)."""
    bad = [f"{i.path}:{i.line}: {i.target}" for i in all_imports()
           if i.source.split(".")[0] == "planners" and _project_module(i.target) is None
           and i.target.split(".")[0] not in sys.stdlib_module_names
           and i.target.split(".")[0] not in ("numpy", "gurobipy", "pyscipopt")]
    assert not bad, "planners/ imports beyond numpy and the solvers:\n" + "\n".join(bad)


def test_the_worker_side_never_imports_prefect():
    """A worker image needs Prefect only for its flow entry point (flows/worker.py)."""
    bad = []
    for folder in ("core", "comm", "engine", "profiling", "runtime", "planners"):
        bad += layer_violations(folder, PREFECT)
    assert not bad, "worker-side code importing Prefect:\n" + "\n".join(bad)


def _imports_by_string() -> list[str]:
    """Calls of importlib.import_module / __import__ whose name is a project module literal, and
    `python -c` scripts that import project modules."""
    found = []
    packages = tuple(LAYERS)
    for module, path in project_files().items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            if name in ("import_module", "__import__") and node.args:
                arg = node.args[0]
                if not isinstance(arg, ast.Constant) or str(arg.value).split(".")[0] in packages:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_import_by_string_of_the_projects_own_modules():
    """Only user models, datasets and losses given by import path are imported by name
    (engine.user_code, and the worker's base-memory probe); each of those calls takes a variable."""
    found = _imports_by_string()
    allowed = ("engine/user_code.py", "profiling/base_memory.py")
    bad = [f for f in found if not f.startswith(allowed)]
    assert not bad, "imports by string:\n" + "\n".join(bad)
    assert {f.split(":")[0] for f in found} == set(allowed)  # the reader sees the calls it allows


def _registries() -> list[str]:
    """Module-level dicts, lists and sets changed from inside functions (`NAME[...] = `,
    `NAME.append(...)`, ..., also where NAME was imported), and `global NAME` statements:
    state kept in modules rather than passed."""
    mutators = {"append", "extend", "add", "update", "pop", "setdefault", "clear", "remove", "discard"}
    trees = {m: ast.parse(p.read_text(), filename=str(p)) for m, p in project_files().items()}
    defined = {}  # module -> its module-level containers
    for module, tree in trees.items():
        defined[module] = {t.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
                           for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                           if isinstance(t, ast.Name) and isinstance(node.value, (ast.Dict, ast.List, ast.Set))}
    found = set()
    for module, tree in trees.items():
        names = {n: f"{module}.{n}" for n in defined[module]}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in defined:
                names.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names
                              if a.name in defined[node.module]})
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                target = None
                if isinstance(node, ast.Global):
                    found.update(f"{module}.{n}" for n in node.names)
                elif isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del)):
                    target = node.value
                elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                        and node.func.attr in mutators:
                    target = node.func.value
                if isinstance(target, ast.Name) and target.id in names:
                    found.add(names[target.id])
    return sorted(found)


def test_a_runs_configuration_is_immutable_and_its_state_is_one_object():
    import dataclasses

    from coordinator.run.context import RunContext, RunState
    from coordinator.run.job import TrainJob
    from coordinator.run.validate import ResolvedJob

    assert RunContext.__dataclass_params__.frozen and ResolvedJob.__dataclass_params__.frozen
    assert TrainJob.model_config.get("frozen")
    assert {f.name for f in dataclasses.fields(RunContext)} == {
        "run_id", "job", "resolved", "flow_run_id", "dry_run", "started_at", "state"}
    assert {"ledger", "launchers", "attempts", "warm"} <= {f.name for f in dataclasses.fields(RunState)}


def test_the_coordinator_keeps_one_registry_the_failure_hooks():
    """tasks/ and flows/ keep no state in modules except `coordinator.run.context.ACTIVE`, which the
    flow's failure hooks need (Prefect hands a hook the flow run alone)."""
    found = _registries()
    assert [r for r in found if r.split(".")[0] in ("coordinator", "tasks", "flows")] == ["coordinator.run.context.ACTIVE"], found


def test_tasks_holds_only_thin_prefect_tasks():
    """tasks/ is the train flow's steps as Prefect tasks, each a thin function over coordinator/:
    every module defines a task, and every function there is a task (or the profile step, which
    must stay outside a task run: its worker's paid-worker slot outlives the task) of at most 4
    lines besides its docstring."""
    bad = []
    for module, path in project_files().items():
        if not module.startswith("tasks.") or path.name == "__init__.py":
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        functions = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        tasks = [f for f in functions if any("task" in ast.unparse(d) for d in f.decorator_list)]
        if not tasks:
            bad.append(f"{path.name}: no Prefect task")
        for f in functions:
            body = f.body[1:] if ast.get_docstring(f) else f.body
            lines = body[-1].end_lineno - body[0].lineno + 1
            if lines > 4 or (f not in tasks and (module, f.name) != ("tasks.profile", "profile")):
                bad.append(f"{path.name}:{f.lineno} {f.name}: {'not a task' if f not in tasks else f'{lines} lines'}")
    assert not bad, "tasks/ should hold thin Prefect tasks only:\n" + "\n".join(bad)


def _project_import_statements() -> list[tuple[str, int, bool, str]]:
    """Every import statement of a project module outside benchmarks/: (path, line, whether it
    sits inside a function, the comment on its line or heading its block of imports)."""
    found = []
    for module, path in project_files().items():
        if module.startswith("benchmarks"):
            continue
        source = path.read_text()
        lines = source.splitlines()
        tree = ast.parse(source, filename=str(path))
        inner = {id(n) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                 for n in ast.walk(fn)}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or getattr(node, "level", 0):
                continue
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if not any(_project_module(n) for n in names):
                continue
            own = lines[node.lineno - 1].partition("#")[2].strip()
            above = node.lineno - 2  # a comment heading the block of imports it opens
            while above >= 0 and lines[above].lstrip().startswith(("from ", "import ")):
                above -= 1
            head = lines[above].strip() if above >= 0 else ""
            why = own or (head[1:].strip() if head.startswith("#") else "")
            found.append((str(path.relative_to(ROOT)), node.lineno, id(node) in inner, why))
    return found


def test_project_imports_sit_at_the_top_and_each_inner_one_says_why():
    """Imports of the project's own modules go at the top of a file, where a reader sees the
    graph; one inside a function only where it must (a heavy dependency kept off a light path,
    a solver), with a comment saying why, and at most 10 % of the project's import statements."""
    statements = _project_import_statements()
    inner = [s for s in statements if s[2]]
    silent = [f"{path}:{line}" for path, line, _, why in inner if not why]
    assert not silent, "function-level project imports without a comment saying why:\n" + "\n".join(silent)
    assert len(inner) <= 0.10 * len(statements), f"{len(inner)} of {len(statements)} project imports inside functions"


def test_no_module_name_repeats_across_layers():
    """A module's name says where it lives: `plan.py` in three folders made a reader ask which."""
    seen: dict[str, list[str]] = {}
    for module, path in project_files().items():
        if path.name != "__init__.py" and not module.startswith("benchmarks"):
            seen.setdefault(path.name, []).append(module.split(".")[0])
    repeated = {name: folders for name, folders in seen.items() if len(set(folders)) > 1}
    assert not repeated, f"module names in more than one layer: {repeated}"


def test_the_training_recipe_is_short():
    """`flows.train._run_training` reads as a recipe: a loop over named steps, 40 lines at most."""
    tree = ast.parse((ROOT / "flows" / "train.py").read_text())
    recipe = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_run_training")
    assert recipe.end_lineno - recipe.lineno + 1 <= 40
    called = {n.func.id for n in ast.walk(recipe) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert {"start_run", "profile_plan_and_provision", "train_one_epoch", "rescale_or_replan", "finish_run"} <= called
