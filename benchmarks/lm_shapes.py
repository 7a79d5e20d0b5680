"""Token datasets of BERT's shape for dry runs (`flows.dry_run`, rent=false): a plan needs only
the data's shapes and sizes, so these are seeded random BERT-vocabulary ids, not text.

`bert_mlm_128` and `bert_mlm_512`: int64 token ids [N, T] below BERT's 30522-token vocabulary,
and masked-LM targets [N, T]: the id at 15 % of the positions (drawn per position), -100 (not
scored) elsewhere; the largest id appears among the targets, so the dataset's token count is the
whole vocabulary. 1024 training and 256 validation rows.
"""
from __future__ import annotations

import torch

BERT_VOCAB = 30522
"""BERT's WordPiece vocabulary (the registry's `bert_base` and `bert_large` default)."""


def _masked(rows: int, seq_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, BERT_VOCAB, (rows, seq_len), generator=g)
    x[0, 0] = BERT_VOCAB - 1
    scored = torch.rand(rows, seq_len, generator=g) < 0.15
    scored[0, 0] = True
    return x, x.masked_fill(~scored, -100)


def bert_mlm_128():
    """((x_train, y_train), (x_val, y_val)) of 128 tokens per sample (module docstring)."""
    return _masked(1024, 128, 0), _masked(256, 128, 1)


def bert_mlm_512():
    """The same at 512 tokens per sample, BERT's longest."""
    return _masked(1024, 512, 0), _masked(256, 512, 1)
