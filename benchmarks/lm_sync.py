"""Part a of `benchmarks.bench_language_models`: sync methods on the real corpus.

`gpt_mini` on `text:stdlib:<KB>` (the shipped corpus, bytes tokenizer, causal blocks), 2 workers on
the local pool, strategy `local_sgd`, SGD with momentum (int8 syncs refuse Adam, so every row
trains with the same inner optimizer): every-step averaging (k = 1, gradients averaged in
buckets), K-AVG at k = `--sync-k`, DiLoCo (outer Nesterov) at k = `--diloco-k` syncing float32
and int8; each through the stack's directory store and, with `--sync-stores` naming it, through S3
(a moto server on 127.0.0.1, K-AVG and the DiLoCo rows that move at most half its bytes). Each
configuration is a `train/local` flow run on one local stack
(`benchmarks.harness.stack.local_stack`, `pool_trace`) for a fixed number of epochs, once per
seed of `--sync-seeds`: round i runs every configuration with the i-th seed, round-robin, every
other round reversed (`benchmarks.harness.tables.rounds`); every figure comes from the runs' summary.json: validation perplexity, seconds (less the pool's
start-up), the slowest worker's compute and sync seconds, and bytes synced per epoch. DiLoCo's outer lr and momentum are the job's defaults (null: they follow the sync period,
`core.outer_defaults`), as a user who sets neither gets them.

The perplexity target is fixed by a rule stated before any DiLoCo row is read: the validation
perplexity K-AVG reaches at its second-to-last epoch, in each round its own (the seed moves every
curve: one seed alone decided the verdict at 6d9aaed, DiLoCo k=8 missing K-AVG's epoch-4 perplexity
by 0.002). Epochs, bytes and wall time to the target are summed over the epochs up to the first one
at or below it; the goal is judged on the medians over the rounds.
"""
from __future__ import annotations

import argparse
import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness.home import scratch
from benchmarks.harness.servers import moto_server, stop_server
from benchmarks.harness.stack import local_stack, pool_trace
from benchmarks.harness.tables import median, rounds, run_line, table
from benchmarks.output import command_for

WORKERS = 2
BATCH = 16
OPTIMIZER = "momentum"
MODEL = "gpt_mini"
KAVG = "K-AVG"
SEQ_LEN = 64
"""Part a's default tokens per block: gpt_mini's attention costs more than its MLPs beyond that."""
SEEDS = (0, 1, 2, 3, 4)
"""Part a's rounds: one seed each (the 6d9aaed file ran seed 0 three times)."""
DIRECTORY, S3 = "directory", "S3"
STORES = (DIRECTORY, S3)
"""Where the syncs go: the stack's directory store (local disk: a request costs a file's open and
rename, so bytes cost little), or S3 (a moto server on 127.0.0.1, reached over HTTP as a cloud run
reaches its bucket: every request pays a round trip and every byte crosses a socket)."""
BUCKET = "lm-sync"


def add_sync_arguments(parser: argparse.ArgumentParser) -> None:
    """Part a's options."""
    parser.add_argument("--sync-kb", type=int, default=200, help="part a: KB of text:stdlib")
    parser.add_argument("--sync-seq-len", type=int, default=SEQ_LEN, help="part a: tokens per block")
    parser.add_argument("--sync-epochs", type=int, default=5, help="part a: epochs of every run")
    parser.add_argument("--sync-lr", type=float, default=0.05, help="part a: the inner SGD's learning rate")
    parser.add_argument("--sync-k", type=int, default=8, help="part a: K-AVG's period")
    parser.add_argument("--diloco-k", type=int, default=32, help="part a: DiLoCo's period")
    parser.add_argument("--sync-stores", nargs="+", choices=STORES, default=list(STORES),
                        help="part a: where the syncs go; S3 runs K-AVG and the DiLoCo rows that move at most half "
                             "its bytes")
    parser.add_argument("--sync-seeds", type=int, nargs="+", default=list(SEEDS),
                        help="part a: one round per seed, every configuration once a round, round-robin (every "
                             "other round reversed)")


