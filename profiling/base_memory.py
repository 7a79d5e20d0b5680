"""s0, a worker's base memory: run as `python -m profiling.base_memory [module ...]` in a fresh
process, it imports what every worker imports (torch and the model registry), then the user's
own model modules named by import path, runs one tiny backward so the allocator and thread
pools a worker always has are counted, and prints its resident bytes.
"""
from __future__ import annotations

import importlib
import os
import sys

import torch

import engine.models  # noqa: F401  (every worker builds its model through the registry)


def resident_bytes() -> int:
    """This process's resident set size, in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main(argv: list[str]) -> int:
    for name in argv:  # the user's model modules, given by import path
        importlib.import_module(name)
    w = torch.ones(8, 8, requires_grad=True)
    (w @ w).sum().backward()
    print(resident_bytes())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
