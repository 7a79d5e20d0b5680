"""The `prepare` flow: a dataset prepared once as shards and a manifest in a bucket.

    python -m flows.prepare --param dataset=text:stdlib --param to=s3://my-bucket/corpora/stdlib
    python -m flows.prepare --param dataset=synthetic:3x32x32:10:20000 --param to=file:///data/syn
    prefect deployment run prepare/local --param dataset=digits --param to=block:zooid-store/data

`dataset` is any dataset a job takes (a factory by import path, `synthetic:...`, `text:SOURCE`
with `tokenizer`, `objective` and `seq_len`); `to` is a store URL (`file://`, `s3://`, `az://`)
or a store block (`block:<type slug>/<name>`), whose root receives `train/<i>`, `val/<i>` and
`manifest.json` (`engine.shards`: rows, dtypes, shapes, a SHA-256 per shard, the settings and
the commit that prepared it). A prepare that was killed goes on where it stopped (whole shards
already there are kept); preparing the same source with the same settings again writes nothing
and says so.
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
from engine.datasets import Prepared, prepare_dataset, validate_dataset
from engine.text_data import TextSettings
from flows.params import param_main

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


def check_prepare(dataset: str, to: str, subset_size: int, text: TextSettings) -> None:
    """Refuse bad input in one line naming the parameter, before anything is read or written."""
    if not isinstance(subset_size, int) or isinstance(subset_size, bool) or subset_size < 1:
        raise ZooidValueError("subset_size", f"must be a positive integer, got {subset_size!r}")
    if not isinstance(to, str) or not to.strip():
        raise ZooidValueError("to", "must name where to write: a store URL (file://, s3://, az://) or a store block")
    validate_dataset(dataset, text)


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
            objective: str = TextSettings.objective, seq_len: int = TextSettings.seq_len) -> dict:
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
    """
    text = TextSettings(tokenizer=tokenizer, objective=objective, seq_len=seq_len)
    check_prepare(dataset, to, subset_size, text)
    store = open_store_ref(to)
    try:
        done = prepare_dataset(store, "", dataset, subset_size, text, open_source=open_store_ref,
                               prepared_by=zooid_commit())
        where = store.url
    finally:
        store.close()
    line = summary_line(where, done)
    print(line)
    return {"message": line, "to": where, "written": done.written, "kept": done.kept, "already": done.already,
            "manifest": done.manifest.to_dict()}


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
    check_prepare(a["dataset"], a["to"], a["subset_size"], TextSettings(a["tokenizer"], a["objective"], a["seq_len"]))


def main(argv: list[str] | None = None) -> int:
    """`python -m flows.prepare --param dataset=... --param to=...`: prepare, print one line
    (bad input is refused before the flow, and a server, start)."""
    def run(params: dict) -> None:
        check_params(params)
        prepare(**params)

    return param_main(argv, "python -m flows.prepare", __doc__.splitlines()[0], run)

if __name__ == "__main__":
    sys.exit(main())
