"""Language models (issue #42), benchmarked in parts that write one results file,
`benchmarks/results/language_models.md`:

- a. sync methods on the real corpus: `gpt_mini` on `text:stdlib`, 2 workers on the local pool,
  every step, K-AVG and DiLoCo (float32, int8) to a perplexity target (`benchmarks/lm_sync.py`);
- b. against plain PyTorch: the worker's epoch and a plain loop in one process, on the CPU or a
  GPU (`--device cuda`: `benchmarks/results/language_models_gpu.md`; `benchmarks/lm_plain.py`);
- c. the seeds' workloads, planned: dry runs (`flows.dry_run`, rent=false: nothing rented, the
  profile estimated from the catalog's figures on `meta`) of `bert_base` (Hydrozoa's BERT-12
  shape) and `bert_large` (FuncPipe's BERT-Large) at global batch 64 and 256 on the catalog's
  worker sizes (`planners/prices.json`): the chosen strategy, stages and worker memory, the
  predicted iteration time and dollars per iteration; beside them the figures Hydrozoa and
  FuncPipe publish for the same models.

    .venv/bin/python -m benchmarks.bench_language_models --part c [--seq-len 128] [--out PATH]

Part c's dry runs run against a temporary Prefect server (the sizes are saved Compute Target
blocks, as a user saves them) and an S3 store served by moto on 127.0.0.1 (cloud targets' workers
cannot reach a directory store; the dry run only reads its profile cache there). Nothing is
measured on the target: every time and dollar in part c is simulated from the catalog's estimate.
"""
from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness.home import scratch
from benchmarks.harness.tables import merged_body, table
from benchmarks.lm_plain import RESULTS_GPU, add_plain_arguments, part_b
from benchmarks.lm_sync import add_sync_arguments, part_a
from benchmarks.output import HOST_SOURCE, command_for, money, provenance, write_result

RESULTS = Path(__file__).resolve().parent / "results" / "language_models.md"
SOURCES = (*HOST_SOURCE, "benchmarks/lm_plain.py", "benchmarks/lm_sync.py", "benchmarks/harness/stack.py",
           "benchmarks/harness/replicas.py", "benchmarks/harness/servers.py", "benchmarks/harness/tables.py")
"""The code it measures (sync methods on the local stack, plain PyTorch, and the planner on the seeds'
workloads): its results file is stale once one of these changed since the commit the file names
(`benchmarks.staleness`)."""
TITLE = "Language models: sync methods, plain PyTorch, the seeds' workloads planned"


# --- part c: the seeds' workloads, planned -------------------------------------------------


@dataclass(frozen=True)
class Size:
    """A worker size of the catalog the dry run plans on (saved as a Compute Target block)."""

    name: str
    label: str
    kind: str
    offer: str
    vcpu: float
    memory_gb: float
    gpu: int = 0
    options_gb: tuple[float, ...] = ()
    """Memory tiers the co-optimiser may give each stage (FuncPipe's eight Lambda sizes)."""


SIZES = (
    Size("lm-aci-cpu", "ACI CPU container, 1 vCPU 1.5 GB", "aci", "aci-cpu", 1, 1.5),
    Size("lm-fargate", "Fargate task, 1 vCPU 2 GB", "ecs", "fargate-cpu", 1, 2),
    Size("lm-c5", "EC2 c5.xlarge, 4 vCPU 8 GB", "ecs", "ec2-c5.xlarge", 4, 8),
    Size("lm-lambda", "Lambda, FuncPipe's 8 sizes 0.5-10 GB (vCPU with memory)", "ecs", "lambda-10gb", 6, 10,
         options_gb=(0.5, 1, 2, 3, 4, 6, 8, 10)),
    Size("lm-k80", "ACI K80 container, 4 vCPU 6 GB (Hydrozoa's)", "aci", "aci-gpu-k80", 4, 6, gpu=1),
    Size("lm-v100", "ACI V100 container, 6 vCPU 112 GB", "aci", "aci-gpu-v100", 6, 112, gpu=1),
)
MODELS = ("bert_base", "bert_large")
GLOBAL_BATCHES = (64, 256)
WORKERS = 8
"""The worker budget of every dry run: `auto` compares Local-SGD with 8 replicas and every
D x M pipeline of at most 8 workers at the same global batch."""
MICROBATCH = 4
"""Samples per micro-batch, as both papers ran (Hydrozoa Table 4: 13 x 4; FuncPipe Sec. 5.1: 4)."""
DATASETS = {128: "benchmarks.lm_shapes:bert_mlm_128", 512: "benchmarks.lm_shapes:bert_mlm_512"}

