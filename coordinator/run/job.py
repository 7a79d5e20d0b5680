"""The job a user asks for (`TrainJob`) and what a run reports back (`RunSummary`).

Both are pydantic models at the Prefect boundary: `TrainJob` becomes the form in the Prefect
UI and is validated (types, ranges, NaN) before anything is provisioned; the deeper checks
that need the model registry, the dataset or the store live in `coordinator.run.validate`.

`TrainJob` is flat (one form entry and one `--param` per field) and made of sections, one
concern each: small models (`JobSection`) whose fields carry the title and description the
form shows. The form and `flows.train.train_with_params` list the fields in this order:

| section | fields | what it says |
|---|---|---|
| `ModelAndData` | model, dataset, loss, tokenizer, objective, seq_len, seed | what to train, on what, from which seed |
| `Optimization` | epochs, batch_size, lr, optimizer | each replica's training loop |
| `Parallelism` | strategy, workers, stages, microbatches, pipeline_schedule | replicas, pipeline stages, their schedule |
| `Sync` | sync_period, collective, outer_optimizer, outer_lr, outer_momentum, sync_checkpoint_s, sync_dtype | how Local-SGD replicas meet |
| `Scaling` | scaling, scale_every_epochs, min_workers, max_workers | the worker count between epochs |
| `TargetAndStore` | store, durable_store, target, worker_vcpu, worker_memory_gb, offer, capacity, spot_preemptions_before_on_demand, spot_spares | where workers run and tensors live |
| `BudgetAndStopping` | budget_usd, deadline_s, target_accuracy, target_loss | when a run ends before its last epoch |
| `WorkersLife` | prestart, resume, warm, worker_lease_s, keep_checkpoints, worker_timeout_s | workers' start, lease, stall; checkpoints |

A check that reads one field lives on its section; those that read several, on `TrainJob`.
"""
from __future__ import annotations

import json
import math
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from core.epoch_summary import EpochSummary
from core.kinds import AUTO, BUILTIN_TARGETS, PIPELINED_STRATEGIES, Capacity, PipelineSchedule, Strategy, choices

StrategyName = choices(*Strategy)
ScheduleName = choices(AUTO, *PipelineSchedule)
CapacityName = choices(*Capacity)
Optimizer = Literal["sgd", "momentum", "adam"]
ScalingPolicy = Literal["static", "adabatch", "reactive", "deadline"]


