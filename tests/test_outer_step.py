"""`engine.outer.OuterStep` alone, on named tensors: one round's arithmetic against the formula
written here, and the round-start snapshot it keeps (`tests/test_outer_sync.py` runs it through
the engine and a store)."""
from __future__ import annotations

import pytest
import torch

from engine.outer import OuterStep


@pytest.mark.parametrize("optimizer,deltas", [("nesterov", False), ("nesterov", True), ("average", True),
                                              ("average", False)])
def test_an_outer_round_is_the_formula_bit_for_bit_and_snapshots_only_what_it_reads(optimizer, deltas):
    """`OuterStep` over named tensors, three rounds, against the per-tensor formula written here:
    the same numbers to the bit; its round-start snapshot holds the tensors the next round reads
    (sent as changes, or a parameter of a nesterov step), none of the others."""
    gen = torch.Generator().manual_seed(0)
    shapes = {"param/w": (5, 3), "param/b": (3,), "optim/w.momentum_buffer": (5, 3), "buffer/bn.running_mean": (3,)}
    live = {n: torch.randn(s, generator=gen, dtype=torch.float64) for n, s in shapes.items()}
    theta = {n: t.clone() for n, t in live.items()}  # the round's start, as the formula keeps it
    momentum: dict = {}
    outer = OuterStep(optimizer, 0.7, 0.3, deltas=deltas)
    outer.start(live)
    for _ in range(3):
        for t in live.values():
            t.add_(torch.randn(t.shape, generator=gen, dtype=t.dtype))  # the inner steps
        sent = outer.payload(live)
        for n, t in sent.items():
            want = live[n] - theta[n] if deltas and not n.startswith("buffer/") else live[n]
            assert torch.equal(t, want)
        reduced = {n: t + torch.randn(t.shape, generator=gen, dtype=t.dtype) for n, t in sent.items()}
        expected = {}
        for n, r in reduced.items():
            mean = theta[n] + r if deltas and not n.startswith("buffer/") else r
            if optimizer == "nesterov" and n.startswith("param/"):
                delta = theta[n] - mean
                momentum[n] = delta.clone() if n not in momentum else momentum[n] * 0.3 + delta
                mean = theta[n] - 0.7 * (delta + 0.3 * momentum[n])
            expected[n] = mean
        outer.apply(live, reduced)
        for n, t in live.items():
            assert torch.equal(t, expected[n]), n
        theta = {n: t.clone() for n, t in live.items()}
        reads = {n for n in live if (deltas and not n.startswith("buffer/"))
                 or (optimizer == "nesterov" and n.startswith("param/"))}
        assert set(outer.ref) == reads
        for n in reads:
            assert torch.equal(outer.ref[n], live[n]) and outer.ref[n].data_ptr() != live[n].data_ptr()
    assert set(outer.momentum) == ({"param/w", "param/b"} if optimizer == "nesterov" else set())