PAPERS = """### What the papers publish for the same models

| model here | paper | parameters | worker sizes | their chosen configuration | source |
|---|---|---|---|---|---|
| `bert_base` (132.4M untied; 108.9M with the head tied to the embedding) | Hydrozoa, BERT-12, question answering on SQuAD | 108.9M, 65.3 GFLOPs per input | ACI GPU containers, priced per vCPU, GB and GPU hour ($0.03165, $0.00425, K80 $0.36, V100 $2.8548); a worker of ResNet-34 was a K80, 4 vCPUs and 6 GB ($0.512/h; BERT-12's size is not given) | K80 (16 GPUs): hybrid 4 x 4 (4 replicas of 4 stages), 13 micro-batches x 4; 2.05x the throughput of Azure ML's data-parallel 16 x 1 and 3.36x its throughput per dollar (SageMaker: 2.66x, 5.43x). V100 (4 GPUs): model-parallel 1 x 4, 24 micro-batches x 2 | Table 2, Table 3, Sec. 5.3 and Table 4; App. B.2 Table 5 |
| `bert_large` (365.4M untied, 1,394 MB; 334.1M tied, 1,275 MB; MB = 2^20 bytes) | FuncPipe, BERT-Large, masked LM on Wikitext-2 | 1,153 MB of parameters, 263 MB of activations per sample | AWS Lambda, 8 memory sizes 512 MB to 10 GB (vCPU with memory), storage through S3; micro-batch 4 | global batch 16, 64 and 256; its configurations are plotted (Fig. 5), not listed; at 256, 2.2x faster and 77 % cheaper than LambdaML; its performance model's iteration-time error 11.0 % at batch 64, 16.4 % at 256 | Table 1, Sec. 5.1, Sec. 5.2, App. E Table 3 |
"""