class JobSection(BaseModel):
    """One concern of a `TrainJob`; its fields are the job's own (flat), each with the title and
    description that the UI form shows."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelAndData(JobSection):
    """What to train, on what data, and the seed that fixes both."""

    model: str = Field("digits_mlp", title="Model",
                       description="Registry name (digits_mlp, digits_cnn, resnet18, vgg11) or `package.module:factory` returning an nn.Module.")
    dataset: str = Field("digits", title="Dataset",
                         description="`digits` (scikit-learn), `synthetic:CxHxW:classes:samples`, `package.module:factory`, or "
                                     "`text:SOURCE` for a language model: a path, file://, s3://, az://, a store block, "
                                     "or `stdlib` (Python's standard-library source, shipped); or a dataset prepared "
                                     "in a bucket (`python -m flows.prepare`): its file://, s3:// or az:// URL, or "
                                     "`block:<type>/<name>`.")
    loss: Optional[str] = Field(
        None, title="Loss",
        description="`package.module:function(output, target) -> scalar` for any other objective; null: "
                    "cross-entropy over the output's last dimension, against class labels [B] or a target "
                    "per position [B, ...] (positions whose target is -100 are ignored).")
    tokenizer: str = Field("bytes", title="Tokenizer",
                           description="For `text:` datasets: `bytes`, or `bpe:<vocab size>` (trained on the corpus, cached).")
    objective: Literal["causal", "mlm"] = Field(
        "causal", title="Language-model objective",
        description="For `text:` datasets: `causal` (next-token targets) or `mlm` (BERT's 15 % masking, fresh each epoch).")
    seq_len: int = Field(128, gt=1, title="Sequence length", description="Tokens per sample for `text:` datasets.")
    seed: int = Field(0, ge=0, title="Seed",
                      description="Seed of the model's initial weights, the dealing of data subsets to workers and the batch order.")
    data_cache_mb: Optional[float] = Field(
        None, gt=0, allow_inf_nan=False, title="Data cache (MB)",
        description="The most MB of data shards a worker keeps in memory between reads (least recently used "
                    "out first); null: all it reads (a warm worker then reads each shard once per run).")

    @field_validator("model", "dataset")
    @classmethod
    def _not_blank(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must not be empty")
        return v.strip()


class Optimization(JobSection):
    """The training loop each replica runs: how long, in what steps, with which optimizer."""

    epochs: int = Field(5, gt=0, title="Epochs", description="Epochs to train (fewer when a target is reached).")
    batch_size: int = Field(16, gt=0, title="Batch size", description="Samples per optimizer step on each replica.")
    lr: float = Field(0.05, gt=0, allow_inf_nan=False, title="Learning rate",
                      description="The optimizer's step size (`adabatch` scales it by 0.75 per doubling of the workers).")
    optimizer: Optimizer = Field("momentum", title="Optimizer", description="`sgd`, `momentum` (0.9) or `adam`.")


class Parallelism(JobSection):
    """How the work is split: data-parallel replicas, pipeline stages, and their schedule."""

    strategy: StrategyName = Field("auto", title="Strategy",
                                   description="`auto` plans from the profile; `local_sgd`, `pipeline` or `hybrid` force one.")
    workers: int = Field(4, gt=0, title="Workers", description="Data-parallel replicas in the first epoch.")
    stages: Optional[int] = Field(None, gt=0, title="Pipeline stages", description="Stages per replica (pipeline/hybrid); null lets the planner choose.")
    microbatches: Optional[int] = Field(None, gt=0, title="Micro-batches", description="Micro-batches per iteration (pipeline/hybrid).")
    pipeline_schedule: ScheduleName = Field(
        "auto", title="Pipeline schedule",
        description="`gpipe` (all forwards, then all backwards: every micro-batch's activations held), `1f1b` "
                    "(one forward, one backward: stage s holds at most stages - s), `interleaved` (1F1B over "
                    "2 model chunks per worker: a smaller bubble, more transfers; micro-batches a multiple of "
                    "the stages), or `auto`: the fastest predicted of those whose stages fit the worker's memory.")


class Sync(JobSection):
    """How Local-SGD replicas meet: how often, over which collective, with which outer step, in
    which dtype."""

    sync_period: Optional[int] = Field(None, gt=0, title="Local-SGD period k",
                                       description="Steps between model averages; null averages once per epoch.")
    collective: Literal["store", "ring", "auto"] = Field(
        "store", title="Collective",
        description="How Local-SGD replicas average: `store` (scatter-reduce through the store; a dead "
                    "worker is relaunched alone), `ring` (direct ring allreduce between the workers, over TCP on "
                    "CPU and NCCL on CUDA, when workers can reach each other; a failure reruns the epoch) or `auto` "
                    "(the planner compares both by epoch time and dollars, the store's requests included; the "
                    "ring only where it may run: float32 syncs, workers on this machine, on-demand workers).")
    outer_optimizer: Literal["average", "nesterov"] = Field(
        "average", title="Outer optimizer",
        description="What a Local-SGD sync does with the replicas' weights: `average` (K-AVG) or `nesterov` "
                    "(DiLoCo: the round's mean change is an outer gradient for a Nesterov step).")
    outer_lr: Optional[float] = Field(
        None, gt=0, allow_inf_nan=False, title="Outer learning rate",
        description="The `nesterov` outer step's learning rate (1 with momentum 0 is `average`); null: "
                    "follows the sync period (DiLoCo's 0.7; with only outer_momentum set, 1 - outer_momentum: "
                    "core.outer_defaults).")
    outer_momentum: Optional[float] = Field(
        None, ge=0, lt=1, allow_inf_nan=False, title="Outer momentum",
        description="The `nesterov` outer step's momentum; null: follows the sync period (core.outer_defaults: "
                    "0.3 from 4 steps a round, K-AVG's gain 0.7 / (1 - 0.3) = 1; less below: 0.09 at 1; a round is "
                    "the epoch when sync_period is null). Explicit values are kept, with a warning when they "
                    "exceed what the period bears.")
    sync_checkpoint_s: Optional[float] = Field(
        None, ge=0, allow_inf_nan=False, title="Seconds between sync checkpoints",
        description="Local-SGD over the store: rank 0 writes a sync checkpoint (what a worker lost with nothing "
                    "handed over resumes from) at the first round this many seconds after the last, and at each "
                    "epoch's last round (a bfloat16 or int8 sync: every as many rounds as this holds at the plan's "
                    "pace, each rank writing its residual); 0: every round; null: the plan's interval, which weighs "
                    "a checkpoint's cost against the work an expected crash loses (Young's interval).")
    sync_dtype: Literal["float32", "bfloat16", "int8"] = Field(
        "float32", title="Sync dtype",
        description="What syncs move through the store: `float32`, `bfloat16`, or `int8` (per-block scaled); "
                    "compressed syncs carry the rounding error to the next sync (error feedback).")


class Scaling(JobSection):
    """How the worker count changes between epochs, and its bounds."""

    scaling: ScalingPolicy = Field("static", title="Scaling policy", description="How the worker count changes between epochs.")
    scale_every_epochs: int = Field(1, gt=0, title="Epochs between doublings (adabatch)",
                                    description="For `adabatch`: epochs between doublings of the workers (up to max_workers).")
    min_workers: int = Field(1, gt=0, title="Minimum workers",
                             description="The fewest data-parallel replicas a scaling policy shrinks to.")
    max_workers: int = Field(8, gt=0, title="Maximum workers",
                             description="The most data-parallel replicas a scaling policy grows to.")


class TargetAndStore(JobSection):
    """Where the workers run, their size and price, and where tensors and checkpoints live."""

    store: str = Field("", title="Store",
                       description="Store block name or URL (file://..., redis://..., s3://bucket/prefix); empty: the local directory store.")
    durable_store: str = Field("", title="Durable store",
                               description="Where checkpoints, data subsets and ledgers live; empty: the store itself, "
                                           "or the local directory store when the store is Redis.")
    target: str = Field("inline", title="Compute target",
                        description="`inline` (processes started by the coordinator), `local` (the process work pool), `docker` (containers on a Docker-API engine: podman here), `ecs`, `aci`, `k8s`, or a ComputeTarget block name.")
    worker_vcpu: Optional[float] = Field(None, gt=0, allow_inf_nan=False, title="vCPU per worker",
                                         description="Overrides the compute target's worker size.")
    worker_memory_gb: Optional[float] = Field(None, gt=0, allow_inf_nan=False, title="Memory per worker (GB)",
                                              description="Overrides the compute target's worker size; a plan whose stage does not fit is refused.")
    offer: Optional[str] = Field(None, title="Billing offer",
                                 description="Price-catalog offer the workers are billed as; null: the target's default (local targets: an ACI CPU container).")
    capacity: CapacityName = Field(
        "on_demand", title="Capacity",
        description="`on_demand`, `spot` (spare capacity at a discount, taken back after a notice: Fargate Spot on "
                    "`ecs` and `docker`, ACI Spot on `aci`, a spot node pool on `k8s`; refused where the target has "
                    "no spot offer) or `auto` (the planner prices the expected re-done work of preemptions against "
                    "the discount and picks the cheaper).")
    spot_preemptions_before_on_demand: int = Field(
        2, ge=0, title="Spot preemptions before on-demand",
        description="A spot worker preempted this many times in one epoch is replaced on on-demand capacity "
                    "(before that, on spot again; 0: every replacement on-demand).")
    spot_spares: int = Field(
        0, ge=0, le=64, title="Spot spares",
        description="Warm spot workers kept ready beside the plan's: a preempted worker's rank goes to one at once "
                    "(its start-up already paid; a new spare starts in its place) instead of waiting for a new "
                    "worker to start. Billed like any worker, and priced in the plan's spot bill; refused with "
                    "capacity on_demand.")

    @field_validator("target")
    @classmethod
    def _target_name(cls, v: str) -> str:
        v = v.strip()
        if not v:
            raise ValueError(f"must be one of {', '.join(BUILTIN_TARGETS)} or a ComputeTarget block name")
        return v


class BudgetAndStopping(JobSection):
    """When a run ends before its last epoch: a limit it would pass, or a target it reached."""

    budget_usd: Optional[float] = Field(None, gt=0, allow_inf_nan=False, title="Budget (USD)",
                                        description="Stop (status budget_exhausted) before the next epoch would spend past it.")
    deadline_s: Optional[float] = Field(None, gt=0, allow_inf_nan=False, title="Deadline (s)",
                                        description="Seconds from the run's start; stop (status deadline_reached) before the "
                                                    "next epoch would end past it. Required by scaling=deadline.")
    target_accuracy: Optional[float] = Field(None, gt=0, le=1, allow_inf_nan=False, title="Target validation accuracy",
                                             description="Stop early (status target_reached) once reached.")
    target_loss: Optional[float] = Field(None, gt=0, allow_inf_nan=False, title="Target validation loss",
                                         description="Stop early (status target_reached) once the validation loss is at most this.")


class WorkersLife(JobSection):
    """The workers' life: started early, kept warm under a lease, replaced when stalled; and what
    outlives them (the checkpoints kept, a run resumed from them)."""

    prestart: bool = Field(True, title="Pre-start workers",
                           description="Launch the next epoch's workers before this one ends, to hide their start-up.")
    resume: Optional[str] = Field(None, title="Resume run",
                                  description="Run id to continue from its last complete checkpoint.")
    warm: bool = Field(True, title="Warm workers",
                       description="Keep one worker per rank alive across epochs (it imports, builds the model and "
                                   "loads its data once); false starts new workers every epoch.")
    worker_lease_s: float = Field(60.0, gt=0, allow_inf_nan=False, title="Worker lease (s)",
                                  description="A warm worker whose coordinator has not renewed the run's lease "
                                              "for this long stops by itself.")
    keep_checkpoints: int = Field(3, ge=1, title="Checkpoints kept",
                                  description="Epoch checkpoints kept (the last N, and the best by validation "
                                              "loss when a target is set); older ones are deleted.")
    worker_timeout_s: float = Field(900.0, gt=0, allow_inf_nan=False, title="Worker timeout (s)",
                                    description="A worker that shows no progress for this long is stopped and replaced.")


SECTIONS: tuple[type[JobSection], ...] = (ModelAndData, Optimization, Parallelism, Sync, Scaling, TargetAndStore,
                                          BudgetAndStopping, WorkersLife)
"""The job's sections in the order the form and `train_with_params` list their fields."""


