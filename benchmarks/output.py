"""The one way a benchmark writes its results file, and the provenance every such file starts with.

A benchmark calls `provenance()` when it starts and `write_result(path, title, command, prov, body)`
when it ends. The file (`benchmarks/results/<name>.md`, or `--out`; gathered into BENCHMARKS.md by
`python -m benchmarks.run_all --assemble-only`) then begins with:

    # <title>

    Command: `<the exact command>`
    Machine: <cores, arch, torch and GPU, load at the start and the end>; <the benchmark's detail>
    Code: `<12-hex sha>`; no change to the project's source under way.   (or which files differed)
    Whole benchmark: <wall seconds> s.

The project's source is `SOURCE`: the top-level packages a run imports, the Prefect deployment
file and the requirements. Workers and coordinators import the working tree, so a file edited
while a benchmark runs changes what the later runs measure; the content hashes taken at the start
and at the end catch that.
"""
from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
IMAGE_RECIPE = ("worker_images/Dockerfile.cpu",)
"""The worker image's recipe, the one `deployments.images` builds: what a worker in a container runs
here, and nothing else does. `worker_images/Dockerfile.cuda` is built by no benchmark here, so a
change to it stales no results file."""
SOURCE = ("core", "comm", "engine", "runtime", "profiling", "planners", "coordinator", "tasks", "flows", "blocks", "clouds",
          "deployments", *IMAGE_RECIPE, "prefect.yaml", "requirements*")
HOST_SOURCE = tuple(path for path in SOURCE if path not in IMAGE_RECIPE)
"""The whole project but the image's recipe: what a benchmark measures that runs the train flow with
every worker a process on this host (never the docker target), so that its results file does not go
stale when only a Dockerfile changed (`benchmarks.staleness`)."""


@dataclass(frozen=True)
class CodeState:
    """The commit checked out, the source files that differ from it, and every source file's hash."""

    head: str
    dirty: tuple[str, ...] = ()
    hashes: dict[str, str | None] = field(default_factory=dict)


@dataclass(frozen=True)
class Provenance:
    """What a benchmark records when it starts: the code, the load and the clock."""

    code: CodeState
    load_start: float
    began: float  # time.monotonic()


def command_for(module: str, argv: list[str] | None = None, flags=()) -> str:
    """The command that reproduces a run, from the repository root: `module` with `argv` as given
    (`sys.argv[1:]` when None), or, with `flags` ((flag, value, default), ...), the non-default
    ones (a value of True is a bare flag)."""
    import sys

    if flags:
        args = [flag if value is True or value == "" else f"{flag} {value}" for flag, value, default in flags
                if value != default and value is not False]
    else:
        args = list(sys.argv[1:] if argv is None else argv)
    return " ".join([".venv/bin/python -m", module, *args])


def money(usd: float) -> str:
    """A dollar amount in thousandths of a dollar, as the results tables show it: `$1.234m`."""
    return f"${usd * 1000:.3f}m"


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout


def code_state() -> CodeState:
    """HEAD, the source files changed beside it in the working tree (untracked ones included),
    and each source file's sha256."""
    try:
        head = _git("rev-parse", "HEAD").strip()
        status = _git("status", "--porcelain", "--untracked-files=all", "--", *SOURCE).splitlines()
        files = _git("ls-files", "-co", "--exclude-standard", "--", *SOURCE).split("\n")
    except (subprocess.CalledProcessError, OSError):
        return CodeState(head="unknown")
    dirty = sorted({line[3:].split(" -> ")[-1].strip('"') for line in status if line.strip()})
    hashes: dict[str, str | None] = {}
    for name in filter(None, files):
        try:
            hashes[name] = hashlib.sha256((REPO / name).read_bytes()).hexdigest()
        except OSError:
            hashes[name] = None
    return CodeState(head=head, dirty=tuple(dirty), hashes=hashes)


def _source_diff(a: str, b: str) -> bool:
    """Whether any source file differs between commits `a` and `b` (True when git cannot tell)."""
    try:
        return bool(_git("diff", "--name-only", a, b, "--", *SOURCE).strip())
    except (subprocess.CalledProcessError, OSError):
        return True


def provenance() -> Provenance:
    """Call when the benchmark starts, before anything is measured."""
    return Provenance(code=code_state(), load_start=os.getloadavg()[0], began=time.monotonic())


def _files(names) -> str:
    return ", ".join(f"`{n}`" for n in names)


def code_line(before: CodeState, after: CodeState) -> str:
    """`Code: <sha>` and whether the project's source differed from it or changed during the run."""
    sha = before.head[:12]
    moved = before.head != after.head and _source_diff(before.head, after.head)
    where = (f"`{sha}` at the start, `{after.head[:12]}` at the end (committed during the run)" if moved
             else f"`{sha}`")
    changed = sorted(f for f in set(before.hashes) | set(after.hashes) if before.hashes.get(f) != after.hashes.get(f))
    if not before.dirty and not changed and not moved:
        later = (f" (`{after.head[:12]}`, committed during the run, changes no source file)"
                 if before.head != after.head else "")
        return f"Code: {where}; no change to the project's source under way{later}."
    parts = [f"Code: {where}"]
    if before.dirty:
        parts.append(f"with uncommitted changes to {len(before.dirty)} source file(s) at the start: "
                     f"{_files(before.dirty)}")
    if changed:
        parts.append(f"**source changed during the run** (each run imports the working tree): {_files(changed)}")
    return "; ".join(parts) + "."


def _torch_line() -> str:
    try:
        import torch
    except ImportError:
        return "no torch"
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"torch {torch.__version__}, {gpu}"


def machine_line(prov: Provenance, detail: str = "") -> str:
    """Cores, arch, torch and GPU, the 1-minute load average at the start and now, then `detail`."""
    line = (f"Machine: {os.cpu_count()} CPU cores ({platform.machine()}), {_torch_line()}, shared with other jobs "
            f"(1-minute load average {prov.load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end)")
    return line + (f"; {detail}." if detail else ".")


def header(title: str, command: str, prov: Provenance, detail: str = "") -> list[str]:
    """The first lines of a results file: title, command, machine, code, the whole benchmark's wall time."""
    return [f"# {title}", "", f"Command: `{command}`  ", machine_line(prov, detail) + "  ",
            code_line(prov.code, code_state()) + "  ",
            f"Whole benchmark: {time.monotonic() - prov.began:.0f} s.", ""]


def write_result(path: str | Path, title: str, command: str, prov: Provenance, body: str, *,
                 detail: str = "", echo: bool = False) -> None:
    """Write the header and `body` to `path`, creating its folder; with `echo`, print it too."""
    text = "\n".join(header(title, command, prov, detail)) + "\n" + body.strip("\n") + "\n"
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    if echo:
        print(text)