def _dry_run(model: str, size: Size, global_batch: int, seq_len: int, store: str) -> dict:
    """The dry run's chosen plan (as a dict) for `model` on `size` at `global_batch`."""
    from coordinator.run.job import TrainJob
    from flows.dry_run import dry_run

    batch = global_batch // WORKERS
    job = TrainJob(model=model, dataset=DATASETS[seq_len], workers=WORKERS,
                   max_workers=WORKERS, batch_size=batch, microbatches=max(1, batch // MICROBATCH),
                   optimizer="adam", lr=1e-4, target=size.name, store=store, durable_store=store, epochs=1)
    return dry_run(job, rent=False)


def _save_targets() -> None:
    from blocks.compute import ComputeTarget

    for s in SIZES:
        ComputeTarget(kind=s.kind, work_pool=f"zooid-{s.kind}", worker_deployment=f"worker/{s.kind}",
                      offer=s.offer, worker_vcpu=s.vcpu, worker_memory_gb=s.memory_gb, worker_gpu=s.gpu,
                      worker_memory_options_gb=list(s.options_gb)).save(s.name, overwrite=True)


def _row(model: str, size: Size, global_batch: int, chosen: dict, seconds: float) -> str:
    """One results row: the plan in words and its prediction per iteration."""
    workers = chosen["data_parallel"] * chosen["stages"]
    pipeline = chosen["stages"] > 1
    memory = ("/".join(f"{g:g}" for g in chosen["stage_memory_gb"]) + " GB per stage"
              if chosen.get("stage_memory_gb") else f"{chosen['worker_memory_gb']:g} GB")
    plan = (f"{chosen['strategy']} {chosen['data_parallel']} x {chosen['stages']}"
            + (f", {chosen['microbatches']} x {chosen['batch_size'] // chosen['microbatches']}"
               f" micro-batches, {chosen['pipeline_schedule']}" if pipeline else ""))
    cuts = ", ".join(str(c + 1) for c in chosen["cuts"]) if pipeline else "-"
    usd = chosen["predicted_iteration_s"] * workers * chosen["price_per_worker_s"]
    local = [a for a in chosen["alternatives"] if a.get("strategy") == "local_sgd"]
    whole = "no" if local and all(a.get("fits") is False for a in local) else "yes"
    co = chosen.get("co_optimizer") or {}
    return (f"| `{model}` | {global_batch} | {size.label} | {plan} | {cuts} | {workers} | {memory} | {whole} | "
            f"{'used' if co.get('used') else '-'} | {chosen['predicted_iteration_s']:.2f} s | {money(usd)} | "
            f"{seconds:.0f} s |")


def _model_facts(seq_len: int) -> tuple[list[str], dict[str, float]]:
    """Parameters, weights and activations per sample as the estimate counts them (CPU figures):
    the table's lines, and each model's activation MB per sample."""
    from engine.models import resolve_model
    from planners.catalog import device_figures
    from profiling.estimate import DeviceFigures, estimate_profile

    fig = device_figures(None, 1)
    figures = DeviceFigures(**{k: fig[k] for k in DeviceFigures.__dataclass_fields__})
    per_sample = {}
    lines = ["| model | parameters | weights (float32) | with gradients and Adam's moments | activations per "
             f"sample at T = {seq_len} (flash attention) | of which the head's logits and log-softmax |",
             "|---|---|---|---|---|---|"]
    for name in MODELS:
        est = estimate_profile(resolve_model(name), name, (seq_len,), MICROBATCH, MICROBATCH, "adam", 2, figures, 1,
                               input_dtype="int64", target_shape=(seq_len,))
        params = est.param_bytes // 4
        loss = est.layers[-1].activation_bytes - est.layers[-2].output_bytes  # the head keeps its input too
        per_sample[name] = est.activation_bytes / MICROBATCH / 2**20
        lines.append(f"| `{name}` | {params / 1e6:.1f}M | {est.param_bytes / 2**20:,.0f} MB | "
                     f"{4 * est.param_bytes / 2**30:.2f} GB | {est.activation_bytes / MICROBATCH / 2**20:.0f} MB | "
                     f"{loss / MICROBATCH / 2**20:.0f} MB |")
    return lines, per_sample


def part_c(args: argparse.Namespace) -> str:
    """Part c's markdown: every model x global batch x size dry run (module docstring), at each
    of `args.seq_len`, for `args.models` and `args.batches`."""
    seq_lens, models, batches = tuple(args.seq_len or [128]), tuple(args.models), tuple(args.batches)
    if set(seq_lens) - set(DATASETS):
        raise SystemExit(f"error: --seq-len: part c plans at {' or '.join(map(str, DATASETS))} tokens")
    from moto.server import ThreadedMotoServer
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from benchmarks.harness.servers import S3_ENV
    from deployments.server import free_port, temporary_server

    rows = {seq_len: [] for seq_len in seq_lens}
    with scratch("lm") as home:
        os.environ.update(S3_ENV)
        port = free_port(0)
        s3 = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        s3.start()
        try:
            import boto3

            boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1").create_bucket(
                Bucket="zooid-plans")
            store = f"s3://zooid-plans/lm?endpoint=http://127.0.0.1:{port}"
            with temporary_server(home) as api_url, temporary_settings(updates={PREFECT_API_URL: api_url}):
                _save_targets()
                for seq_len in seq_lens:
                    for model in models:
                        for global_batch in batches:
                            for size in SIZES:
                                began = time.perf_counter()
                                try:
                                    chosen = _dry_run(model, size, global_batch, seq_len, store)
                                    row = _row(model, size, global_batch, chosen, time.perf_counter() - began)
                                except ValueError as exc:  # ZooidValueError: no plan fits, in one line
                                    first = str(exc).split("; ")[0]  # its first candidate's numbers
                                    row = (f"| `{model}` | {global_batch} | {size.label} | refused, no candidate fits "
                                           f"(the first: {first}) | - | - | - | no | - | - | - | "
                                           f"{time.perf_counter() - began:.0f} s |")
                                print(row, flush=True)
                                rows[seq_len].append(row)
        finally:
            s3.stop()
    out = ["## c. The seeds' workloads, planned", "",
           "**Simulated, not measured**: every time and dollar below is the dry run's prediction "
           "(`python -m flows.dry_run --param rent=false ...`) from the catalog's estimate of each model (its "
           "flops and bytes traced on `meta`, at the catalog's assumed rates for the worker's device: "
           "`planners/prices.json` `devices`, a CPU vCPU's or the GPU's) and the catalog's assumed S3 bandwidth "
           "and latency; nothing ran on the workers priced. The catalog's estimates landed within 0.5x to 2x of "
           "measured profiles on the project's CNNs; a run's first epoch calibrates them.", "",
           f"Each dry run: `strategy=auto`, a budget of {WORKERS} workers, global batch = {WORKERS} replicas x "
           f"the per-replica batch (a pipeline takes the whole global batch), micro-batches of {MICROBATCH} "
           "samples, Adam (two moments per parameter), masked-LM targets on BERT's 30522-token vocabulary "
           "(`benchmarks.lm_shapes`: shapes only, random ids), untied embedding and head (the registry's "
           "default, so a pipeline may put them on different stages). Worker memory is checked against each "
           "stage's need: its activations for the micro-batches its schedule holds (the head's stage holds the "
           "[B, T, V] logits and log-softmax), its parameters with gradients, Adam's moments and, with D > 1, "
           "the sync buffers, and the worker's base memory (`core/stage_memory.py`). Attention is assumed to "
           "run a flash kernel (no T x T scores kept): PyTorch's on a GPU, and on a CPU without dropout, which "
           "the registry's models default to. On a GPU size the check is against the container's memory, not "
           "the GPU's.", "",
           "Columns: plan = strategy D x M (replicas x stages), with a pipeline's micro-batches per replica x "
           "samples and schedule; cuts = the first layer of each stage after the first (layer 0 is the "
           "embeddings, 1-N the blocks, then the final norm and the head); whole model on one worker = whether "
           "Local-SGD's replica fits the size; co-opt = the co-optimiser chose the stages' sizes; $ / iteration "
           "= predicted iteration x workers x each worker's price per second (`$1.234m` = thousandths of a "
           "dollar); dry run = the dry run's own wall time here."]
    beside = []
    for seq_len in seq_lens:
        facts, per_sample = _model_facts(seq_len)
        beside.append(f"{per_sample['bert_large']:.0f} MB at T = {seq_len}")
        out += ["", f"### T = {seq_len} tokens per sample", "", *facts, "",
                *table(["model", "global batch", "worker size", "plan", "cuts", "workers", "worker memory",
                        "whole model on one worker", "co-opt", "iteration", "$ / iteration", "dry run"]), *rows[seq_len]]
    out += ["", PAPERS, f"Beside FuncPipe's 263 MB of activations per sample for BERT-Large (Table 1; its sequence "
            f"length is not stated), the estimate here keeps {' and '.join(beside)}, the loss's [T, V] logits and "
            "log-softmax included; its parameters (1,153 MB) are fewer than the untied registry model's, whose "
            "head and embedding hold 30522 x 1024 weights each. Hydrozoa's BERT-12 (108.9M) is the registry's "
            "`bert_base` with the head tied to the embedding; untied, as planned here, it has 23.4M more "
            "parameters (the head's weights)."]
    return "\n".join(out)


