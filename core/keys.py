"""The store's key layout: the one module that spells where each key lives.

Every key of a run lives under `runs/<run_id>/` (DESIGN.md, Rules of the road); the profile
cache lives under `cache/` because it outlives runs. Every other module builds its keys with
the functions here (`tests/test_keys.py` fails when another module spells `runs/`), so the
layout changes in one place or not at all: stored runs are read back, and resumed, by these
same strings.

Prefixes are returned without a trailing `/` unless their name says otherwise; list or delete
below one with `prefix + "/"`, so that `r1` never covers `r10`.

| key | teardown | what |
|---|---|---|
| `runs/<run>/run.json` | keeps | the job, plan and dataset the run started with |
| `runs/<run>/summary.json` | keeps | the run's `RunSummary` |
| `runs/<run>/cost.json` | keeps | the ledger (`coordinator.bill.cost`) |
| `runs/<run>/history.json` | keeps | the per-epoch history; its last epoch names the checkpoint a resume goes on from (`coordinator.run.resume`) |
| `runs/<run>/report/<name>` | keeps | report files (the curves' PNG) |
| `runs/<run>/ckpt/init.safetensors` | keeps | the reference checkpoint epoch 0 starts from |
| `runs/<run>/ckpt/epoch-<EEEE>.safetensors` | keeps | an epoch's checkpoint |
| `runs/<run>/ckpt/sync-e<E>.safetensors` | keeps | the latest Local-SGD sync point of epoch E |
| `runs/<run>/ckpt/best.json` | keeps | the pointer to the best epoch checkpoint (a job with a target) |
| `runs/<run>/ckpt/residual/e<E>/r<R>/round<N>.safetensors` | keeps | error-feedback residuals |
| `runs/<run>/history/e<E>/r<R>-a<A>.json` | records | what one worker attempt trained |
| `runs/<run>/faults/e<E>-r<R>-a<A>.json` | records | an injected fault's marker (`engine.chaos`) |
| `runs/<run>/faults/held-e<E>-r<R>-a<A>.json` | records | a held worker's event |
| `runs/<run>/faults/preempted-e<E>-r<R>-a<A>.json` | records | a preempted worker's marker (`engine.preemption`) |
| `runs/<run>/ckpt/handover/e<E>/r<R>.safetensors` | keeps | a preempted replica's handover checkpoint |
| `runs/<run>/sync/e<E>[/s<S>]/...` | deletes | Local-SGD syncs (per model stage in a pipeline) |
| `runs/<run>/act/e<E>/r<replica>/...` | deletes | a pipeline's activations and gradients |
| `runs/<run>/data/{train,val}/<i>`, `data/manifest.json` | deletes | the staged data subsets |
| `runs/<run>/probe/...` | deletes | the store probe's transfers |
| `runs/<run>/grad/...` | deletes | gradients in flight |
| `runs/<run>/warm/lease`, `warm/<worker>/{cmd,reply}-<n>.json`, `status.json`, `release` | deletes | `runtime.warm` |
| `cache/<kind>/<key>.json` | keeps | the profile cache (`coordinator.plan.profile_cache`) |
| `cache/tokenizers/<corpus sha256>-<settings>.json` | keeps | a trained BPE tokenizer's JSON (`engine.text_data`) |
| `[<prefix>/]{train,val}/<i>`, `[<prefix>/]manifest.json` | the user's | a dataset prepared into a bucket (`engine.shards`, `flows.prepare`): at a store's root, or a run's staged data above |

Teardown deletes the `SCRATCH` kinds (`scratch_prefixes`) and keeps the rest. The workers'
`RECORDS` live on the run's store, beside their tensors (the coordinator reads them as each
epoch ends; on a durable store each would cost a billed put, listing and read): kept where that
store is the durable one, deleted with the scratch where it is another (Redis). Keys below a
prefix that one protocol owns alone (a collective's pieces under its group, a pipeline
replica's tensors under its prefix, the store probe's samples) are spelt by that protocol,
relative to the prefix it is given here.
"""
from __future__ import annotations

import re

RUNS = "runs"
"""The top-level folder of every run's keys."""

CACHE_ROOT = "cache"
"""The top-level folder of the profile cache (not under a run: a cache outlives runs)."""

