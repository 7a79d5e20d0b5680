"""Checkpoints in the store: model state_dict and optimizer state as named tensors plus JSON
metadata, written in one put (atomic) through `tensor_codec`; never pickled.

Tensor names are `model/<state_dict key>`, `optim/<param name>.<state key>` and, for the
state of a Local-SGD outer optimizer (`engine.outer`), `outer/...`. The metadata
carries what the caller passes (epoch, step, run id...) and the model and optimizer names.

Two kinds of checkpoint, both durable: the epoch checkpoint (`WorkerSpec.out_key`, written
by rank 0 at the end of an epoch) and the sync checkpoint `core.keys.sync_checkpoint_key(run, epoch)`,
overwritten in place (one atomic put, behind the training thread: `CheckpointWriter`) by
rank 0 at every Local-SGD sync of the epoch with the averaged state and the data position
(step, sync round); a relaunched replica resumes from it (`engine.local_sgd`).
"""
from __future__ import annotations

import json
import threading
from typing import Any, Callable

import torch
from torch import nn

from comm.store import Store
from comm.tensor_codec import decode_tensors, encode_tensors, read_header
from core.errors import ZooidValueError
from engine.models import build_model
from engine.optimizers import build_optimizer, load_optimizer_state, optimizer_state_tensors

FORMAT = "zooid-checkpoint-1"


def encode_checkpoint(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    meta: dict[str, Any] | None = None,
    extra: dict[str, torch.Tensor] | None = None,
) -> bytes:
    """The bytes of a checkpoint of `model` (and `optimizer`'s state, and `extra` tensors
    named `outer/...`): a copy, so training may change the tensors once this returns."""
    tensors = {f"model/{k}": v.detach().contiguous() for k, v in model.state_dict().items()}
    if optimizer is not None:
        for k, v in optimizer_state_tensors(model, optimizer).items():
            tensors[f"optim/{k}"] = v.detach().contiguous()
    for k, v in (extra or {}).items():
        if not k.startswith("outer/"):
            raise ZooidValueError("extra", f"checkpoint tensor {k!r} must be named outer/...")
        tensors[k] = v.detach().contiguous()
    # safetensors metadata is str -> str: the caller's metadata travels as one JSON string.
    return encode_tensors(tensors, metadata={"format": FORMAT, "meta": json.dumps(meta or {})})


def save_checkpoint(
    store: Store,
    key: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    meta: dict[str, Any] | None = None,
    extra: dict[str, torch.Tensor] | None = None,
) -> int:
    """Write `model` (and `optimizer`'s state, and `extra` tensors named `outer/...`) under
    `key` in one put; return the bytes written."""
    blob = encode_checkpoint(model, optimizer, meta, extra)
    store.put(key, blob)
    return len(blob)


class CheckpointWriter:
    """Checkpoints put behind the training thread: `write` encodes the state at once (a
    copy) and puts it into `store` on a thread of its own, so the store's round trip (a
    file's fsync, a request) overlaps the next step instead of holding it; `wait` blocks
    until the last write is in the store and raises what it raised. One write at a time: a
    write first waits for the one before. A process that dies with a write in flight loses
    that checkpoint whole, never half of it (a put is atomic): as if it had died before
    writing it. The thread is a daemon, so a stuck store never keeps a failing worker from
    exiting; whoever needs the checkpoint in the store calls `wait`."""

    def __init__(self, store: Store):
        self.store = store
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def write(self, key: str, model: nn.Module, optimizer: torch.optim.Optimizer | None,
              meta: dict[str, Any] | None = None, extra: dict[str, torch.Tensor] | None = None,
              then: Callable[[], None] | None = None) -> int:
        """Start putting the checkpoint under `key`, then run `then` on the writer's thread
        once it is in the store; the bytes being written."""
        self.wait()
        blob = encode_checkpoint(model, optimizer, meta, extra)

        def put() -> None:
            try:
                self.store.put(key, blob)
                if then is not None:
                    then()
            except BaseException as exc:  # noqa: BLE001 - raised by wait() in the training thread
                self._error = exc

        self._thread = threading.Thread(target=put, name="checkpoint-writer", daemon=True)
        self._thread.start()
        return len(blob)

    def wait(self) -> None:
        """Block until the last write (and its `then`) is done; raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error


def load_checkpoint(
    store: Store,
    key: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    timeout: float | None = None,
    extra: dict[str, torch.Tensor] | None = None,
) -> dict[str, Any]:
    """Load the checkpoint under `key` into `model` (strictly) and `optimizer`; return its
    metadata, and fill `extra` (when given) with its `outer/...` tensors, from the same read.
    Waits up to `timeout` seconds for the key."""
    tensors, header = decode_tensors(store.get(key, timeout=timeout))
    if header.get("format") != FORMAT:
        raise ZooidValueError("checkpoint", f"{key} is not a Zooid checkpoint")
    meta = json.loads(header.get("meta", "{}"))
    if extra is not None:
        extra.clear()
        extra.update({k: v for k, v in tensors.items() if k.startswith("outer/")})
    state = {k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")}
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise ZooidValueError("checkpoint", f"{key} does not fit the model: {exc}") from None
    if optimizer is not None:
        optimizer.state.clear()
        load_optimizer_state(
            model, optimizer,
            {k.removeprefix("optim/"): v for k, v in tensors.items() if k.startswith("optim/")},
        )
    return meta


def initial_checkpoint(
    store: Store,
    key: str,
    model: str,
    optimizer: str,
    lr: float,
    seed: int = 0,
    model_kwargs: dict[str, Any] | None = None,
    meta: dict[str, Any] | None = None,
) -> int:
    """Write the reference checkpoint an epoch-0 worker starts from: model `model` built from
    `seed` and `model_kwargs` (recorded in its metadata: what rebuilds the model), empty
    optimizer state. Return the bytes written."""
    net = build_model(model, seed, **(model_kwargs or {}))
    opt = build_optimizer(optimizer, net, lr)
    base = {"model": model, "model_kwargs": dict(model_kwargs or {}), "optimizer": optimizer, "seed": seed,
            "epoch": -1, "step": 0}
    return save_checkpoint(store, key, net, opt, {**base, **(meta or {})})


def read_checkpoint_meta(store: Store, key: str) -> dict[str, Any] | None:
    """The metadata of the checkpoint under `key` without loading its tensors, or None when
    there is no checkpoint there."""
    try:
        header = read_header(store.get(key))
    except KeyError:
        return None
    metadata = header.get("__metadata__") or {}
    if metadata.get("format") != FORMAT:
        raise ZooidValueError("checkpoint", f"{key} is not a Zooid checkpoint")
    return json.loads(metadata.get("meta", "{}"))
