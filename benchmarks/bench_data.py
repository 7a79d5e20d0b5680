"""Datasets in a bucket (issue #44): prepare and read throughput beside MosaicML Streaming, the
data wait inside training steps, and the memory of a 2 GB epoch, in parts of one results file.

Parts a-c use one local S3 server (moto, `benchmarks.harness.servers.moto_server`) and one
dataset: `synthetic:3x32x32:10:ROWS:VAL` (float32 images, int64 labels), generated once in this
process and written by both sides from the same arrays, in shards of the same rows (`--shard-rows`;
MosaicML Streaming's `size_limit` set to that many samples' bytes).

- **a. Prepare**: Zooid's `engine.datasets.prepare_dataset` (what `flows.prepare` runs: shards,
  a SHA-256 each, the manifest last) into `s3://bench/zooid-<round>`, beside Streaming's
  `MDSWriter` (`out=s3://bench/mds-<round>/<split>`, no compression, no hashes: its defaults)
  writing the same training and validation arrays. MB/s = the objects' bytes in the bucket
  afterwards over the writer's seconds (the arrays already in memory, each side's imports and
  process start left out). Rounds interleaved (A B, B A, ...); medians.
- **b. Read**: one worker reading every training sample of an epoch once, shuffled, in batches
  of `--batch`: Zooid's `engine.shard_stream.ShardStream` over the epoch's batches
  (`engine.epoch_order`, world 1), each shard fetched once and its SHA-256 checked; Streaming's
  `StreamingDataset` (a fresh local cache each round, `shuffle_block_size` = Zooid's shuffle
  window in samples, so both read with the same locality) through a `torch` `DataLoader` with
  `num_workers=0` and the same batch. MB/s = the samples' bytes delivered over the seconds from
  opening the dataset to the last batch. Rounds interleaved (A B, B A, ...); medians. Goal: at
  least 1x Streaming's.
- **c. Data wait**: real training steps (`benchmarks.data_models:small_cnn`, SGD momentum,
  one torch thread) of replica 0 of 2 over its `ShardStream` (its default read-ahead) from the
  S3 server: the share of the loop's seconds spent waiting for the next batch (measured around
  the stream's `next()`, and as the stream's own `wait_s`). Goal: at most 5 %.

- **d. Memory**: a 2 GB dataset (`--memory-rows`) prepared by the prepare flow's function
  (`flows.prepare.prepare.fn`, in a process of its own, without a Prefect server) into a
  directory, then one epoch by 2 workers through the train command (`python -m flows.train`,
  target `inline`: the coordinator starts the worker processes; model
  `benchmarks.data_models:linear`, `data_cache_mb=--cache-mb`). Every process of the run is polled every 0.1 s through /proc
  (`VmHWM`, the kernel's peak resident set of each process): the coordinator (the command's own
  process), each worker (a process tagged `ZOOID_RUN_ID`, the fork server apart), and the rest
  (the command's Prefect server, the fork server) listed beside them. Goals: the coordinator under
  800 MB; each worker under `data_cache_mb` + its model (parameters, gradients and momentum) + 500 MB.

Streaming runs in a virtualenv of its own that this benchmark creates on its first run and keeps
(`VENV`, under `~/.cache/zooid-bench/`, or `--venv`; made again when the project's torch
changed): `mosaicml-streaming` `STREAMING_VERSION` without its dependencies, the project's torch
from the wheels on disk, and the few packages its `streaming.base` imports (it never becomes a
project dependency). Its vision, text and multimodal subpackages (torchvision, tokenizers) are
not imported: the driver puts empty modules in their place before `import streaming`.

    .venv/bin/python -m benchmarks.bench_data [--part a b c d] [--rounds 3] [--venv PATH] [--keep]
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmarks.harness.home import REPO, scratch
from benchmarks.harness.servers import moto_server, stop_server
from benchmarks.harness.tables import fmt, median, merged_body, pct, run_line, table
from benchmarks.harness.train import param_args
from benchmarks.output import HOST_SOURCE, command_for, provenance, write_result

RESULTS = Path(__file__).resolve().parent / "results" / "data.md"
SOURCES = (*HOST_SOURCE, "benchmarks/harness/servers.py", "benchmarks/harness/tables.py", "benchmarks/harness/train.py",
           "benchmarks/data_models.py")
"""The code it measures (the whole project but the worker image's recipe, its workers being processes here: part d
runs the train flow): its results file is stale once one of these changed since the commit the file names
(`benchmarks.staleness`)."""
TITLE = "Datasets in a bucket: prepare, read, data wait and memory, beside MosaicML Streaming"
WHEELS = REPO / "worker_images" / "wheels"
STREAMING_VERSION = "0.13.0"
STREAMING_DEPS = ("numpy<2.2", "boto3", "Brotli", "python-snappy", "xxhash<4", "zstd", "tqdm", "filelock",
                  "catalogue", "typing_extensions", "Pillow", "transformers<5")
"""What `streaming.base` imports (its declared dependencies also pull torchvision, cloud SDKs and
a plotting library that the benchmark does not use)."""
VENV = Path.home() / ".cache" / "zooid-bench" / f"streaming-{STREAMING_VERSION}"
"""Where Streaming's virtualenv is kept between runs (made on the first)."""
BUCKET = "bench"
SEED = 0
GOALS = {"read": 1.0, "wait": 0.05, "coordinator_mb": 800.0, "worker_extra_mb": 500.0}
CNN, LINEAR = "benchmarks.data_models:small_cnn", "benchmarks.data_models:linear"
MB = 1e6