@dataclass(frozen=True)
class Config:
    """One row: its name, period, outer step, wire and the store its syncs go through."""

    name: str
    period: int
    outer: str
    dtype: str
    store: str = DIRECTORY

    @property
    def is_kavg(self) -> bool:
        return self.name.startswith(KAVG)


def seq_len(args: argparse.Namespace) -> int:
    """Tokens per block (`--sync-seq-len`)."""
    return args.sync_seq_len


def configs(args: argparse.Namespace) -> list[Config]:
    """K-AVG first: its run fixes the target before the DiLoCo rows exist. DiLoCo at its own
    longer period, and at K-AVG's (it sends the weights alone where K-AVG also averages the
    momentum buffers). Through S3 (when `--sync-stores` names it): K-AVG and the DiLoCo rows
    that can meet the goal's bytes (at most half K-AVG's: int8, or twice its period or more)."""
    rows = [Config(f"{KAVG} k={args.sync_k}", args.sync_k, "average", "float32"),
            Config("every step (k=1)", 1, "average", "float32")]
    for k in dict.fromkeys((args.diloco_k, args.sync_k)):
        rows += [Config(f"DiLoCo k={k}", k, "nesterov", "float32"), Config(f"DiLoCo k={k} int8", k, "nesterov", "int8")]
    if S3 in args.sync_stores:
        rows += [Config(f"{c.name} over S3", c.period, c.outer, c.dtype, S3) for c in rows
                 if c.is_kavg or (c.outer == "nesterov" and (c.dtype == "int8" or c.period >= 2 * args.sync_k))]
    return rows


def sync_params(args: argparse.Namespace, config: Config, seed: int, stores: dict[str, dict] | None = None) -> dict:
    """The `train/local` parameters (TrainJob fields) of one configuration's run; `stores`: the
    `store` and `durable_store` fields by `Config.store` (none: the stack's directory store)."""
    return {**(stores or {}).get(config.store, {}), "target": "local", "strategy": "local_sgd", "workers": WORKERS, "scaling": "static",
            "model": MODEL, "dataset": f"text:stdlib:{args.sync_kb}", "tokenizer": "bytes", "objective": "causal",
            "seq_len": seq_len(args), "epochs": args.sync_epochs, "batch_size": BATCH, "optimizer": OPTIMIZER,
            "lr": args.sync_lr, "seed": seed, "sync_period": config.period, "outer_optimizer": config.outer,
            "sync_dtype": config.dtype}


def reached(perplexity: list[float], target: float) -> int | None:
    """1-based epoch of the first perplexity at or below `target`, or None."""
    return next((i + 1 for i, p in enumerate(perplexity) if p <= target), None)


def run_order(args: argparse.Namespace) -> list[Config]:
    """The order of a round: on each store, K-AVG and DiLoCo at its period next to each other
    (the comparison the goal judges), then the other rows; `rounds` reverses it every other round."""
    rows = configs(args)
    near = [c for store in STORES for c in rows if c.store == store and c.period == args.sync_k]
    return near + [c for c in rows if c not in near]


@contextlib.contextmanager
def sync_stores(args: argparse.Namespace, home: Path) -> Iterator[dict[str, dict]]:
    """The `store` / `durable_store` fields of each store's runs, with an S3 server for the block
    when `--sync-stores` names it (its credentials in this process's environment, for the stack
    it starts: start the stack inside this block). The S3 runs keep their checkpoints, data,
    summary and ledger in the stack's directory store: only the syncs cross HTTP."""
    if S3 not in args.sync_stores:
        yield {}
        return
    proc, endpoint = moto_server(home, BUCKET)
    try:
        yield {S3: {"store": f"s3://{BUCKET}/runs?endpoint={endpoint}", "durable_store": f"file://{home / 'store'}"}}
    finally:
        stop_server(proc)


