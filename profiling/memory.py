"""Measure the memory a model needs on the hardware it will train on.

- bytes of tensors and parameters, and the distinct storages autograd saves for the
  backward pass (`_SavedTensors`, `measure_activation_bytes`);
- the process's resident memory (`rss_bytes`) and its peak since a reset of the kernel's mark;
- what the loss adds at the head (`loss_memory_bytes`: the logits, [B, C] for classes and
  [B, T, V] for tokens, and the log-softmax the cross-entropy keeps for its backward);
- the peak memory of one training step (`measure_peak_memory`: CUDA's allocator peak, or
  on CPU parameters + gradients + optimizer state + activations (the loss's included) + the
  batch, counted tensor by tensor);
- s0, the base memory of a fresh worker process (`measure_base_memory`, in a subprocess
  running `profiling.base_memory`).

The whole-model profile that gathers these is `profiling.profiler.profile_model`.
"""
from __future__ import annotations

import functools
import os
import resource
import subprocess
import sys
from typing import Callable, Sequence

import torch
from torch import nn

from core.errors import ZooidError
from profiling.sample import profile_loss


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _param_bytes(module: nn.Module) -> int:
    return sum(_nbytes(p) for p in module.parameters())


class _SavedTensors:
    """Counts the distinct storages autograd saves for backward while active; parameters
    (and anything else listed in `exclude`) are not activations and are left out."""

    def __init__(self, exclude: Sequence[torch.Tensor] = ()):
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._seen: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self._exclude and ptr not in self._seen:
            self._seen[ptr] = storage.nbytes()
        return t

    @property
    def bytes(self) -> int:
        """Bytes of the distinct storages saved so far."""
        return sum(self._seen.values())

    def __enter__(self) -> "_SavedTensors":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def rss_bytes() -> int:
    """Current resident set size (Linux /proc; elsewhere the peak, the best there is)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark of this process (Linux clear_refs); False if not."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_since_reset() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def loss_memory_bytes(output: torch.Tensor, target: torch.Tensor, loss: str | None = None) -> int:
    """Bytes the loss adds at the model's head for one batch: the `output` (the logits, held
    from the forward until the loss's backward has made their gradient: [B, T, V] for a
    language model, usually the largest tensor of its last stage) and what the loss keeps for
    its backward (the log-softmax, as large again, and a scalar; a custom `loss`: what it keeps),
    the `target` not counted (it is the batch's)."""
    out = output.detach().requires_grad_(True)
    with _SavedTensors(exclude=[target]) as saved:
        profile_loss(out, target, loss)
    return _nbytes(out) + saved.bytes


def measure_activation_bytes(model: nn.Module, x: torch.Tensor, y: torch.Tensor | None = None,
                             loss: str | None = None) -> int:
    """Bytes the whole model keeps for backward on batch `x` (each storage once); with the
    targets `y`, the loss's too (`loss_memory_bytes`, the job's `loss`)."""
    with _SavedTensors(exclude=list(model.parameters())) as saved:
        out = model(x)
    return saved.bytes + (loss_memory_bytes(out, y, loss) if y is not None else 0)


def _training_step(model: nn.Module, opt: torch.optim.Optimizer, x, y, loss: str | None = None) -> Callable[[], None]:
    def step() -> None:
        opt.zero_grad(set_to_none=True)
        profile_loss(model(x), y, loss).backward()
        opt.step()

    return step


def measure_peak_memory(model: nn.Module, opt: torch.optim.Optimizer, x, y,
                        loss: str | None = None) -> tuple[int, str, int, int]:
    """(peak bytes, method, RSS growth bytes, optimizer state bytes) of one training step.

    CUDA: `torch.cuda.max_memory_allocated` over the step (method `cuda_max_allocated`).
    CPU (`cpu_accounted`): parameters + gradients + optimizer state + the activations
    autograd keeps (the loss's logits and log-softmax included) + the batch, counted tensor
    by tensor. The allocator's own slack is
    not in it; the RSS growth over the step (peak RSS after resetting the kernel's mark,
    minus RSS before) is reported beside it for comparison, 0 where it cannot be read."""
    step = _training_step(model, opt, x, y, loss)
    step()  # the optimizer allocates its state on the first step
    state_bytes = sum(_nbytes(v) for s in opt.state.values() for v in s.values()
                      if isinstance(v, torch.Tensor))
    if x.device.type == "cuda":
        torch.cuda.synchronize(x.device)
        torch.cuda.reset_peak_memory_stats(x.device)
        step()
        torch.cuda.synchronize(x.device)
        return int(torch.cuda.max_memory_allocated(x.device)), "cuda_max_allocated", 0, state_bytes
    before = rss_bytes()
    growth = 0
    if _reset_peak_rss():
        step()
        growth = max(0, _peak_rss_since_reset() - before)
    params = sum(_nbytes(p) for p in model.parameters())
    grads = sum(_nbytes(p) for p in model.parameters() if p.requires_grad)
    acts = measure_activation_bytes(model, x, y, loss)
    peak = params + grads + state_bytes + acts + _nbytes(x) + _nbytes(y)
    return peak, "cpu_accounted", growth, state_bytes


@functools.lru_cache(maxsize=16)
def measure_base_memory(modules: tuple[str, ...] = ()) -> int:
    """s0: resident bytes of a fresh worker-like process (`profiling.base_memory`) after
    importing torch, the model registry and the user's model `modules` (and running one tiny
    backward), measured once per process in a subprocess and cached.
    The model is not built: its parameters are counted separately by the memory model."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd()] + [p for p in sys.path if p])
    try:
        done = subprocess.run([sys.executable, "-m", "profiling.base_memory", *modules], env=env,
                              capture_output=True, text=True, timeout=300, check=True)
        return int(done.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError, OSError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        raise ZooidError(f"measuring the base memory of a worker failed: {detail.strip()[-300:]}") from None