SCRATCH = ("sync", "act", "data", "probe", "grad", "warm")
"""The scratch kinds directly under a run: teardown deletes them, and keeps checkpoints,
history, faults, summary, ledger and report."""

STAGED = ("data",)
"""The scratch kinds written on the durable store (the staged dataset), the only ones there
where the run's store is another."""

RECORDS = ("history", "faults")
"""The workers' records directly under a run, written on the run's store: kept where that is
the durable store, deleted at teardown where it is another (`scratch_prefixes`)."""

# --- the run --------------------------------------------------------------------------


def run_prefix(run_id: str) -> str:
    """`runs/<run_id>`: every key of the run is below it."""
    return f"{RUNS}/{run_id}"


def run_key(run_id: str, *parts: str) -> str:
    """`runs/<run_id>/<part>/<part>...`: a key below the run (`run_key(r)` is `run_prefix(r)`)."""
    return "/".join((run_prefix(run_id),) + parts)


def run_doc_key(run_id: str) -> str:
    """The run's start document: job, plan, target, dataset (`tasks.provision`)."""
    return run_key(run_id, "run.json")


def summary_key(run_id: str) -> str:
    """The run's summary (`RunSummary`, or the failure hooks' stand-in)."""
    return run_key(run_id, "summary.json")


def ledger_key(run_id: str) -> str:
    """The run's ledger: cost rows and total (`coordinator.bill.cost`)."""
    return run_key(run_id, "cost.json")


def history_key(run_id: str) -> str:
    """The run's per-epoch history (`coordinator.run.resume.write_history`)."""
    return run_key(run_id, "history.json")


def report_key(run_id: str, name: str) -> str:
    """A file of the run's report, e.g. `curves.png`."""
    return run_key(run_id, "report", name)


# --- checkpoints (durable) ------------------------------------------------------------


def checkpoint_prefix(run_id: str) -> str:
    """Every checkpoint of the run: epoch, sync and initial checkpoints, pointers, residuals."""
    return run_key(run_id, "ckpt")


def init_checkpoint_key(run_id: str) -> str:
    """The reference checkpoint epoch 0 starts from."""
    return run_key(run_id, "ckpt", "init.safetensors")


def checkpoint_key(run_id: str, epoch: int) -> str:
    """Epoch `epoch`'s reference checkpoint (written by rank 0 or the last model stage)."""
    return run_key(run_id, "ckpt", f"epoch-{epoch:04d}.safetensors")


def sync_checkpoint_key(run_id: str, epoch: int) -> str:
    """Durable key of epoch `epoch`'s sync checkpoint (the latest sync point's state)."""
    return run_key(run_id, "ckpt", f"sync-e{epoch}.safetensors")


def best_key(run_id: str) -> str:
    """The pointer to the best epoch checkpoint by validation loss."""
    return run_key(run_id, "ckpt", "best.json")


def residual_prefix(run_id: str, epoch: int, rank: int) -> str:
    """Durable prefix of one rank's error-feedback residuals in one epoch; ends with `/`."""
    return run_key(run_id, "ckpt", "residual", f"e{epoch}", f"r{rank}") + "/"


def residual_key(run_id: str, epoch: int, rank: int, round_: int) -> str:
    """Durable key of rank `rank`'s residual after round `round_` of `epoch`."""
    return f"{residual_prefix(run_id, epoch, rank)}round{round_}.safetensors"


EPOCH_CHECKPOINT = re.compile(r"/ckpt/epoch-(\d+)\.safetensors$")
"""Matches an epoch checkpoint's key (`checkpoint_key`); group 1: the epoch."""
SYNC_CHECKPOINT = re.compile(r"/ckpt/sync-e(\d+)\.safetensors$")
"""Matches a sync checkpoint's key (`sync_checkpoint_key`); group 1: the epoch."""
RESIDUAL = re.compile(r"/ckpt/residual/e(\d+)/")
"""Matches a residual's key (`residual_key`); group 1: the epoch."""


# --- worker attempts (the run's store: `RECORDS`) ---------------------------------------------------------


def worker_history_prefix(run_id: str, epoch: int) -> str:
    """Every worker attempt's record of `epoch`; ends with `/`."""
    return run_key(run_id, "history", f"e{epoch}") + "/"


