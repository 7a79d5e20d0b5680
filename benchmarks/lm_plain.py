"""Part b of `benchmarks.bench_language_models`: Zooid's worker epoch against plain PyTorch, on one
device, in one process.

Zooid's side is the engine as a worker runs it: `engine.local_sgd_epoch.run_local_sgd_epoch` for
one replica (world 1, syncing once an epoch, which with one replica moves nothing), against a
directory store in a temporary folder, the data published there as the flow publishes it
(`engine.datasets.publish_dataset`, subsets of 64 rows), the model and subsets kept across
epochs as a warm worker keeps them (`keep_models`, `keep_subsets`); every epoch it builds the
model from the template, loads the previous epoch's checkpoint (weights and optimizer state),
trains, writes the epoch checkpoint (fsynced) and its history record, and evaluates the
validation set. Plain PyTorch is a loop over the same tensors
(`engine.datasets.load_dataset`, the rows the subsets hold, in the same order) with the same
model and initial weights (`build_model(name, seed)`), the same batches in the same order
(the epoch's order for one replica, `engine.replica_data.replica_share`: an epoch is one pass
over the training blocks, `--kb` sizes it), the same optimizer
(`build_optimizer`), `F.cross_entropy` as its loss, the same validation set scored at each
epoch end, and one `torch.save` of the model's and the optimizer's state per epoch. The two
alternate epoch by epoch (Zooid first in even epochs, plain first in odd ones), so load from
other jobs on a shared machine hits both; each epoch's clock stops after the device is
synchronised.

The measuring path imports torch, numpy, safetensors and the project's `core`, `comm` and
`engine` only: no Prefect, pydantic, boto3 or redis, so the same command runs, from the
repository root, on a GPU machine that has only torch, numpy, safetensors and tokenizers:

    .venv/bin/python -m benchmarks.bench_language_models --part b --kb 30 --plain-epochs 10
    python3 -m benchmarks.bench_language_models --part b --device cuda --model gpt2_small \
        --batch 16 --seq-len 256 --kb 600 --plain-epochs 3

The first writes `benchmarks/results/language_models.md` (its other parts' sections kept), the
second `benchmarks/results/language_models_gpu.md`.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.harness.home import scratch
from benchmarks.harness.replicas import SUBSET_ROWS
from benchmarks.harness.tables import median, run_line, table
from benchmarks.output import command_for
from core.keys import checkpoint_key, init_checkpoint_key

RESULTS_GPU = Path(__file__).resolve().parent / "results" / "language_models_gpu.md"
"""Where a run on a GPU writes part b (another machine than the one that runs parts a and c)."""
PLAIN_MODELS = ("gpt_mini", "gpt2_small")
DEFAULTS = {
    # model: (lr, KB of text:stdlib) on the device types it is meant for
    "gpt_mini": (1e-3, 400),
    "gpt2_small": (3e-4, 2000),
}
GOAL_CPU, GOAL_GPU = 1.10, 1.15
"""Issue 42's goals: Zooid's epoch at most 1.1x plain's on CPU; gpt2_small's tokens per second
within 1.15x of plain's on a GPU."""


def add_plain_arguments(parser: argparse.ArgumentParser) -> None:
    """Part b's options (`--seq-len` and `--out` are the script's own)."""
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="part b: the device both sides use")
    parser.add_argument("--model", choices=PLAIN_MODELS, default="gpt_mini", help="part b's model")
    parser.add_argument("--batch", type=int, default=16, help="part b: samples per step")
    parser.add_argument("--kb", type=int, default=None, help="part b: KB of text:stdlib (default: by model)")
    parser.add_argument("--plain-epochs", type=int, default=5, help="part b: epochs of each side")
    parser.add_argument("--lr", type=float, default=None, help="part b: Adam's learning rate (default: by model)")
    parser.add_argument("--threads", type=int, default=1,
                        help="part b on the CPU: torch threads for both sides (a pool worker's 1 by default)")


