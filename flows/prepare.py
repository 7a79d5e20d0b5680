"""The `prepare` flow: a dataset prepared once as shards and a manifest in a bucket.

    python -m flows.prepare --param dataset=text:stdlib --param to=s3://my-bucket/corpora/stdlib
    python -m flows.prepare --param dataset=synthetic:3x32x32:10:20000 --param to=file:///data/syn
    python -m flows.prepare --param dataset=arrays:s3://raw/imgs --param to=s3://my-bucket/imgs --param workers=8
    prefect deployment run prepare/local --param dataset=digits --param to=block:zooid-store/data

`dataset` is any dataset a job takes (a factory by import path, `synthetic:...`, `text:SOURCE`
with `tokenizer`, `objective` and `seq_len`), or files of arrays (`arrays:<directory, URL or
block>`: `.npz` or `.npy` files under `train/` and `val/`, `engine.array_source`); `to` is a
store URL (`file://`, `s3://`, `az://`) or a store block (`block:<type slug>/<name>`), whose
root receives `train/<i>`, `val/<i>` and `manifest.json` (`engine.shards`: rows, dtypes,
shapes, a SHA-256 per shard, the settings and the commit that prepared it). A prepare that was
killed goes on where it stopped (whole shards already there are kept); preparing the same source
with the same settings again writes nothing and says so.

Files of arrays are cut in parallel (`flows.prepare_cuts`): the shards are fixed from the files'
headers, and `workers` cuts at once each write their own shards in a process of their own, a task
run each, on the `target` (`inline`: child processes; `local`: the process pool's worker
deployment, as `prepare/local` runs). The in-memory sources (`digits`, `synthetic:`, factories,
`text:`) are loaded whole and cut in the flow's own process.
"""
from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

from prefect import flow

from blocks.store_refs import open_store_ref
from core.errors import ZooidValueError
from core.stage_memory import format_bytes
from engine.array_source import arrays_ref, is_arrays
from engine.datasets import Prepared, prepare_dataset, validate_dataset
from engine.text_data import TextSettings
from flows.params import param_main
from flows.prepare_cuts import check_arrays, prepare_arrays

ROOT = Path(__file__).resolve().parent.parent


def zooid_commit() -> str:
    """The commit of this checkout (`git rev-parse HEAD`), or `unknown` outside a git checkout
    (a worker image)."""
    try:
        done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return done.stdout.strip() if done.returncode == 0 else "unknown"


def check_prepare(dataset: str, to: str, subset_size: int, text: TextSettings, workers: int = 1,
                  target: str = "inline") -> None:
    """Refuse bad input in one line naming the parameter, before anything is read or written."""
    for name, value in (("subset_size", subset_size), ("workers", workers)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ZooidValueError(name, f"must be a positive integer, got {value!r}")
    if not isinstance(to, str) or not to.strip():
        raise ZooidValueError("to", "must name where to write: a store URL (file://, s3://, az://) or a store block")
    if not isinstance(target, str) or not target.strip():
        raise ZooidValueError("target", "must name where cuts run: inline, local or a compute target block")
    if not is_arrays(dataset):
        validate_dataset(dataset, text)
        return
    if arrays_ref(dataset).rstrip("/") == (to if "://" in to else Path(to).resolve().as_uri()).rstrip("/"):
        raise ZooidValueError("to", f"is where the arrays of {dataset!r} are; prepare them into another place")
    for field in ("tokenizer", "objective"):
        if getattr(text, field) != getattr(TextSettings, field):
            raise ZooidValueError(field, f"{getattr(text, field)!r} is for text: datasets; {dataset!r} is not one")


def summary_line(to: str, done: Prepared) -> str:
    """What a prepare did, in one line."""
    m = done.manifest
    what = (f"{m.n_train} training and {m.n_val} validation samples in {m.n_subsets} + {m.n_val_subsets} shards "
            f"of {m.subset_size} rows, {format_bytes(m.total_bytes)}")
    if done.already:
        return f"already prepared at {to} with these settings: {what}; nothing written"
    kept = f" ({done.kept} whole shards kept from an earlier prepare)" if done.kept else ""
    return f"prepared {m.name} at {to}: {what}; {done.written} shards written{kept}"


@flow(name="prepare", result_serializer="json", log_prints=True)
def prepare(dataset: str, to: str, subset_size: int = 64, tokenizer: str = TextSettings.tokenizer,
            objective: str = TextSettings.objective, seq_len: int = TextSettings.seq_len, workers: int = 2,
            target: str = "inline") -> dict:
    """Prepare a dataset once as shards and a manifest in a bucket, to train from it with
    `dataset=<that URL>`.

    Args:
        dataset: What to prepare: any dataset a job takes (`digits`, `synthetic:...`, `package.module:factory`,
            `text:SOURCE`).
        to: Where: a store URL (file://, s3://bucket/prefix, az://container/prefix) or a store block.
        subset_size: Rows (samples) per shard.
        tokenizer: For `text:` datasets: `bytes` or `bpe:N`.
        objective: For `text:` datasets: `causal` or `mlm`.
        seq_len: For `text:` datasets: tokens per sample.
        workers: For `arrays:` sources: cuts written at once, each by a process of its own.
        target: For `arrays:` sources: where the cuts run: `inline` (child processes of this flow),
            `local` (the process pool's `worker/local` deployment) or a compute target block.
    """
    text = TextSettings(tokenizer=tokenizer, objective=objective, seq_len=seq_len)
    check_prepare(dataset, to, subset_size, text, workers, target)
    arrays = check_arrays(dataset, target) if is_arrays(dataset) else None  # headers read; nothing written yet
    store = open_store_ref(to)
    try:
        if arrays is not None:
            done, cuts = prepare_arrays(store, arrays, to, subset_size, workers, prepared_by=zooid_commit())
        else:
            done, cuts = prepare_dataset(store, "", dataset, subset_size, text, open_source=open_store_ref,
                                         prepared_by=zooid_commit()), []
        where = store.url
    finally:
        store.close()
    line = summary_line(where, done) + (f", in {len(cuts)} cuts on {target}, {workers} at once" if cuts else "")
    print(line)
    return {"message": line, "to": where, "written": done.written, "kept": done.kept, "already": done.already,
            "manifest": done.manifest.to_dict(), "cuts": cuts}


def check_params(params: dict) -> None:
    """The command line's parameters: known, the required ones given, then `check_prepare`."""
    unknown = sorted(set(params) - set(prepare.parameters.properties))
    if unknown:
        raise ZooidValueError(unknown[0], f"not a parameter of prepare (it takes "
                              f"{', '.join(prepare.parameters.properties)})")
    missing = [p for p in ("dataset", "to") if p not in params]
    if missing:
        raise ZooidValueError(missing[0], "is required")
    bound = inspect.signature(prepare.fn).bind(**params)
    bound.apply_defaults()  # the flow's own defaults
    a = bound.arguments
    check_prepare(a["dataset"], a["to"], a["subset_size"], TextSettings(a["tokenizer"], a["objective"], a["seq_len"]),
                  a["workers"], a["target"])


def main(argv: list[str] | None = None) -> int:
    """`python -m flows.prepare --param dataset=... --param to=...`: prepare, print one line
    (bad input is refused before the flow, and a server, start)."""
    def run(params: dict) -> None:
        check_params(params)
        prepare(**params)

    return param_main(argv, "python -m flows.prepare", __doc__.splitlines()[0], run)

if __name__ == "__main__":
    sys.exit(main())