def to_target(run, target: float) -> tuple[int | None, float, int]:
    """(epoch reached or None, seconds, bytes) up to the target (every epoch when missed): the
    epochs' own seconds less the worker start-up each waited for (the pool's, epoch 0's), and the
    bytes synced."""
    n = reached(run.perplexity, target)
    upto = n or len(run.perplexity)
    return n, sum(run.seconds[:upto]) - sum(run.startup_s[:upto]), sum(run.bytes_synced[:upto])


def part_a(args: argparse.Namespace) -> str:
    """Run every configuration once per seed of `--sync-seeds` on one local stack, round-robin
    (every other round in reverse order); part a's markdown."""
    if args.sync_epochs < 2 or min(args.sync_k, args.diloco_k, args.sync_kb) < 1 or not args.sync_seeds \
            or args.sync_lr <= 0 or args.sync_seq_len < 2:
        raise SystemExit("error: --sync-epochs and --sync-seq-len must be at least 2; --sync-k, --diloco-k, "
                         "--sync-kb and --sync-lr positive; --sync-seeds one seed or more")
    runs: dict[str, list] = {c.name: [] for c in configs(args)}  # name -> its PoolRuns, by round
    ran = []  # every PoolRun, for keeping the stack's home

    def trace(config: Config) -> None:
        seed = args.sync_seeds[len(runs[config.name])]
        run = pool_trace(home, sync_params(args, config, seed, stores), config.name, seed)
        ran.append(run)
        runs[config.name].append(run)
        print(f"round {len(runs[config.name])} seed {seed} {config.name:22s} {run.run_id} {run.status[:80]}: perplexity "
              f"{' '.join(f'{p:.3f}' for p in run.perplexity)} seconds {' '.join(f'{s:.1f}' for s in run.seconds)} "
              f"start-up {' '.join(f'{s:.1f}' for s in run.startup_s)} sync {' '.join(f'{s:.2f}' for s in run.sync_s)} "
              f"MB {sum(run.bytes_synced) / 1e6:.2f}", flush=True)

    with scratch("lm-sync", keep=lambda: not all(r.ok for r in ran)) as home, sync_stores(args, home) as stores, \
            local_stack(home):
        rounds({c.name: (lambda c=c: trace(c)) for c in run_order(args)}, len(args.sync_seeds), alternate=True)
    return render_sync([(c, runs[c.name]) for c in configs(args)], args,
                       command_for("benchmarks.bench_language_models"))


def _outer_words(args: argparse.Namespace, steps: int) -> str:
    from core.outer_defaults import outer_settings, round_steps

    words = []
    for k in dict.fromkeys((args.diloco_k, args.sync_k)):
        s = outer_settings(round_steps(k, steps))
        words.append(f"outer lr {s.lr:.3g}, momentum {s.momentum:.3g} on {s.steps}-step rounds (gain {s.gain:.2f}x)")
    return "; ".join(words)


def _steps(args: argparse.Namespace) -> tuple[int, int, int]:
    """(training blocks, validation blocks, steps per replica per epoch) of the corpus."""
    from engine.datasets import load_dataset
    from engine.local_sgd import steps_per_epoch
    from engine.text_data import TextSettings

    data = load_dataset(f"text:stdlib:{args.sync_kb}", TextSettings(seq_len=seq_len(args)))
    return len(data.train_y), len(data.val_y), steps_per_epoch(len(data.train_y), WORKERS, BATCH)