# pydantic orders a model's fields from its last base to its first: the bases are named last section first
class TrainJob(WorkersLife, BudgetAndStopping, TargetAndStore, Scaling, Sync, Parallelism, Optimization,
               ModelAndData):
    """One training job: what to train, how to split it, where to run it, and its limits."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="after")
    def _worker_bounds(self) -> "TrainJob":
        # (the checks that read several fields, in this order: a job with several problems gets the first's line)
        if self.scaling == "deadline" and self.deadline_s is None:
            raise ValueError("deadline_s: required by scaling=deadline")
        if self.outer_optimizer == "nesterov" and self.strategy in PIPELINED_STRATEGIES:
            raise ValueError(f"outer_optimizer: nesterov steps over Local-SGD rounds; strategy {self.strategy} "
                             "averages gradients every step (use local_sgd or auto)")
        if self.sync_dtype == "int8" and self.optimizer == "adam":
            raise ValueError("sync_dtype: int8 rounds Adam's second moments on a per-block scale, which can turn "
                             "them negative; use bfloat16 with adam")
        if self.sync_dtype != "float32" and self.collective == "ring":
            raise ValueError("sync_dtype: compressed syncs go through the store; collective ring moves float32")
        if self.min_workers > self.max_workers:
            raise ValueError(f"min_workers: {self.min_workers} must be <= max_workers ({self.max_workers})")
        if not self.min_workers <= self.workers <= self.max_workers:
            raise ValueError(f"workers: {self.workers} must lie within min_workers..max_workers "
                             f"({self.min_workers}..{self.max_workers})")
        return self


class RunSummary(BaseModel):
    """What a run reports: status, final metrics, the plan, the history and the bill."""

    run_id: str
    status: str
    """`completed`, `target_reached`, `budget_exhausted`, `deadline_reached`, `failed` or `cancelled`."""
    final_loss: Optional[float] = None
    final_accuracy: Optional[float] = None
    final_perplexity: Optional[float] = None
    """Token targets: the last epoch's validation perplexity."""
    final_token_accuracy: Optional[float] = None
    tokens_trained: int = 0
    """Token targets: tokens trained over the run (`core.epoch_summary.run_token_figures`)."""
    tokens_per_s: Optional[float] = None
    usd_per_million_tokens: Optional[float] = None
    """The whole bill over the tokens trained, per million."""
    total_cost_usd: float = 0.0
    plan: dict[str, Any] = Field(default_factory=dict)
    epochs: list[EpochSummary] = Field(default_factory=list)
    store_url: str = ""
    checkpoint_key: str = ""
    worker_seconds: dict[str, float] = Field(default_factory=dict)
    """Worker-seconds billed, by what they paid for (`coordinator.bill.cost.worker_seconds`)."""
    spot: dict[str, Any] = Field(default_factory=dict)
    """What spot capacity did (`coordinator.bill.cost.spot_tally`): preemptions, the seconds of work
    redone, spot worker-seconds, the interruption rate and the dollars saved against on-demand."""
    error: Optional[str] = None


def format_validation_error(err: ValidationError) -> str:
    """One line naming the first offending field, e.g. `workers: Input should be ...`."""
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first.get("loc", ())) or "job"
    msg = first.get("msg", "invalid value")
    if first.get("type") == "extra_forbidden":
        msg = f"unknown parameter; valid: {', '.join(TrainJob.model_fields)}"
    if not first.get("loc"):
        # model-level validators name their field at the start of the message
        return msg.removeprefix("Value error, ")
    return f"{loc}: {msg.removeprefix('Value error, ')}"


def parse_param_value(text: str) -> Any:
    """`--param name=value` values: JSON where it parses (numbers, null, true), else the string."""
    try:
        value = json.loads(text)
    except ValueError:
        lowered = text.strip().lower()
        if lowered in ("nan", "+nan", "-nan"):
            return math.nan
        if lowered in ("inf", "+inf", "infinity", "-inf", "-infinity"):
            return -math.inf if lowered.startswith("-") else math.inf
        return text
    return value