PARTS = {"a": part_a, "b": part_b, "c": part_c}
"""The benchmark's parts by letter, each a function of the parsed arguments returning its section's
markdown (a: `benchmarks/lm_sync.py`, b: `benchmarks/lm_plain.py`); a run rewrites the sections of the
parts it ran and keeps the others' last ones (`benchmarks.harness.tables.merged_body`)."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=sorted(PARTS), nargs="+", default=sorted(PARTS),
                        help="the parts to run (default: all); the results file holds the parts that ran")
    parser.add_argument("--seq-len", type=int, nargs="+", default=None,
                        help=f"tokens per sample (part c: {' and/or '.join(map(str, DATASETS))}, default 128; "
                             "part b: the first, default 128)")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS, help="part c's models")
    parser.add_argument("--batches", type=int, nargs="+", default=list(GLOBAL_BATCHES), help="part c's global batches")
    add_sync_arguments(parser)
    add_plain_arguments(parser)
    parser.add_argument("--out", type=Path, default=None,
                        help=f"default {RESULTS.name}, or {RESULTS_GPU.name} for part b with --device cuda")
    args = parser.parse_args(argv)
    prov = provenance()
    out = args.out or (RESULTS_GPU if args.device == "cuda" and args.part == ["b"] else RESULTS)
    body = merged_body(out, {part: PARTS[part](args) for part in args.part})  # the other parts' last sections kept
    write_result(out, TITLE, command_for("benchmarks.bench_language_models", argv), prov, body,
                 detail="each part's section says how it ran; part c plans on the catalog's figures, renting "
                        "and running nothing on the sizes it prices")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
