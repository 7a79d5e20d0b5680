"""Run every benchmark (`make bench`) and assemble BENCHMARKS.md from their result files.

Each `benchmarks/bench_*.py` writes `benchmarks/results/<name>.md` through
`benchmarks.output.write_result`, whose first lines name the command, the machine, the load and
the commit measured. `SECTIONS` names each results file's script and the exact arguments that
file was produced with; this script runs them one after another with those arguments (they are
long: well over an hour in all on 2 cores) and stitches the results under one heading per issue.
`python -m benchmarks.run_all --assemble-only` only rebuilds BENCHMARKS.md.

Each script declares the sources it measures (`SOURCES`; `benchmarks.staleness`):
`python -m benchmarks.run_all --stale` lists the results files whose sources changed since the
commit their `Code:` line names, and runs nothing; `--only-stale` reruns only those, then rebuilds
BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks.staleness import Staleness, staleness

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


@dataclass(frozen=True)
class Section:
    """One section of BENCHMARKS.md: its title, the script and arguments that write its results file."""

    title: str
    module: str
    result: str
    args: tuple[str, ...] = ()
    gpu: bool = False
    """Runs only on a CUDA machine (elsewhere its results file is kept as it is)."""

    @property
    def path(self) -> Path:
        return RESULTS / f"{self.result}.md"

    @property
    def script(self) -> Path:
        return ROOT / "benchmarks" / f"{self.module}.py"

    @property
    def command(self) -> str:
        """The command the results file names (run from the repository root)."""
        return " ".join([".venv/bin/python -m", f"benchmarks.{self.module}", *self.args])


SECTIONS = [
    Section("Warm workers: orchestration overhead, warm vs cold", "bench_orchestration", "orchestration"),
    Section("Foundation: store throughput", "bench_stores", "stores", ("--repeats-large", "5")),
    Section("Foundation: Local-SGD period to 95 % accuracy", "bench_local_sgd", "local_sgd"),
    Section("Local-SGD: DiLoCo's outer settings that follow the sync period", "bench_diloco_defaults",
            "diloco_defaults"),
    Section("Planners: partition, hybrid, provision", "bench_planners", "planners_partition_provision"),
    Section("Planners: co-optimisation (exact vs SCIP vs gurobipy)", "bench_co_optimize", "co_optimize",
            ("--scip-time-limit", "60")),
    Section("Pipeline: pipelined vs plain scatter-reduce", "bench_scatter_reduce", "scatter_reduce"),
    Section("Profiling and prediction, out of sample: epoch wall and run bill against naive baselines", "bench_prediction",
            "prediction"),
    Section("Profiling and prediction on a GPU", "bench_prediction", "prediction_gpu",
            ("--models", "--gpu", "--out", "benchmarks/results/prediction_gpu.md"), gpu=True),
    Section("Pipeline: bubble and activation memory per schedule", "bench_bubble", "bubble",
            ("--steps", "6", "--schedules", "gpipe", "1f1b", "interleaved", "--stages", "2", "4",
             "--microbatches", "1", "2", "4", "8", "--chunks", "2")),
    Section("Cloud targets: pre-start on the local process pool", "bench_prestart", "prestart", ("--inline",)),
    Section("The worker image: a cold build (base, wheels, image) from nothing", "bench_image", "image"),
    Section("Containers: the docker target against the process pool", "bench_containers", "containers",
            ("--epochs", "5", "--repeats", "3")),
    Section("Elastic training: dynamic scaling in miniature", "bench_scaling", "scaling"),
    Section("Peers: Zooid beside Ray Train on the same job", "bench_peers", "peers"),
    Section("Peers: the CPU ring's transport beside gloo", "bench_ring", "ring"),
    Section("Language models: sync methods, plain PyTorch, the seeds' workloads planned", "bench_language_models",
            "language_models", ("--seq-len", "128", "512")),
    Section("Datasets in a bucket: prepare, read, data wait and memory beside MosaicML Streaming", "bench_data",
            "data"),
    Section("The whole bill: the store's requests and servers, measured and predicted", "bench_bill", "bill"),
    Section("Spot capacity: preemptions on the docker target against on-demand", "bench_spot", "spot"),
]

HEADER = """# Zooid benchmarks

Every number below was measured by the command printed with it, on the machine named beside
it and, where a `Code:` line names one, at that commit, while other work shared the cores, so
absolute wall times are noisy; comparisons were measured side by side in one run. `make bench` reruns everything with
those commands and rebuilds this file (`python -m benchmarks.run_all`); each section is the
result file `benchmarks/results/<name>.md` its script wrote. `python -m benchmarks.run_all --stale`
lists the sections whose measured sources changed since the commit their `Code:` line names.

A GPU section runs only where CUDA is available (`make bench` elsewhere keeps its file). On a CUDA
machine whose Python already has a CUDA build of torch, the benchmark needs beside it only numpy,
scikit-learn, matplotlib, safetensors, tokenizers, prefect and fastapi, at the versions
`requirements.lock` names (`pip install -c requirements.lock prefect fastapi ...`); run its command
with that Python from a checkout whose git history holds the commit it measures.
"""


def assemble() -> str:
    parts = [HEADER]
    for section in SECTIONS:
        path = section.path
        body = path.read_text().strip() if path.exists() else "_not measured yet_"
        lines = body.splitlines()
        if lines and lines[0].startswith("#"):
            lines = lines[1:]  # the section title replaces the file's own
        # the file's own sub-headings go one level down
        body = "\n".join("#" + l if l.startswith("#") else l for l in lines).strip()
        parts.append(f"## {section.title}\n\n{body}")
    return "\n\n".join(parts) + "\n"


def stale_sections() -> list[tuple[Section, Staleness]]:
    """Each section whose results file is stale (or missing), with why."""
    out = []
    for section in SECTIONS:
        if not section.path.exists():
            out.append((section, Staleness(section.path, section.script, None, reason="not measured yet")))
            continue
        found = staleness(section.path, section.script, ROOT)
        if found.stale:
            out.append((section, found))
    return out


def stale_report(stale: list[tuple[Section, Staleness]]) -> str:
    """One line per stale results file: the file, why, and the changed sources (the first few)."""
    lines = []
    for section, found in stale:
        shown = ", ".join(found.changed[:6]) + (f", +{len(found.changed) - 6} more" if len(found.changed) > 6 else "")
        line = f"stale  {section.path.relative_to(RESULTS.parents[1])}: {found.reason}"
        lines.append(line + (f" ({shown})" if shown else ""))
    return "\n".join(lines + [f"{len(stale)} of {len(SECTIONS)} results files stale"])


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run_all", description=__doc__.splitlines()[0])
    parser.add_argument("--assemble-only", action="store_true")
    parser.add_argument("--stale", action="store_true",
                        help="list the results files whose declared sources changed since their Code: commit; run nothing")
    parser.add_argument("--only-stale", action="store_true", help="rerun only the stale results files")
    args = parser.parse_args(argv)
    if args.stale:
        print(stale_report(stale_sections()))
        return 0
    if not args.assemble_only:
        chosen = [s for s, _ in stale_sections()] if args.only_stale else SECTIONS
        for section in chosen:
            if section.gpu and not _cuda():
                print(f"== skipped (no CUDA device; {section.path.name} kept): {section.command}", flush=True)
                continue
            print(f"== {section.command}", flush=True)
            subprocess.run([sys.executable, "-m", f"benchmarks.{section.module}", *section.args], cwd=ROOT, check=True)
    (ROOT / "BENCHMARKS.md").write_text(assemble())
    return 0


if __name__ == "__main__":
    sys.exit(main())