def worker_history_key(run_id: str, epoch: int, rank: int, attempt: int) -> str:
    """The record of what one worker attempt trained (on the run's store)."""
    return f"{worker_history_prefix(run_id, epoch)}r{rank}-a{attempt}.json"


def faults_prefix(run_id: str) -> str:
    """The run's fault markers and held-worker events (`engine.chaos`)."""
    return run_key(run_id, "faults")


def fault_marker_key(run_id: str, epoch: int, rank: int, attempt: int) -> str:
    """Where a worker records the fault injected into it before it dies."""
    return run_key(run_id, "faults", f"e{epoch}-r{rank}-a{attempt}.json")


def held_marker_key(run_id: str, epoch: int, rank: int, attempt: int) -> str:
    """The event a `hold_worker` fault writes before it waits."""
    return run_key(run_id, "faults", f"held-e{epoch}-r{rank}-a{attempt}.json")


def preempted_marker_key(run_id: str, epoch: int, rank: int, attempt: int) -> str:
    """Where a worker that got the provider's notice records how it left (`engine.preemption`)."""
    return run_key(run_id, "faults", f"preempted-e{epoch}-r{rank}-a{attempt}.json")


def handover_prefix(run_id: str, epoch: int) -> str:
    """Every preempted replica's handover checkpoint of `epoch`. Delete it before starting or
    rerunning the whole epoch, as its sync keys."""
    return run_key(run_id, "ckpt", "handover", f"e{epoch}")


def handover_key(run_id: str, epoch: int, rank: int) -> str:
    """Replica `rank`'s handover checkpoint of `epoch`: its own state at the step boundary where
    it left on notice, which its replacement continues (`engine.local_sgd_epoch`)."""
    return f"{handover_prefix(run_id, epoch)}/r{rank}.safetensors"


def attempt_of(key: str, epoch: int) -> int | None:
    """The attempt number in a worker history record or a fault marker of `epoch`
    (`worker_history_key`, `fault_marker_key`), or None for any other key."""
    m = re.search(rf"e{epoch}[-/]r\d+-a(\d+)\.json$", key)
    return int(m.group(1)) if m else None


# --- scratch --------------------------------------------------------------------------


def sync_prefix(run_id: str, epoch: int) -> str:
    """Key prefix of an epoch's Local-SGD syncs (a replica's `spec.sync.group` when it names
    none). Delete it before starting or resuming the whole epoch; never while some of its
    replicas still run (`engine.local_sgd`)."""
    return run_key(run_id, "sync", f"e{epoch}")


def stage_sync_prefix(run_id: str, epoch: int, stage: int) -> str:
    """Key prefix of one model stage's gradient syncs in a pipeline's epoch."""
    return f"{sync_prefix(run_id, epoch)}/s{stage}"


def sync_call_prefix(group: str, round_: int, bucket: int | None = None) -> str:
    """Key prefix of one collective call of a sync group (`sync_prefix`, `stage_sync_prefix`
    or `spec.sync.group`): round `round_`, or bucket `bucket` of that round when gradients
    are averaged in buckets (`engine.gradient_buckets`)."""
    prefix = f"{group}/r{round_}"
    return prefix if bucket is None else f"{prefix}/b{bucket}"


def activation_prefix(run_id: str, epoch: int) -> str:
    """Scratch prefix of an epoch's inter-stage tensors (delete it before relaunching)."""
    return run_key(run_id, "act", f"e{epoch}")


def activation_replica_prefix(run_id: str, epoch: int, replica: int) -> str:
    """Scratch prefix of one pipeline replica's tensors in an epoch."""
    return f"{activation_prefix(run_id, epoch)}/r{replica}"


def data_prefix(run_id: str) -> str:
    """Key prefix of a run's staged data."""
    return run_key(run_id, "data")


def data_split_prefix(run_id: str, split: str) -> str:
    """Key prefix of one split's subsets (`train` or `val`)."""
    return shard_split_prefix(data_prefix(run_id), split)


def data_subset_key(run_id: str, split: str, index: int) -> str:
    """Subset `index` of `split`."""
    return shard_key(data_prefix(run_id), split, index)


def data_manifest_key(run_id: str) -> str:
    """The staged data's manifest (written last: its presence means every subset is readable)."""
    return shard_manifest_key(data_prefix(run_id))