def breakdown(runs: list, period: int, steps: int) -> dict:
    """Per-epoch figures of a configuration's runs, medians over epochs 2.. of every run (epoch 1
    also waits for the pool's workers to start): wall seconds, the slowest worker's compute and
    sync seconds, the rest (wall less compute and sync: dispatch, set-up, evaluation, epoch
    checkpoint), sync ms per round; and epoch 1's start-up."""
    later = [(r.seconds[i], r.compute_s[i], r.sync_s[i]) for r in runs for i in range(1, len(r.seconds))]
    per_epoch = -(-steps // period)
    return {"wall": median(w for w, _, _ in later), "compute": median(c for _, c, _ in later),
            "sync": median(x for _, _, x in later), "rest": median(w - c - x for w, c, x in later),
            "sync_ms_round": median(1e3 * x / per_epoch for _, _, x in later),
            "startup": median(r.startup_s[0] for r in runs if r.startup_s)}


def _judged(each: list[tuple[int | None, float, int]]) -> tuple[list[float], list[float], list[float]]:
    """Epochs, seconds and bytes to the target of each round; a round that missed it counts as
    infinite in all three (its seconds and bytes reached nothing)."""
    inf = math.inf
    return ([n if n else inf for n, _, _ in each], [s if n else inf for n, s, _ in each],
            [b if n else inf for n, _, b in each])


def _cell(x: float, fmt: str = "{:.1f}") -> str:
    return "not reached" if math.isinf(x) else fmt.format(x)


def _targets(kavg_runs: list) -> list[float]:
    """Each round's target: its K-AVG run's second-to-last epoch's perplexity."""
    return [r.perplexity[-2] if len(r.perplexity) >= 2 else math.nan for r in kavg_runs]


def _target_words(references: dict, seeds: list) -> str:
    """The targets by seed, each store's from its own K-AVG runs (one list where they agree)."""
    lists = {store: ", ".join(f"**{t:.4f}** (seed {sd})" for t, sd in zip(_targets(rs), seeds))
             for store, (_, rs) in references.items()}
    if len(set(lists.values())) == 1:
        same = " (the same from K-AVG's runs on every store)" if len(lists) > 1 else ""
        return next(iter(lists.values())) + same
    return "; ".join(f"{store}: {text}" for store, text in lists.items())


def render_sync(runs: list, args: argparse.Namespace, command: str) -> str:
    """Part a's section from `runs` ((Config, [PoolRun, ...] by round), in table order): each
    round's target by its rule, one row per configuration, each round's times and ratios, the
    per-epoch breakdown, the goal. A DiLoCo row is judged against K-AVG on its own store."""
    n_train, n_val, steps = _steps(args)
    references = {c.store: (c, rs) for c, rs in runs if c.is_kavg}  # store -> K-AVG's config and runs
    n_rounds = max(len(rs) for _, rs in runs)
    seeds = list(args.sync_seeds)[:n_rounds]
    order = [c.name for c in run_order(args)]
    s3 = (" The rows named over S3 send their syncs to an S3 server (moto on 127.0.0.1, over HTTP as a cloud run "
          "reaches its bucket: each request pays a round trip and each byte crosses a socket), with the same "
          "checkpoints, data and records in the stack's directory store; the others sync through that directory "
          "store (local disk: a request is a file's write and rename, so bytes cost little). Each DiLoCo row is "
          "judged against K-AVG on its own store." if S3 in references else "")
    lines = [
        "## a. Sync methods on the real corpus", "",
        run_line(command), "",
        (f"`{MODEL}` on `text:stdlib:{args.sync_kb}` (bytes tokenizer, causal blocks of {seq_len(args)} tokens: "
        f"{n_train} training and {n_val} validation blocks), {WORKERS} workers on the local pool (`zooid-local`: "
        f"one warm worker process per rank), strategy `local_sgd`, static scaling, SGD with momentum 0.9 lr "
        f"{args.sync_lr:g} (int8 syncs refuse Adam, so every row uses the same inner optimizer), batch {BATCH} per "
        f"replica, {steps} steps per replica an epoch, {args.sync_epochs} epochs a run. {n_rounds} rounds, one seed "
        f"each ({', '.join(map(str, seeds))}: the model's initial weights and every epoch's order): a round runs "
        f"every configuration once as a `train/local` flow run on one local stack, one run at a time, in the order "
        f"{', '.join(order)}, and every other round the reverse, so K-AVG and DiLoCo at its period run next to each "
        "other (A B, B A, A B) and a load that drifts over a round favours neither. A seed repeats its run's "
        "perplexities and bytes to the last digit (6d9aaed ran seed 0 three times); the seconds move with the "
        "machine's load. Every figure is read from the "
        "run's `summary.json`: rank 0's validation perplexity at each epoch end, the epoch's `seconds` (the "
        "coordinator's clock from dispatching the epoch to the last worker's stop: set-up, training, syncs, "
        "evaluation and checkpoint), its `startup.exposed_s` (the warm workers' start-up the first epoch waits "
        "for), the slowest worker's `compute_s` and `sync_s`, and `bytes_synced` (uploaded plus downloaded by "
        "both replicas to average; MB = 10^6 bytes). Every step averages gradients in buckets during backward; "
        "K-AVG averages weights and the momentum buffers; DiLoCo takes an outer Nesterov step with the job's "
        f"defaults (outer lr and momentum null: {_outer_words(args, steps)}, `core.outer_defaults`) and averages "
        f"the momentum buffers as K-AVG does; int8: per-block scales, error feedback.{s3}"), "",
        ("Target, by the rule fixed before the DiLoCo rows were read: the validation perplexity K-AVG reaches at its "
         f"second-to-last epoch in the same round (same seed): {_target_words(references, seeds)}. Time to target = the "
         "epochs' own seconds up to the first at or below it, less the start-up they waited for (the pool's workers "
         "starting, before the first step: not the method's); MB to target = the bytes synced over those epochs. "
         "A round that never reached its target counts as not reached (infinite) in the medians."), "",
        *table(["configuration", "epochs to target, each round", "epochs, median", "s to target, median",
                "s to target, each round", "MB to target, median", "MB / epoch", "final perplexity, each round",
                "seconds per epoch, median", "runs"]),
    ]
    judged = {}
    for config, rs in runs:
        each = [to_target(r, t) for r, t in zip(rs, _targets(references[config.store][1]))]
        judged[config.name] = _judged(each)
        ns, ss, bs = judged[config.name]
        per_epoch = median(sum(r.bytes_synced) / 1e6 / max(1, len(r.bytes_synced)) for r in rs)
        bad = "; ".join(f"round {i + 1}: {r.status[:120]}" for i, r in enumerate(rs) if not r.ok)
        lines.append(f"| {config.name} | {' '.join(_cell(n, '{:.0f}') for n in ns)} | {_cell(median(ns), '{:g}')} | "
                     f"{_cell(median(ss))} | {' '.join(_cell(x) for x in ss)} | {_cell(median(bs) / 1e6, '{:.2f}')} | "
                     f"{per_epoch:.2f} | {' '.join(f'{r.perplexity[-1]:.3f}' if r.perplexity else '-' for r in rs)} | "
                     f"{median(x for r in rs for x in r.seconds[1:]):.2f} | "
                     f"{', '.join(f'`{r.run_id}`' for r in rs)}{f' ({bad})' if bad else ''} |")
    diloco = [c for c, _ in runs if c.outer == "nesterov"]
    for store, (kavg_config, kavg_runs) in references.items():
        lines += ["", ("Each round: its seed and target, K-AVG's epochs and seconds to it, and each DiLoCo row's over "
                       f"K-AVG's in the same round{f' ({store})' if len(references) > 1 else ''}:"), ""]
        lines += _round_table(kavg_config, [c for c in diloco if c.store == store], judged, seeds,
                              _targets(kavg_runs))
    lines += ["", ("Where an epoch's seconds go (medians over epochs 2 to the last of every run; epoch 1 also waits for "
                  "the pool's workers): wall = the epoch's seconds; compute and sync = the slowest worker's "
                  "(`sync_s` is the time inside the collectives: compressing, storing the error-feedback residual, "
                  "the puts and gets, waiting for the peer; the outer step lands in compute); rest = wall less "
                  "both (dispatch, the worker's set-up, evaluation, the epoch checkpoint)."), "",
              *table(["configuration", "rounds an epoch", "wall s", "compute s", "sync s", "sync ms a round",
                      "rest s", "epoch 1 start-up s"])]
    for config, rs in runs:
        b = breakdown(rs, config.period, steps)
        lines.append(f"| {config.name} | {-(-steps // config.period)} | {b['wall']:.2f} | {b['compute']:.2f} | "
                     f"{b['sync']:.2f} | {b['sync_ms_round']:.1f} | {b['rest']:.2f} | {b['startup']:.1f} |")
    own = ", each row against K-AVG on its own store" if len(references) > 1 else ""
    lines += ["", (f"Goal: DiLoCo reaches the target with at most half of K-AVG's bytes, in no more time, judged on "
                  f"the medians over the {n_rounds} rounds (seeds){own}. Every run trains the same steps an epoch, so "
                  "a row whose median epochs to target exceed K-AVG's is not counted as faster even where its "
                  "seconds came out lower."), ""]
    lines += [_verdict(c, judged[c.name], judged[references[c.store][0].name]) for c in diloco]
    return "\n".join(lines)


def _round_table(kavg_config: Config, diloco: list[Config], judged: dict, seeds: list, targets: list) -> list[str]:
    """Per round: seed, order, target, K-AVG's seconds and epochs, each DiLoCo row's over K-AVG's."""
    lines = table(["round", "seed", "order", "target", kavg_config.name, *(c.name for c in diloco)])
    kn_all, ks_all, _ = judged[kavg_config.name]
    for i in range(len(seeds)):
        cells = []
        for c in diloco:
            ns, ss, _ = judged[c.name]
            cells.append("-" if i >= len(ss) else "not reached" if math.isinf(ss[i]) else
                         f"{ss[i]:.1f} s, {ns[i]:.0f} ep ({ss[i] / ks_all[i]:.2f}x)")
        lines.append(f"| {i + 1} | {seeds[i]} | {'reverse' if i % 2 else 'forward'} | {targets[i]:.4f} | "
                     f"{_cell(ks_all[i])} s, {_cell(kn_all[i], '{:.0f}')} ep | {' | '.join(cells)} |")
    return lines


def _verdict(config: Config, row: tuple, kavg: tuple) -> str:
    """The goal's line for one DiLoCo row against K-AVG's (each: epochs, seconds and bytes to the
    target by round, `_judged`)."""
    (ns, ss, bs), (kn_all, ks_all, kb_all) = row, kavg
    kn, ks, kb = median(kn_all), median(ks_all), median(kb_all)
    n, sec, b = median(ns), median(ss), median(bs)
    if math.isinf(kn):
        return f"- {config.name}: **not judged** (K-AVG itself did not reach its targets)."
    if math.isinf(n):
        return f"- {config.name}: **not met** (the target not reached in most rounds)."
    ratios = [x / k for x, k in zip(ss, ks_all)]
    met = b <= kb / 2 and sec <= ks and n <= kn
    return (f"- {config.name}: **{'met' if met else 'not met'}**: {b / 1e6:.2f} MB in {sec:.1f} s over {n:g} "
            f"epochs against K-AVG's {kb / 1e6:.2f} MB in {ks:.1f} s over {kn:g} (medians; bytes "
            f"{b / kb:.2f}x, time {sec / ks:.2f}x; per round {' '.join(_cell(r, '{:.2f}x') for r in ratios)}; "
            f"reached in K-AVG's epochs or fewer in {sum(a <= k for a, k in zip(ns, kn_all))} of {len(ns)} rounds).")
