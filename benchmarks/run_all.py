"""Run every benchmark (`make bench`) and assemble BENCHMARKS.md from their result files.

Each `benchmarks/bench_*.py` writes `benchmarks/results/<name>.md` with its numbers and the
exact command that produced them; this script runs them one after another (they are long:
about an hour in all on 2 cores) and stitches the results under one heading per issue.
`python -m benchmarks.run_all --assemble-only` only rebuilds BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

SECTIONS = [
    ("Warm workers: orchestration overhead, warm vs cold", "bench_orchestration", "orchestration"),
    ("Foundation: store throughput", "bench_stores", "stores"),
    ("Foundation: Local-SGD period to 95 % accuracy", "bench_local_sgd", "local_sgd"),
    ("Planners: partition, hybrid, provision", "bench_planners", "planners_partition_provision"),
    ("Planners: co-optimisation (exact vs SCIP vs gurobipy)", "bench_co_optimize", "co_optimize"),
    ("Pipeline: pipelined vs plain scatter-reduce", "bench_scatter_reduce", "scatter_reduce"),
    ("Profiling and prediction: epoch wall and run cost, predicted vs measured", "bench_prediction", "prediction"),
    ("Pipeline: bubble and activation memory per schedule", "bench_bubble", "bubble"),
    ("Cloud targets: pre-start on the local process pool", "bench_prestart", "prestart"),
    ("Containers: the docker target against the process pool", "bench_containers", "containers"),
    ("Elastic training: dynamic scaling in miniature", "bench_scaling", "scaling"),
]

HEADER = """# Zooid benchmarks

Every number below was measured by the command printed with it, on this project's machines
(2 cores, 24 GiB, no GPU) while other work shared the cores, so absolute wall times are noisy;
comparisons were measured side by side in one run. `make bench` reruns everything and
rebuilds this file (`python -m benchmarks.run_all`); each section is the result file
`benchmarks/results/<name>.md` its script wrote.
"""


def assemble() -> str:
    parts = [HEADER]
    for title, _, result in SECTIONS:
        path = RESULTS / f"{result}.md"
        body = path.read_text().strip() if path.exists() else "_not measured yet_"
        lines = body.splitlines()
        if lines and lines[0].startswith("#"):
            lines = lines[1:]  # the section title replaces the file's own
        # the file's own sub-headings go one level down
        body = "\n".join("#" + l if l.startswith("#") else l for l in lines).strip()
        parts.append(f"## {title}\n\n{body}")
    return "\n\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run_all", description=__doc__.splitlines()[0])
    parser.add_argument("--assemble-only", action="store_true")
    args = parser.parse_args(argv)
    if not args.assemble_only:
        for _, module, _ in SECTIONS:
            print(f"== {module}", flush=True)
            subprocess.run([sys.executable, "-m", f"benchmarks.{module}"], cwd=ROOT, check=True)
    (ROOT / "BENCHMARKS.md").write_text(assemble())
    return 0


if __name__ == "__main__":
    sys.exit(main())