@dataclass
class Side:
    """One side's epochs: wall seconds and validation perplexity after each."""

    name: str
    seconds: list[float] = field(default_factory=list)
    perplexity: list[float] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)

    def median_s(self) -> float:
        """Median epoch seconds after the first (the first pays one-time costs: kernels, caches)."""
        return median(self.seconds[1:] or self.seconds)


def _synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _model_kwargs(model: str, data, seq_len: int) -> dict:
    """gpt2_small keeps GPT-2's 50257 tokens (the bytes' ids fit); gpt_mini takes the dataset's
    vocabulary as the flow gives it; either gets `seq_len` positions when its own are fewer."""
    from engine.models import data_model_kwargs

    kwargs = {} if model == "gpt2_small" else data_model_kwargs(model, data)
    if seq_len > {"gpt_mini": 128, "gpt2_small": 1024}[model]:
        kwargs["max_positions"] = seq_len
    return kwargs


def _plain_epoch(model, optimizer, x, y, vx, vy, batches, chunk: int, ckpt: Path) -> tuple[float, float]:
    """One plain PyTorch epoch over `batches` (index arrays of rows): train, score the validation
    set, save; (train loss, val loss)."""
    import torch
    import torch.nn.functional as F

    device = x.device
    model.train()
    total = torch.zeros((), device=device)
    for ids in batches:
        idx = torch.from_numpy(ids).to(device)
        logits = model(x[idx])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y[idx].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        total += loss.detach()
    model.eval()
    val_sum, val_n = torch.zeros((), device=device, dtype=torch.float64), 0
    with torch.no_grad():
        for start in range(0, len(vy), chunk):
            logits = model(vx[start:start + chunk])
            target = vy[start:start + chunk]
            val_sum += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="sum")
            val_n += target.numel()
    model.train()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, ckpt)
    return total.item() / len(batches), val_sum.item() / val_n


def run_plain_vs_zooid(model_name: str, device_name: str, batch: int, seq_len: int, kb: int,
                       epochs: int, lr: float, seed: int = 0) -> tuple[Side, Side, dict]:
    """Both sides, alternating epochs (module docstring): (zooid, plain, facts)."""
    with scratch("lm-plain") as root:
        return _alternate(root, model_name, device_name, batch, seq_len, kb, epochs, lr, seed)