STREAMING = r'''
import json, os, sys, time, types
for name in ("streaming.vision", "streaming.text", "streaming.multimodal"):  # torchvision, tokenizers: unused
    sys.modules[name] = types.ModuleType(name)
import numpy as np
import streaming

cfg = json.loads(sys.argv[1])
if cfg["mode"] == "write":
    from streaming import MDSWriter
    arrays = {split: (np.load(os.path.join(cfg["arrays"], f"{split}_x.npy")),
                      np.load(os.path.join(cfg["arrays"], f"{split}_y.npy"))) for split in ("train", "val")}
    began = time.perf_counter()  # the arrays in memory, as Zooid's prepare gets them
    for split, (x, y) in arrays.items():
        columns = {"x": "ndarray:float32:" + ",".join(map(str, x.shape[1:])), "y": "int64"}
        with MDSWriter(out=cfg["out"] + "/" + split, columns=columns, size_limit=cfg["size_limit"],
                       progress_bar=False) as writer:
            for i in range(len(y)):
                writer.write({"x": x[i], "y": y[i]})
    print("RESULT " + json.dumps({"seconds": time.perf_counter() - began, "version": streaming.__version__}))
else:
    import torch
    from torch.utils.data import DataLoader
    from streaming import StreamingDataset
    torch.set_num_threads(1)
    began = time.perf_counter()
    ds = StreamingDataset(remote=cfg["remote"], local=cfg["local"], shuffle=True, shuffle_seed=cfg["seed"],
                          shuffle_block_size=cfg["block"], batch_size=cfg["batch"])
    rows = nbytes = 0
    for batch in DataLoader(ds, batch_size=cfg["batch"], num_workers=0):
        rows += len(batch["y"])
        nbytes += batch["x"].numel() * batch["x"].element_size() + batch["y"].numel() * batch["y"].element_size()
    print("RESULT " + json.dumps({"seconds": time.perf_counter() - began, "rows": rows, "bytes": nbytes}))
'''


# --- Streaming's virtualenv and driver ----------------------------------------------------


