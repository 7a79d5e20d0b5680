"""Local-SGD at 4 workers on digits, k = 1, 4 and once per epoch, next to plain PyTorch: epochs,
wall time and bytes synchronised until 95 % validation accuracy, measured in one run.

Local-SGD runs the engine itself, `engine.local_sgd_epoch.run_local_sgd_epoch`, with the four
replicas as threads of this process against a directory store in a temporary folder (the
embedded default; it fsyncs checkpoints, not the sync rounds' scratch keys), as `run_epoch`
would drive them minus the process launches (bench_orchestration measures those): the
dataset is published once as subsets of 64 rows, each epoch deals the subsets to the
replicas (`assign_subsets`), every replica takes `steps_per_epoch(n_train, 4, batch)` steps
(batch 16: 23 steps) from the previous epoch's averaged checkpoint, and rank 0 evaluates
the averaged model on the validation set.

Plain PyTorch is one process with no store: the same model and initial weights
(`build_model(seed)`), the same optimizer and learning rate, the same validation set,
evaluated at each epoch end, in two forms: batch 4 x 16 = 64, the replicas' effective batch
(with k = 1 and plain SGD, Local-SGD computes exactly this), and batch 16, one replica's
batch with four times the steps.

Accuracy is checked at epoch ends. Wall time counts the epochs only (training, syncs,
checkpoint, evaluation), not publishing the dataset or building the first checkpoint.
Bytes synchronised = every replica's uploads plus downloads for averaging
(`WorkerResult.bytes_synced`), summed. Epochs are capped; a run that does not get there
is reported as "not reached".

    .venv/bin/python -m benchmarks.bench_local_sgd [--seeds 0 1 2] [--max-epochs 30]
"""
from __future__ import annotations

import argparse
import math
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.output import command_for, provenance, write_result
from comm.store_dir import DirectoryStore
from core.specs import ComputeSpec, WorkerSpec
from engine.checkpoint import initial_checkpoint
from engine.datasets import assign_subsets, load_dataset, publish_dataset
from engine.local_sgd import batch_seed, batch_stream, evaluate, steps_per_epoch
from engine.local_sgd_epoch import run_local_sgd_epoch
from engine.models import build_model
from engine.optimizers import build_optimizer

RESULTS = Path(__file__).resolve().parent / "results" / "local_sgd.md"
MODEL, DATASET, OPTIMIZER, LR = "digits_mlp", "digits", "momentum", 0.05
WORKERS, BATCH, SUBSET_ROWS = 4, 16, 64


@dataclass
class Trace:
    """One configuration's run: accuracy, wall seconds and bytes after each epoch."""

    name: str
    seed: int
    accuracy: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    bytes_synced: list[int] = field(default_factory=list)

    def reached(self, target: float) -> int | None:
        """1-based epoch at which validation accuracy first reached `target`, or None."""
        return next((i + 1 for i, a in enumerate(self.accuracy) if a >= target), None)

    def totals(self, target: float) -> tuple[int | None, float, int]:
        """(epochs, wall seconds, bytes) up to the target, or over every epoch when missed."""
        n = self.reached(target) or len(self.accuracy)
        return self.reached(target), sum(self.seconds[:n]), sum(self.bytes_synced[:n])


def run_local_sgd(root: Path, seed: int, period: int | None, max_epochs: int, target: float) -> Trace:
    """4 replicas as threads, synced every `period` steps (None: once per epoch), until
    rank 0's validation accuracy reaches `target` or `max_epochs` pass."""
    store = DirectoryStore(root / f"k{period or 'epoch'}-s{seed}")
    run_id = "bench"
    manifest = publish_dataset(store, run_id, DATASET, subset_size=SUBSET_ROWS)
    init = f"runs/{run_id}/ckpt/init"
    initial_checkpoint(store, init, MODEL, OPTIMIZER, LR, seed=seed)
    steps = steps_per_epoch(manifest.n_train, WORKERS, BATCH)
    trace = Trace(f"Local-SGD k={period or 'epoch'}", seed)
    with ThreadPoolExecutor(WORKERS) as pool:
        for epoch in range(max_epochs):
            shards = assign_subsets(manifest.n_subsets, WORKERS, epoch, seed)
            out = f"runs/{run_id}/ckpt/e{epoch}"
            specs = [WorkerSpec(run_id=run_id, epoch=epoch, rank=r, world=WORKERS, store_url=store.url,
                                model=MODEL, dataset=DATASET, subsets=shards[r], steps=steps,
                                batch_size=BATCH, lr=LR, optimizer=OPTIMIZER, sync_period=period,
                                seed=seed, init_key=init, out_key=out, evaluate=True,
                                compute=ComputeSpec(device="cpu"))
                     for r in range(WORKERS)]
            t0 = time.perf_counter()
            results = list(pool.map(lambda s: run_local_sgd_epoch(s, store), specs))
            trace.seconds.append(time.perf_counter() - t0)
            trace.accuracy.append(next(r.val_accuracy for r in results if r.rank == 0))
            trace.bytes_synced.append(sum(r.bytes_synced for r in results))
            init = out
            if trace.accuracy[-1] >= target:
                break
    return trace