def _alternate(root: Path, model_name: str, device_name: str, batch: int, seq_len: int, kb: int,
               epochs: int, lr: float, seed: int) -> tuple[Side, Side, dict]:
    """`run_plain_vs_zooid` in the folder `root`."""
    import math

    import torch

    from comm.store_dir import DirectoryStore
    from core.specs import ComputeSpec, WorkerSpec
    from engine.checkpoint import initial_checkpoint
    from engine.datasets import keep_subsets, load_dataset, publish_dataset
    from engine.epoch_order import epoch_steps
    from engine.local_sgd import validation_chunk
    from engine.local_sgd_epoch import run_local_sgd_epoch
    from engine.models import build_model, keep_models
    from engine.optimizers import build_optimizer
    from engine.replica_data import replica_share
    from engine.text_data import TextSettings

    device = torch.device(device_name)
    dataset, text = f"text:stdlib:{kb}", TextSettings(tokenizer="bytes", objective="causal", seq_len=seq_len)
    store = DirectoryStore(root / "store")
    run_id = "lm-plain"
    t0 = time.perf_counter()
    manifest = publish_dataset(store, run_id, dataset, SUBSET_ROWS, text=text)
    data = load_dataset(dataset, text)
    publish_s = time.perf_counter() - t0
    kwargs = _model_kwargs(model_name, data, seq_len)
    steps = epoch_steps(manifest.n_train, 1, batch)
    init = init_checkpoint_key(run_id)
    initial_checkpoint(store, init, model_name, "adam", lr, seed=seed, model_kwargs=kwargs)
    keep_models()
    keep_subsets()

    plain_model = build_model(model_name, seed, **kwargs).to(device)
    plain_opt = build_optimizer("adam", plain_model, lr)
    x, y = data.train_x.to(device), data.train_y.to(device)
    vx, vy = data.val_x.to(device), data.val_y.to(device)
    chunk = validation_chunk(vx)
    params = sum(p.numel() for p in plain_model.parameters())
    zooid, plain = Side("Zooid"), Side("plain PyTorch")

    def zooid_epoch(epoch: int) -> None:
        out = checkpoint_key(run_id, epoch)
        spec = WorkerSpec(run_id=run_id, epoch=epoch, rank=0, world=1, store_url=store.url, model=model_name,
                          dataset=dataset, steps=steps, batch_size=batch,
                          lr=lr, optimizer="adam", sync_period=None, seed=seed,
                          init_key=init if epoch == 0 else checkpoint_key(run_id, epoch - 1), out_key=out,
                          evaluate=True, compute=ComputeSpec(device=device_name, model_kwargs=kwargs))
        _synchronize(device)
        began = time.perf_counter()
        result = run_local_sgd_epoch(spec, store)
        _synchronize(device)
        zooid.seconds.append(time.perf_counter() - began)
        zooid.perplexity.append(result.val_perplexity)
        zooid.loss.append(result.train_loss)
        if epoch > 1:  # as the flow keeps the last checkpoints, not every one
            store.delete(checkpoint_key(run_id, epoch - 2))

    def plain_epoch(epoch: int) -> None:
        _synchronize(device)
        began = time.perf_counter()
        batches = replica_share(manifest, seed, epoch, (), 1, batch, 0)  # the rows Zooid's replica trains
        train_loss, val_loss = _plain_epoch(plain_model, plain_opt, x, y, vx, vy, batches, chunk, root / "plain.pt")
        _synchronize(device)
        plain.seconds.append(time.perf_counter() - began)
        plain.perplexity.append(math.exp(val_loss))
        plain.loss.append(train_loss)

    for epoch in range(epochs):
        order = (zooid_epoch, plain_epoch) if epoch % 2 == 0 else (plain_epoch, zooid_epoch)
        for run in order:
            run(epoch)
        print(f"epoch {epoch}: Zooid {zooid.seconds[-1]:.2f} s ppl {zooid.perplexity[-1]:.4f}, "
              f"plain {plain.seconds[-1]:.2f} s ppl {plain.perplexity[-1]:.4f}", flush=True)
    state_mb = (sum(t.numel() * t.element_size() for t in plain_model.parameters())
                + sum(v.numel() * v.element_size() for st in plain_opt.state.values() for v in st.values()
                      if torch.is_tensor(v))) / 1e6
    facts = {"params": params, "state_mb": state_mb, "steps": steps, "n_train": manifest.n_train, "n_val": manifest.n_val,
             "tokens_per_epoch": manifest.n_train * seq_len, "val_tokens": manifest.n_val * seq_len,
             "publish_s": publish_s, "kwargs": kwargs, "device": _device_words(device), "threads": torch.get_num_threads()}
    return zooid, plain, facts


