"""A user's language model, token data and custom loss, given to Zooid by import path in tests.

`tiny_causal_lm` is a causal transformer the registry does not have (token and position
embeddings, two pre-norm blocks, a final norm and a vocabulary head, as top-level children of
an `nn.Sequential`, so a pipeline can cut it between blocks). `token_data` is a dataset factory
of next-token windows over a learnable sequence; `masked_token_data` the same with a third of
the targets set to -100 (ignored), unevenly per row. `regression_data`, `tiny_regressor` and
`mse` train a regression under a custom loss.
"""
from __future__ import annotations

import math

import torch
from torch import nn

VOCAB, SEQ, D_MODEL = 24, 8, 16


class TokenEmbedding(nn.Module):
    """Token + learned position embeddings: [B, T] ids -> [B, T, d]."""

    def __init__(self, vocab: int, positions: int, d: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(positions, d)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))


class CausalBlock(nn.Module):
    """Pre-norm block: causal self-attention (written out, no fused kernel) and an MLP."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        attn = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


def tiny_causal_lm(vocab_size: int = VOCAB, max_positions: int = SEQ, d_model: int = D_MODEL,
                   layers: int = 2, heads: int = 2) -> nn.Sequential:
    """[B, T] token ids -> [B, T, vocab_size] next-token logits."""
    model = nn.Sequential(TokenEmbedding(vocab_size, max_positions, d_model),
                          *(CausalBlock(d_model, heads) for _ in range(layers)),
                          nn.LayerNorm(d_model), nn.Linear(d_model, vocab_size))
    model.vocab_size, model.max_positions = vocab_size, max_positions
    return model


def _windows(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`n` windows of SEQ tokens of the sequence t -> (5 t + 3) mod VOCAB (a permutation of
    the vocabulary) from random starts, and their next tokens."""
    g = torch.Generator().manual_seed(seed)
    seq = torch.empty(n, SEQ + 1, dtype=torch.long)
    seq[:, 0] = torch.randint(0, VOCAB, (n,), generator=g)
    for i in range(1, SEQ + 1):
        seq[:, i] = (5 * seq[:, i - 1] + 3) % VOCAB
    return seq[:, :-1].clone(), seq[:, 1:].clone()


def token_data():
    """((x_train, y_train), (x_val, y_val)): int64 [N, SEQ] token windows and next tokens."""
    return _windows(384, 0), _windows(96, 1)


def masked_token_data():
    """`token_data` with about a third of the target positions -100 (not scored), drawn per
    position, so rows score different numbers of positions."""
    out = []
    for seed, (x, y) in enumerate(token_data()):
        drop = torch.rand(y.shape, generator=torch.Generator().manual_seed(10 + seed)) < 1 / 3
        out.append((x, y.masked_fill(drop, -100)))
    return tuple(out)


def tiny_regressor() -> nn.Sequential:
    """8 features -> 1 value."""
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def regression_data():
    """y = sum of the first four features minus the rest, float targets [N]."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=g)
    y = x[:, :4].sum(1) - x[:, 4:].sum(1)
    return (x[:384], y[:384]), (x[384:], y[384:])


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error of a [B, 1] prediction against [B] values."""
    return ((output.squeeze(-1) - target) ** 2).mean()