def run_plain(seed: int, batch: int, max_epochs: int, target: float) -> Trace:
    """One process, no store: `batch` samples a step, one pass over the training set an epoch."""
    data = load_dataset(DATASET)
    model = build_model(MODEL, seed)
    optimizer = build_optimizer(OPTIMIZER, model, LR)
    steps = math.ceil(len(data.train_y) / batch)
    trace = Trace(f"plain PyTorch, batch {batch}", seed)
    model.train()
    for epoch in range(max_epochs):
        t0 = time.perf_counter()
        generator = torch.Generator().manual_seed(batch_seed(seed, epoch, 0))
        for idx in batch_stream(len(data.train_y), batch, steps, generator):
            loss = F.cross_entropy(model(data.train_x[idx]), data.train_y[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        _, acc = evaluate(model, data.val_x, data.val_y)
        trace.seconds.append(time.perf_counter() - t0)
        trace.accuracy.append(acc)
        trace.bytes_synced.append(0)
        if acc >= target:
            break
    return trace


def warm_up() -> None:
    """Pay the one-time costs before any clock starts: torch imports torch._dynamo lazily at
    the first optimizer call (seconds on a loaded machine), and the first kernels allocate."""
    run_plain(seed=0, batch=BATCH, max_epochs=1, target=0.0)


def _cell(values: list[float], fmt: str) -> str:
    return fmt.format(statistics.median(values)) if values else "-"


def title(target: float) -> str:
    return f"Local-SGD to {100 * target:.0f} % validation accuracy: 4 workers on digits vs plain PyTorch"


def render(traces: list[Trace], target: float, max_epochs: int) -> str:
    """Markdown below the header: one row per configuration (median over seeds), then every run."""
    names = list(dict.fromkeys(t.name for t in traces))
    lines = [
        f"Setup: `{MODEL}`, SGD with momentum 0.9, lr {LR}, seeds {sorted({t.seed for t in traces})}; "
        f"Local-SGD: {WORKERS} replicas x batch {BATCH}, {steps_per_epoch(load_dataset(DATASET).train_y.numel(), WORKERS, BATCH)} "
        "steps per replica per epoch, optimizer state averaged with the weights, engine "
        "`run_local_sgd_epoch` in threads against a directory store. Accuracy checked at epoch ends; "
        f"at most {max_epochs} epochs. Epochs, seconds and MB are medians over the seeds of the "
        "runs that reached the target; `reached` counts them. MB = bytes uploaded plus downloaded "
        "for averaging by all replicas (10^6 bytes).",
        "",
        "| configuration | reached | epochs | wall s | MB synced | MB / epoch | epochs per seed |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in names:
        runs = [t for t in traces if t.name == name]
        hit = [t for t in runs if t.reached(target)]
        tot = [t.totals(target) for t in hit]
        per_epoch = [sum(t.bytes_synced) / 1e6 / len(t.bytes_synced) for t in runs]
        lines.append("| " + " | ".join([
            name, f"{len(hit)} of {len(runs)}",
            _cell([e for e, _, _ in tot], "{:.0f}"), _cell([s for _, s, _ in tot], "{:.2f}"),
            _cell([b / 1e6 for _, _, b in tot], "{:.1f}"), _cell(per_epoch, "{:.2f}"),
            ", ".join(str(t.reached(target) or f"not reached ({max(t.accuracy):.3f} best)") for t in runs),
        ]) + " |")
    lines += ["", "Every run: validation accuracy after each epoch.", "",
              "| configuration | seed | accuracy per epoch |", "|---|---|---|"]
    for t in traces:
        lines.append(f"| {t.name} | {t.seed} | {' '.join(f'{a:.3f}' for a in t.accuracy)} |")
    return "\n".join(lines) + "\n"


def machine_detail() -> str:
    """The replicas share this process's CPUs."""
    return f"intra-op threads: {torch.get_num_threads()}; the four replicas are threads of one process"


def main(argv: list[str] | None = None) -> int:
    """Run every configuration for every seed and write the markdown."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_local_sgd",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--max-epochs", type=int, default=30)
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if not 0 < args.target <= 1:
        raise SystemExit("error: --target: must be in (0, 1]")
    if args.max_epochs < 1:
        raise SystemExit("error: --max-epochs: must be positive")

    # One intra-op thread, as the inline target gives each of 4 workers on 2 cores
    # (tasks.run_epoch.make_launcher); a 64-wide MLP gains nothing from more.
    torch.set_num_threads(1)
    prov = provenance()
    warm_up()
    root = Path(tempfile.mkdtemp(prefix="zooid-bench-lsgd-"))
    traces: list[Trace] = []
    try:
        for seed in args.seeds:
            # Interleaved by seed, so a burst of load from other jobs hits every configuration.
            for period in (1, 4, None):
                traces.append(run_local_sgd(root, seed, period, args.max_epochs, args.target))
            for batch in (WORKERS * BATCH, BATCH):
                traces.append(run_plain(seed, batch, args.max_epochs, args.target))
            for t in traces[-5:]:
                e, s, b = t.totals(args.target)
                print(f"seed {seed} {t.name:28s} epochs {e or 'not reached'} {s:.2f} s {b / 1e6:.1f} MB",
                      flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    command = command_for("benchmarks.bench_local_sgd", flags=[
        ("--seeds", " ".join(map(str, args.seeds)), "0 1 2"), ("--max-epochs", args.max_epochs, 30),
        ("--target", args.target, 0.95), ("--out", args.out.resolve(), RESULTS)])
    write_result(args.out, title(args.target), command, prov, render(traces, args.target, args.max_epochs),
                 detail=machine_detail(), echo=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