# A prepared dataset (`engine.shards`): shards and a manifest under one prefix of any store; a
# run's staged data is the one prepared under `runs/<run>/data`, a bucket's is at its root ("").

def _under(prefix: str, rest: str) -> str:
    return f"{prefix}/{rest}" if prefix else rest


def shard_split_prefix(prefix: str, split: str) -> str:
    """Key prefix of one split's shards (`train` or `val`) of the dataset at `prefix`."""
    return _under(prefix, split)


def array_split_prefix(prefix: str, split: str) -> str:
    """Key prefix of one split's files (`train/`, `val/`) of a files-of-arrays source at `prefix`
    (`engine.array_source`), ending in `/`."""
    return _under(prefix, f"{split}/")


def shard_key(prefix: str, split: str, index: int) -> str:
    """Shard `index` of `split` of the dataset at `prefix`."""
    return f"{shard_split_prefix(prefix, split)}/{int(index)}"


def shard_manifest_key(prefix: str) -> str:
    """The manifest of the dataset at `prefix` (written last: its presence means every shard is
    readable)."""
    return _under(prefix, "manifest.json")


def probe_prefix(run_id: str) -> str:
    """Where the store probe of a run's profile puts (and deletes) its samples."""
    return run_key(run_id, "probe")


def warm_prefix(run_id: str) -> str:
    """The warm workers' commands, replies, status and lease (`runtime.warm`)."""
    return run_key(run_id, "warm")


def lease_key(run_id: str) -> str:
    """The coordinator's lease, renewed while the run lives."""
    return f"{warm_prefix(run_id)}/lease"


def command_key(run_id: str, worker: str, seq: int) -> str:
    """Warm worker `worker`'s `seq`-th command."""
    return f"{warm_prefix(run_id)}/{worker}/cmd-{seq:05d}.json"


def reply_key(run_id: str, worker: str, seq: int) -> str:
    """Warm worker `worker`'s reply to its `seq`-th command."""
    return f"{warm_prefix(run_id)}/{worker}/reply-{seq:05d}.json"


def status_key(run_id: str, worker: str) -> str:
    """Warm worker `worker`'s status, rewritten once a second."""
    return f"{warm_prefix(run_id)}/{worker}/status.json"


def release_key(run_id: str, worker: str) -> str:
    """Written by the pool when the successor of warm worker `worker`, which got the provider's
    notice and works through it, is ready: the worker hands over and leaves (`engine.preemption`)."""
    return f"{warm_prefix(run_id)}/{worker}/release"


def scratch_prefixes(run_id: str, role: str = "both") -> tuple[str, ...]:
    """The prefixes teardown deletes on a store of `role`, each ending with `/`: `both` (the
    run's store is its durable one) one per `SCRATCH` kind; `store` (a run's store that is not
    its durable one) one per `SCRATCH` and `RECORDS` kind; `durable` (a durable store that is
    not the run's store) one per `STAGED` kind, all the scratch written there (a durable store
    bills each listing)."""
    kinds = {"both": SCRATCH, "store": SCRATCH + RECORDS, "durable": STAGED}[role]
    return tuple(run_key(run_id, kind) + "/" for kind in kinds)


# --- the profile cache (durable, outside every run) ------------------------------------


def cache_prefix(kind: str) -> str:
    """Every cached document of `kind` (`targets`, `models`, ...); ends with `/`."""
    return f"{CACHE_ROOT}/{kind}/"


def cache_key(kind: str, key: str) -> str:
    """The cached document `key` of `kind`."""
    return f"{cache_prefix(kind)}{key}.json"


def tokenizer_key(corpus_sha256: str, settings: str) -> str:
    """A tokenizer trained on the corpus whose content hash is `corpus_sha256` with `settings`
    (e.g. `bpe8000-bytelevel-v1`): its JSON, kept across runs like the profile cache."""
    return cache_key("tokenizers", f"{corpus_sha256}-{settings}")


def artifact_key(run_id: str, what: str) -> str:
    """The Prefect artifact key of a run's `what` (report, ledger, ...): Prefect allows lowercase
    letters, digits and dashes."""
    return f"zooid-{what}-{run_id}".lower().replace("_", "-")