def streaming_python(venv: Path) -> Path:
    """The Streaming virtualenv's python, created on first use (module docstring); one left
    half-installed is made again."""
    import shutil

    import torch

    python, done_mark = venv / "bin" / "python", venv / "zooid-bench-installed"
    wanted = f"mosaicml-streaming=={STREAMING_VERSION} torch=={torch.__version__}\n"
    if not done_mark.exists() or done_mark.read_text() != wanted:
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        wheels = ["--find-links", str(WHEELS)] if WHEELS.is_dir() else []
        for args in ([*wheels, f"torch=={torch.__version__}"], ["--no-deps", f"mosaicml-streaming=={STREAMING_VERSION}"],
                     list(STREAMING_DEPS)):
            done = subprocess.run([*pip, *args], capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"pip install {' '.join(args)} failed: {done.stderr[-2000:]}")
        done_mark.write_text(wanted)
    return python


def run_streaming(python: Path, folder: Path, cfg: dict, endpoint: str) -> dict:
    """One Streaming driver run (`STREAMING`, its `cfg`) against the S3 server at `endpoint`."""
    script = folder / "streaming_driver.py"
    script.write_text(STREAMING)
    env = {**os.environ, "S3_ENDPOINT_URL": endpoint, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([str(python), str(script), json.dumps(cfg)], env=env, capture_output=True, text=True,
                          timeout=600, cwd=folder)
    if proc.returncode:
        raise RuntimeError(f"the Streaming driver failed ({cfg['mode']}): {proc.stderr[-2000:]}")
    line = next(l for l in reversed(proc.stdout.splitlines()) if l.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def bucket_bytes(endpoint: str, prefix: str) -> int:
    """The bytes of every object under `prefix` of the bucket."""
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    total = 0
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/"):
        total += sum(o["Size"] for o in page.get("Contents", []))
    return total


# --- parts a-c: one S3 server, one dataset --------------------------------------------------


class S3Bench:
    """Parts a-c's shared state: the S3 server, the arrays, Streaming's python, what was written."""

    def __init__(self, folder: Path, args):
        import numpy as np

        from engine.datasets import load_dataset

        self.folder, self.args = folder, args
        self.name = f"synthetic:3x32x32:10:{args.rows}:{args.val_rows}"
        self.data = load_dataset(self.name)
        self.arrays = folder / "arrays"
        self.arrays.mkdir(exist_ok=True)
        for split, x, y in (("train", self.data.train_x, self.data.train_y), ("val", self.data.val_x, self.data.val_y)):
            np.save(self.arrays / f"{split}_x.npy", x.numpy())
            np.save(self.arrays / f"{split}_y.npy", y.numpy())
        self.row_bytes = self.data.train_x[0].numel() * 4 + 8
        self.moto, self.endpoint = moto_server(folder, BUCKET)
        self.written: dict[str, list[dict]] = {"zooid": [], "streaming": []}

    @functools.cached_property
    def python(self) -> Path:
        """Streaming's python (its virtualenv made on first use)."""
        return streaming_python(self.args.venv)

    def store(self, prefix: str):
        from comm.store import open_store

        return open_store(f"s3://{BUCKET}/{prefix}?endpoint={self.endpoint}")

    def close(self) -> None:
        stop_server(self.moto)

    # a. prepare
    def prepare_zooid(self, k: int) -> dict:
        from unittest import mock

        from engine import datasets

        store = self.store(f"zooid-{k}")
        try:  # the source already in memory, as Streaming's writer gets it
            with mock.patch.object(datasets, "load_dataset", lambda *a, **kw: self.data):
                began = time.perf_counter()
                done = datasets.prepare_dataset(store, "", self.name, self.args.shard_rows, prepared_by="bench",
                                                resume=False)
                seconds = time.perf_counter() - began
        finally:
            store.close()
        assert not done.already
        return {"seconds": seconds, "bytes": bucket_bytes(self.endpoint, f"zooid-{k}"),
                "shards": done.manifest.n_subsets + done.manifest.n_val_subsets}

    def prepare_streaming(self, k: int) -> dict:
        size_limit = self.args.shard_rows * (self.row_bytes + 16)  # + each sample's offset and header
        out = run_streaming(self.python, self.folder, {"mode": "write", "arrays": str(self.arrays),
                                                       "out": f"s3://{BUCKET}/mds-{k}", "size_limit": size_limit},
                            self.endpoint)
        return {**out, "bytes": bucket_bytes(self.endpoint, f"mds-{k}")}

    def part_a(self) -> str:
        for k in range(self.args.rounds):  # A B, B A, ...: a load that rises over a round favours neither
            for side in ("zooid", "streaming")[::(-1 if k % 2 else 1)]:
                self.written[side].append(getattr(self, f"prepare_{side}")(k))
            print(f"a round {k}: zooid {self.written['zooid'][-1]['seconds']:.2f} s, "
                  f"streaming {self.written['streaming'][-1]['seconds']:.2f} s", flush=True)
        rows = []
        mbps = {}
        for side, label in (("zooid", "Zooid `prepare_dataset`"), ("streaming", f"Streaming {STREAMING_VERSION} `MDSWriter`")):
            runs = self.written[side]
            mbps[side] = median(r["bytes"] / MB / r["seconds"] for r in runs)
            rows.append([label, f"{runs[0]['bytes'] / MB:.1f}", fmt(median(r["seconds"] for r in runs)),
                         fmt(mbps[side], "{:.1f}"), ", ".join(f"{r['bytes'] / MB / r['seconds']:.1f}" for r in runs)])
        lines = ["## a. Prepare throughput", "", run_line(self.args.command), "",
                 f"{self.args.rows} training and {self.args.val_rows} validation rows of `{self.name}` "
                 f"({self.row_bytes} bytes a row), shards of {self.args.shard_rows} rows, into the local S3 server; "
                 f"{self.args.rounds} rounds, interleaved (A B, B A, ...); MB = 10^6 bytes.", "",
                 *table(["writer", "MB in the bucket", "seconds (median)", "MB/s (median)", "MB/s per round"], rows),
                 "", f"Zooid / Streaming: **{mbps['zooid'] / mbps['streaming']:.2f}x** (Zooid also computes a SHA-256 "
                 "of every shard for its manifest; Streaming's writer, with its default `hashes=None`, none)."]
        return "\n".join(lines)

    # b. read
    def read_zooid(self, k: int, prefix: str) -> dict:
        from engine.datasets import ShardSource
        from engine.replica_data import replica_share
        from engine.shard_stream import ShardStream

        store = self.store(prefix)
        try:
            began = time.perf_counter()
            source = ShardSource(store, "")
            batches = replica_share(source.manifest, SEED, k, (), 1, self.args.batch, 0)
            rows = nbytes = 0
            with ShardStream(source, batches, seed=SEED, epoch=k) as stream:
                for x, y in stream:
                    rows += len(y)
                    nbytes += x.numel() * x.element_size() + y.numel() * y.element_size()
            seconds = time.perf_counter() - began
            return {"seconds": seconds, "rows": rows, "bytes": nbytes, "fetched": stream.bytes_read,
                    "wait_s": stream.wait_s}
        finally:
            store.close()

    def read_streaming(self, k: int, prefix: str) -> dict:
        from engine.epoch_order import DEFAULT_WINDOW

        return run_streaming(self.python, self.folder, {
            "mode": "read", "remote": f"s3://{BUCKET}/{prefix}/train", "local": str(self.folder / f"mds-cache-{k}"),
            "seed": SEED + k, "block": DEFAULT_WINDOW * self.args.shard_rows, "batch": self.args.batch}, self.endpoint)

    def ensure_written(self, *sides: str) -> None:
        """Round 0's objects of `sides` in the bucket, written now when part a did not run."""
        for side in sides:
            if not self.written[side]:
                self.written[side].append(getattr(self, f"prepare_{side}")(0))

    def part_b(self) -> str:
        self.ensure_written("zooid", "streaming")
        runs: dict[str, list[dict]] = {"zooid": [], "streaming": []}
        for k in range(self.args.rounds):
            for side in ("zooid", "streaming")[::(-1 if k % 2 else 1)]:
                runs[side].append(getattr(self, f"read_{side}")(k, "zooid-0" if side == "zooid" else "mds-0"))
            print(f"b round {k}: zooid {runs['zooid'][-1]['seconds']:.2f} s, "
                  f"streaming {runs['streaming'][-1]['seconds']:.2f} s", flush=True)
        assert all(r["rows"] == self.args.rows for r in runs["zooid"]), [r["rows"] for r in runs["zooid"]]
        mbps = {side: median(r["bytes"] / MB / r["seconds"] for r in rs) for side, rs in runs.items()}
        rows = [[label, runs[side][0]["rows"], fmt(median(r["seconds"] for r in runs[side])), fmt(mbps[side], "{:.1f}"),
                 ", ".join(f"{r['bytes'] / MB / r['seconds']:.1f}" for r in runs[side])]
                for side, label in (("zooid", "Zooid `ShardStream`"),
                                    ("streaming", f"Streaming {STREAMING_VERSION} `StreamingDataset` + `DataLoader`"))]
        ratio = mbps["zooid"] / mbps["streaming"]
        verdict = "met" if ratio >= GOALS["read"] else "not met"
        lines = ["## b. A worker's read throughput", "", run_line(self.args.command), "",
                 f"One worker, every one of the {self.args.rows} training samples once, shuffled, batches of "
                 f"{self.args.batch}, from the bucket part a wrote (round 0's objects); a new epoch's order each "
                 f"round (Zooid: epoch k; Streaming: shuffle seed k), a fresh local cache for Streaming each round; "
                 f"{self.args.rounds} rounds, interleaved (A B, B A, ...). Zooid fetched "
                 f"{runs['zooid'][0]['fetched'] / MB:.1f} MB of shards a round.", "",
                 *table(["reader", "samples", "seconds (median)", "MB/s of samples (median)", "MB/s per round"], rows),
                 "", f"Goal: Zooid at least {GOALS['read']:g}x Streaming's: **{ratio:.2f}x, {verdict}**."]
        return "\n".join(lines)

    # c. data wait inside training steps
    def train_round(self, epoch: int, readahead_mb: float | None) -> dict:
        """Replica 0 of 2's steps of `CNN` over its `ShardStream` for `epoch` (reading ahead
        `readahead_mb`): the loop's seconds, each step's wait for its batch, the stream's own
        `wait_s` and bytes fetched."""
        import torch

        from engine.datasets import ShardSource
        from engine.models import build_model
        from engine.objective import CROSS_ENTROPY
        from engine.optimizers import build_optimizer
        from engine.replica_data import replica_share
        from engine.shard_stream import ShardStream

        torch.set_num_threads(1)
        model = build_model(CNN, seed=SEED)
        opt = build_optimizer("momentum", model, 0.05)
        store = self.store("zooid-0")
        try:
            source = ShardSource(store, "")
            batches = replica_share(source.manifest, SEED, epoch, (), 2, self.args.batch, 0)
            waits, rows = [], 0
            began = time.perf_counter()
            with ShardStream(source, batches, seed=SEED, epoch=epoch, readahead_mb=readahead_mb) as stream:
                it = iter(stream)
                while True:
                    t0 = time.perf_counter()
                    try:
                        x, y = next(it)
                    except StopIteration:
                        break
                    waits.append(time.perf_counter() - t0)
                    opt.zero_grad()
                    CROSS_ENTROPY.loss(model(x), y).backward()
                    opt.step()
                    rows += len(y)
            loop = time.perf_counter() - began
        finally:
            store.close()
        return {"loop": loop, "waits": waits, "rows": rows, "wait_s": stream.wait_s, "fetched": stream.bytes_read,
                "ahead": stream.readahead_shards, "window": stream.window_shards}

    def part_c(self) -> str:
        from engine.epoch_order import DEFAULT_WINDOW

        self.ensure_written("zooid")
        runs = []
        for k in range(self.args.rounds):
            runs.append(self.train_round(k, None))
            print(f"c round {k}: loop {runs[-1]['loop']:.2f} s, waited {sum(runs[-1]['waits']):.2f} s", flush=True)
        share = median(sum(r["waits"]) / r["loop"] for r in runs)
        verdict = "met" if share <= GOALS["wait"] else "not met"
        rows = [[k, fmt(r["loop"]), f"{1000 * r['loop'] / len(r['waits']):.1f} ms", fmt(sum(r["waits"]), "{:.3f} s"),
                 pct(sum(r["waits"]) / r["loop"]), fmt(r["waits"][0], "{:.3f} s"), pct(sum(r["waits"][1:]) / r["loop"]),
                 sum(w > 0.001 for w in r["waits"][1:]), fmt(r["wait_s"], "{:.3f} s")] for k, r in enumerate(runs)]
        r0 = runs[0]
        ahead = f"{r0['ahead']} shards, the most one batch needs first being {r0['window']}"
        lines = ["## c. Data wait inside training steps", "", run_line(self.args.command), "",
                 f"Replica 0 of 2 (batch {self.args.batch}; round k trains epoch k's order, whose shuffle windows "
                 f"hold {DEFAULT_WINDOW} shards): {len(r0['waits'])} steps of `{CNN}` (SGD momentum 0.9, lr 0.05, "
                 f"one torch thread, built afresh each round) over {r0['rows']} samples read by its `ShardStream` "
                 f"(the stream's default read-ahead: {ahead}) from the local S3 server ({r0['fetched'] / MB:.1f} MB "
                 f"of shards fetched in round 0); {self.args.rounds} rounds. Waiting = the loop's seconds inside "
                 "the stream's `next()`, beside the stream's own `wait_s`; the first batch waits for the first "
                 "shards, which nothing could read ahead.", "",
                 *table(["round", "loop seconds", "step (mean)", "waiting", "share of the loop", "first batch",
                         "share after the first batch", "later steps that waited > 1 ms", "the stream's `wait_s`"],
                        rows),
                 "", f"Goal: data wait at most {pct(GOALS['wait'])} of the step time: **{pct(share)} (median), "
                 f"{verdict}**."]
        return "\n".join(lines)


# --- part d: memory of a 2 GB epoch ---------------------------------------------------------


class PeakRss:
    """Polls /proc every `every_s` for the processes of one train command: the command itself,
    and every process whose environment carries `ZOOID_HOME=<home>`; keeps each one's command
    line, name (`comm`, read each time: the fork server renames itself), run tag and `VmHWM`
    (peak resident set). A process that execs anew starts a new peak; a child caught between its
    fork and its exec (the command's own command line) is looked at again at the next poll."""

    def __init__(self, root_pid: int, home: Path, every_s: float = 0.1):
        self.root, self.tag, self.every_s = root_pid, f"ZOOID_HOME={home}".encode(), every_s
        self.seen: dict[int, dict] = {}
        self._foreign: set[int] = set()
        self._root_cmd = self._cmd(root_pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    @staticmethod
    def _cmd(pid: int) -> str:
        return (Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip())

    def _look(self, pid: int) -> None:
        entry = Path(f"/proc/{pid}")
        if pid not in self.seen:
            env = (entry / "environ").read_bytes().split(b"\0")
            if pid != self.root and self.tag not in env:
                self._foreign.add(pid)
                return
            cmd = self._cmd(pid)
            if pid != self.root and cmd == self._root_cmd:
                return  # between fork and exec
            run = next((e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"ZOOID_RUN_ID=")), None)
            self.seen[pid] = {"cmd": cmd, "comm": "", "run": run, "peak": 0}
        s = self.seen[pid]
        cmd = self._cmd(pid)
        if cmd and cmd != s["cmd"]:  # exec'd anew: a new process image, a new peak
            s.update(cmd=cmd, peak=0)
        status = (entry / "status").read_text()
        s["comm"] = (entry / "comm").read_text().strip()
        s["peak"] = max(s["peak"], next(int(l.split()[1]) * 1024 for l in status.splitlines() if l.startswith("VmHWM:")))

    def _loop(self) -> None:
        while not self._stop.is_set():
            for entry in Path("/proc").iterdir():
                if entry.name.isdigit() and int(entry.name) not in self._foreign:
                    try:
                        self._look(int(entry.name))
                    except (OSError, StopIteration, ValueError):
                        continue
            self._stop.wait(self.every_s)

    def stop(self) -> dict[int, dict]:
        self._stop.set()
        self._thread.join()
        return self.seen


def model_bytes(name: str) -> int:
    """Parameters, gradients and SGD momentum of model `name`: 3x its parameters' bytes."""
    from engine.models import build_model

    return 3 * sum(p.numel() * p.element_size() for p in build_model(name).parameters())


def part_d(folder: Path, args) -> str:
    from runtime.fork_server import FORK_SERVER_NAME

    n_val = args.memory_rows // 10
    name = f"synthetic:3x32x32:10:{args.memory_rows}:{n_val}"
    data = folder / "data"
    home = folder / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update(ZOOID_HOME=str(home), PREFECT_HOME=str(home / "prefect"), DO_NOT_TRACK="1",
               PREFECT_SERVER_ANALYTICS_ENABLED="false")
    began = time.perf_counter()
    call = f"prepare.fn(dataset={name!r}, to={f'file://{data}'!r}, subset_size={args.shard_rows})"
    proc = subprocess.run([sys.executable, "-c", f"from flows.prepare import prepare; {call}"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    prepare_s = time.perf_counter() - began
    if proc.returncode:
        raise RuntimeError(f"the prepare flow's function failed: {proc.stderr[-2000:]}")
    manifest = json.loads((data / "manifest.json").read_text())
    total = sum(s["bytes"] for split in manifest["shards"].values() for s in split)
    val_bytes = sum(s["bytes"] for s in manifest["shards"]["val"])
    print(f"d: prepared {total / MB:.0f} MB in {prepare_s:.0f} s", flush=True)
    params = {"model": LINEAR, "dataset": f"file://{data}", "workers": 2, "epochs": 1, "batch_size": args.memory_batch,
              "lr": 0.05, "optimizer": "momentum", "strategy": "local_sgd", "scaling": "static", "seed": SEED,
              "data_cache_mb": args.cache_mb, "store": f"file://{folder / 'store'}"}
    summary_out = folder / "summary.json"
    log = open(folder / "train.log", "w")
    began = time.perf_counter()
    train = subprocess.Popen([sys.executable, "-m", "flows.train", *param_args(params), "--summary-out", str(summary_out)],
                             env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True)
    poll = PeakRss(train.pid, home)
    try:
        train.wait(timeout=1200)
    finally:
        seen = poll.stop()
        if train.poll() is None:
            train.kill()
        log.close()
    wall = time.perf_counter() - began
    if train.returncode or not summary_out.exists():
        raise RuntimeError(f"python -m flows.train exited {train.returncode}: "
                           f"{(folder / 'train.log').read_text()[-2000:]}")
    (folder / "processes.json").write_text(json.dumps(seen, indent=1))
    summary = json.loads(summary_out.read_text())
    epochs = summary.get("epochs") or []
    coordinator = seen[train.pid]["peak"]
    workers = {pid: s for pid, s in seen.items() if pid != train.pid and s["run"] and s["comm"] != FORK_SERVER_NAME}
    others = {pid: s for pid, s in seen.items() if pid != train.pid and pid not in workers}
    model = model_bytes(LINEAR)
    worker_goal = args.cache_mb * 2**20 + model + GOALS["worker_extra_mb"] * 2**20
    mib = lambda b: f"{b / 2**20:.0f} MiB"
    rows = [["coordinator (the train command)", mib(coordinator), f"under {GOALS['coordinator_mb']:g} MiB",
             "met" if coordinator < GOALS["coordinator_mb"] * 2**20 else "not met"]]
    e0 = epochs[0] if epochs else {}
    ranks = {int(pid): int(rank) for rank, pid in (e0.get("worker_pids") or {}).items()}
    label = lambda pid: (f"worker rank {ranks[pid]} (pid {pid}){', evaluates' if ranks[pid] == 0 else ''}"
                         if pid in ranks else f"another worker process of the run (pid {pid}, no epoch's rank)")
    rows += [[label(pid), mib(s["peak"]), f"under {mib(worker_goal)}", "met" if s["peak"] < worker_goal else "not met"]
             for pid, s in sorted(workers.items(), key=lambda item: (ranks.get(item[0], 99), item[0]))]
    rows += [[f"other: {s['comm']} (`{s['cmd'][:60]}`)", mib(s["peak"]), "-", "-"] for pid, s in sorted(others.items())]
    lines = ["## d. Memory: a 2 GB dataset, one epoch, 2 workers", "", run_line(args.command), "",
             f"`{name}` prepared by the prepare flow's function (`flows.prepare.prepare.fn`, in a process of its own, "
             f"no Prefect server) into a directory in shards of {args.shard_rows} rows: "
             f"{total / MB:.0f} MB in {len(manifest['shards']['train'])} + {len(manifest['shards']['val'])} shards, "
             f"{prepare_s:.0f} s (the process's start and the source's generation included). Then "
             f"`python -m flows.train {' '.join(param_args(params))}` (target `inline`): status "
             f"{summary.get('status')}, {len(epochs)} epoch(s), epoch 0 {fmt(e0.get('seconds'), '{:.0f}')} s with "
             f"{e0.get('workers')} workers, the whole command {wall:.0f} s. Peak resident set (`VmHWM`, polled every "
             f"0.1 s; MiB = 2^20 bytes); a worker's goal is `data_cache_mb` {args.cache_mb:g} MiB + its model "
             f"{model / 2**10:.0f} KiB (parameters, gradients, momentum) + {GOALS['worker_extra_mb']:g} MiB. "
             f"Rank 0 also evaluates the validation split: {val_bytes / 2**20:.0f} MiB of shards.", "",
             *table(["process", "peak RSS", "goal", ""], rows)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_data", description=__doc__.splitlines()[0])
    parser.add_argument("--part", nargs="+", choices="abcd", default=list("abcd"),
                        help="the parts to run (default: all); the results file keeps the others' last sections")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", type=int, default=20000, help="training rows of parts a-c")
    parser.add_argument("--val-rows", type=int, default=2000, help="validation rows of parts a-c")
    parser.add_argument("--shard-rows", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64, help="batch of parts b and c")
    parser.add_argument("--memory-rows", type=int, default=160000, help="training rows of part d (validation: a tenth)")
    parser.add_argument("--memory-batch", type=int, default=256)
    parser.add_argument("--cache-mb", type=float, default=256.0, help="part d's data_cache_mb")
    parser.add_argument("--venv", type=Path, default=VENV, help="Streaming's virtualenv (created where missing)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder")
    args = parser.parse_args(argv)
    args.command = command_for("benchmarks.bench_data", argv)
    prov = provenance()
    sections: dict[str, str] = {}
    with scratch("data", keep=args.keep) as folder:
        if set(args.part) & set("abc"):
            bench = S3Bench(folder, args)
            try:
                for part in sorted(set(args.part) & set("abc")):
                    sections[part] = getattr(bench, f"part_{part}")()
                    print(sections[part], flush=True)
            finally:
                bench.close()
        if "d" in args.part:
            sections["d"] = part_d(folder, args)
            print(sections["d"], flush=True)
    body = merged_body(args.out, sections)
    write_result(args.out, TITLE, args.command, prov, body,
                 detail="each part's section says how it ran; Streaming in a virtualenv of its own")
    return 0


if __name__ == "__main__":
    sys.exit(main())