def _device_words(device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    n = torch.get_num_threads()
    return f"CPU, {n} torch thread{'s' if n > 1 else ''}"


def render_plain(zooid: Side, plain: Side, facts: dict, args: argparse.Namespace, command: str) -> str:
    """Part b's markdown section."""
    gpu = args.device == "cuda"
    tokens = facts["tokens_per_epoch"]
    z, p = zooid.median_s(), plain.median_s()
    ratio = z / p
    goal = GOAL_GPU if gpu else GOAL_CPU
    met = ratio <= goal
    gap = max(abs(a - b) / b for a, b in zip(zooid.perplexity, plain.perplexity))
    lines = [
        f"## b. Against plain PyTorch{' on the GPU' if gpu else ''}", "",
        run_line(command, facts["device"]), "",
        f"`{args.model}` ({facts['params'] / 1e6:.2f}M parameters, model arguments {facts['kwargs'] or 'its defaults'}) "
        f"on `text:stdlib:{args.kb}` (bytes tokenizer, causal blocks of {args.seq_len_b} tokens: "
        f"{facts['n_train']} training and {facts['n_val']} validation blocks), Adam lr {args.lr:g}, batch "
        f"{args.batch}, {facts['steps']} steps an epoch ({tokens:,} tokens trained; the validation set's "
        f"{facts['val_tokens']:,} tokens scored at every epoch end), {args.plain_epochs} epochs of each side, "
        "alternating, seed 0, float32. One process, one device: Zooid's side is the worker's epoch "
        "(`run_local_sgd_epoch`, one replica, against a directory store in a temporary folder: the model "
        "rebuilt from its template and the previous checkpoint loaded, training, the epoch checkpoint written "
        f"and fsynced, {facts['state_mb']:,.1f} MB (weights and Adam's moments; a lone replica writes no sync "
        "checkpoint at its last round), the history record, the validation set scored); plain "
        "PyTorch trains the same model from the same weights on the same batches in the same order, scores "
        "the same validation set and `torch.save`s the model's and the optimizer's state once an epoch "
        "(`benchmarks/lm_plain.py`). Seconds per epoch: the median over the epochs after the first (which "
        "pays one-time costs on both sides); tokens per second = tokens trained an epoch over that median "
        f"(the whole epoch: evaluation and checkpoint included). Publishing the data: {facts['publish_s']:.1f} s, "
        "once, not counted.", "",
        *table(["side", "s / epoch (median)", "tokens / s", "epochs' seconds", "validation perplexity per epoch"]),
    ]
    for side, med in ((zooid, z), (plain, p)):
        lines.append(f"| {side.name} | {med:.2f} | {tokens / med:,.0f} | "
                     f"{' '.join(f'{s:.2f}' for s in side.seconds)} | "
                     f"{' '.join(f'{v:.4f}' for v in side.perplexity)} |")
    what = (f"`{args.model}` tokens per second within {goal:.2f}x of plain PyTorch's on the GPU" if gpu
            else f"Zooid's epochs at most {goal:.1f}x plain PyTorch's")
    pairs = median(a / b for a, b in zip(zooid.seconds[1:], plain.seconds[1:]))
    lines += ["", f"Ratio Zooid / plain: **{ratio:.3f}x** seconds per epoch ({p / z:.3f} of plain's tokens per "
                  f"second); the median of each epoch's own ratio (the two sides' epochs run back to back, so a "
                  f"burst of load from other jobs hits both): {pairs:.3f}x. Goal, {what}: "
                  f"**{'met' if met else 'not met'}**. The two sides' validation "
                  f"perplexities differ by at most {100 * gap:.3f} % (same weights, batches and optimizer; the "
                  "losses are summed in different orders)."]
    return "\n".join(lines)


def part_b(args: argparse.Namespace) -> str:
    """Part b's markdown: run both sides with `args` (see `add_plain_arguments`)."""
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device: cuda asked for, but torch sees no GPU")
    if args.batch < 1 or args.plain_epochs < 2:
        raise SystemExit("error: --batch must be positive, --plain-epochs at least 2")
    lr, kb = DEFAULTS[args.model]
    if args.device == "cpu":
        if args.threads < 1:
            raise SystemExit("error: --threads: must be at least 1")
        torch.set_num_threads(args.threads)
    args.lr = args.lr or lr
    args.kb = args.kb or kb
    args.seq_len_b = args.seq_len[0] if args.seq_len else 128
    zooid, plain, facts = run_plain_vs_zooid(args.model, args.device, args.batch, args.seq_len_b, args.kb,
                                             args.plain_epochs, args.lr)
    return render_plain(zooid, plain, facts, args, command_for("benchmarks.bench_language_models"))
