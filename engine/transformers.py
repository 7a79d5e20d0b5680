"""Transformer language models in plain torch: a causal GPT and a masked-LM BERT.

Every model is an `nn.Sequential` of top-level children, so the partitioner can cut it between
blocks: the embeddings (token + learned position, `Embeddings`), `layers` pre-norm blocks
(`Block`: LayerNorm -> self-attention -> residual, LayerNorm -> GELU MLP -> residual), a final
LayerNorm and the vocabulary head (`nn.Linear`). Input: int64 token ids `[B, T]`; output:
logits `[B, T, vocab_size]`. Attention is `F.scaled_dot_product_attention`, causal for GPT
(`is_causal=True`), over every position for BERT.

A built model carries `vocab_size` and `max_positions`; a masked-LM model also
`mask_token_id` (a model without it has no mask token, and `objective=mlm` refuses it).
Weights are drawn as GPT-2 and BERT draw them: normal(0, 0.02) for every linear and embedding
weight, zero biases, LayerNorms at one and zero; GPT's residual projections are scaled by
1/sqrt(2 * layers) (GPT-2). Dropout is 0 by default, so a run is deterministic by seed.

The head is not tied to the token embedding by default: in a pipeline the embedding and the
head land on different stages, and a parameter shared between stages is refused
(`engine.models.shared_parameters`). `tie_embeddings=True` ties them (Local-SGD trains it).

| name | d | layers | heads | vocab | positions | parameters, untied (tied) |
|---|---|---|---|---|---|---|
| `gpt_mini` | 64 | 2 | 4 | 258 | 128 | 141,312 (124,800) |
| `gpt2_small` | 768 | 12 | 12 | 50257 | 1024 | 163,037,184 (124,439,808: GPT-2's 124M) |
| `bert_mini` | 64 | 2 | 4 | 258 | 128 | 141,570 (125,058) |
| `bert_base` | 768 | 12 | 12 | 30522 | 512 | 132,361,530 (108,920,634: BERT-12's 108.9M) |
| `bert_large` | 1024 | 24 | 16 | 30522 | 512 | 365,375,290 (334,120,762: BERT-Large's 340M) |

(Byte vocabularies: 256 bytes, end-of-text 256, mask 257.) BERT's segment embeddings and its
head's extra dense layer are left out: the models train masked-LM only, on one segment.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from core.errors import ZooidValueError

INIT_STD = 0.02
"""Standard deviation of the normal initialisation of GPT-2 and BERT."""

BYTE_VOCAB = 258
"""256 byte values, end-of-text (256) and mask (257): the tiny models' default vocabulary."""


class Embeddings(nn.Module):
    """Token and learned position embeddings, summed: `[B, T]` ids -> `[B, T, d]`."""

    def __init__(self, vocab_size: int, max_positions: int, d_model: int, dropout: float = 0.0):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_positions, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Embed token ids `[B, T]` (T at most `max_positions`)."""
        positions = torch.arange(ids.shape[-1], device=ids.device)
        return self.drop(self.tok(ids) + self.pos(positions))


class SelfAttention(nn.Module):
    """Multi-head self-attention: one fused q/k/v projection, SDPA, an output projection."""

    def __init__(self, d_model: int, heads: int, causal: bool, dropout: float = 0.0):
        super().__init__()
        self.heads, self.causal, self.dropout = heads, causal, dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`[B, T, d]` -> `[B, T, d]`."""
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-norm transformer block: `x + attn(ln1(x))`, then `x + mlp(ln2(x))` (GELU, 4d wide)."""

    def __init__(self, d_model: int, heads: int, causal: bool, dropout: float = 0.0,
                 gelu: str = "none"):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = SelfAttention(d_model, heads, causal, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(approximate=gelu),
                                 nn.Linear(4 * d_model, d_model))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`[B, T, d]` -> `[B, T, d]`."""
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


def _init_weights(model: nn.Module, residual_std: float | None) -> None:
    """GPT-2/BERT initialisation (see the module docstring); `residual_std`, when given, for
    the projections that write into the residual stream."""
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, 0.0, INIT_STD)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
    if residual_std is not None:
        for module in model.modules():
            if isinstance(module, Block):
                nn.init.normal_(module.attn.proj.weight, 0.0, residual_std)
                nn.init.normal_(module.mlp[2].weight, 0.0, residual_std)


def _check_sizes(vocab_size: int, max_positions: int, d_model: int, layers: int, heads: int) -> None:
    for field, value in (("vocab_size", vocab_size), ("max_positions", max_positions),
                         ("d_model", d_model), ("layers", layers), ("heads", heads)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ZooidValueError(field, f"must be a positive integer, got {value!r}")
    if d_model % heads:
        raise ZooidValueError("heads", f"{heads} heads do not divide d_model {d_model}")


def transformer(vocab_size: int, max_positions: int, d_model: int, layers: int, heads: int, *,
                causal: bool, dropout: float = 0.0, tie_embeddings: bool = False,
                head_bias: bool = False, gelu: str = "none") -> nn.Sequential:
    """A language model as `nn.Sequential(Embeddings, Block x layers, LayerNorm, Linear head)`,
    initialised (GPT-2's scaled residual projections when `causal`), carrying `vocab_size`
    and `max_positions`. `tie_embeddings`: the head's weight is the token embedding's."""
    _check_sizes(vocab_size, max_positions, d_model, layers, heads)
    embeddings = Embeddings(vocab_size, max_positions, d_model, dropout)
    head = nn.Linear(d_model, vocab_size, bias=head_bias)
    model = nn.Sequential(embeddings, *(Block(d_model, heads, causal, dropout, gelu) for _ in range(layers)),
                          nn.LayerNorm(d_model), head)
    _init_weights(model, INIT_STD / math.sqrt(2 * layers) if causal else None)
    if tie_embeddings:
        head.weight = embeddings.tok.weight
    model.vocab_size = vocab_size
    model.max_positions = max_positions
    return model


def _gpt(vocab_size: int, max_positions: int, d_model: int, layers: int, heads: int,
         dropout: float, tie_embeddings: bool) -> nn.Sequential:
    return transformer(vocab_size, max_positions, d_model, layers, heads, causal=True, dropout=dropout,
                       tie_embeddings=tie_embeddings, gelu="tanh")


def _bert(vocab_size: int, max_positions: int, d_model: int, layers: int, heads: int, dropout: float,
          tie_embeddings: bool, mask_token_id: int | None) -> nn.Sequential:
    mask = vocab_size - 1 if mask_token_id is None else mask_token_id
    if not isinstance(mask, int) or isinstance(mask, bool) or not 0 <= mask < vocab_size:
        raise ZooidValueError("mask_token_id", f"must be a token id below vocab_size {vocab_size}, got {mask!r}")
    model = transformer(vocab_size, max_positions, d_model, layers, heads, causal=False, dropout=dropout,
                        tie_embeddings=tie_embeddings, head_bias=True)
    model.mask_token_id = mask
    return model


def gpt_mini(vocab_size: int = BYTE_VOCAB, max_positions: int = 128, d_model: int = 64, layers: int = 2,
             heads: int = 4, dropout: float = 0.0, tie_embeddings: bool = False) -> nn.Sequential:
    """A tiny causal GPT for tests (d 64, 2 blocks, 4 heads, 128 positions, byte vocabulary):
    141,312 parameters untied, 124,800 tied."""
    return _gpt(vocab_size, max_positions, d_model, layers, heads, dropout, tie_embeddings)


def gpt2_small(vocab_size: int = 50257, max_positions: int = 1024, d_model: int = 768, layers: int = 12,
               heads: int = 12, dropout: float = 0.0, tie_embeddings: bool = False) -> nn.Sequential:
    """GPT-2 small: d 768, 12 blocks, 12 heads, 1024 positions, GPT-2's 50257 tokens. With the
    embedding tied to the head (counted once) 124,439,808 parameters, GPT-2's 124M; untied (the
    default, so a pipeline may place the two on different stages) 163,037,184."""
    return _gpt(vocab_size, max_positions, d_model, layers, heads, dropout, tie_embeddings)


def bert_mini(vocab_size: int = BYTE_VOCAB, max_positions: int = 128, mask_token_id: int | None = None,
              d_model: int = 64, layers: int = 2, heads: int = 4, dropout: float = 0.0,
              tie_embeddings: bool = False) -> nn.Sequential:
    """A tiny masked-LM BERT for tests (d 64, 2 blocks, 4 heads, 128 positions, byte
    vocabulary); `mask_token_id` defaults to the last id (257 for bytes)."""
    return _bert(vocab_size, max_positions, d_model, layers, heads, dropout, tie_embeddings, mask_token_id)


def bert_base(vocab_size: int = 30522, max_positions: int = 512, mask_token_id: int | None = None,
              d_model: int = 768, layers: int = 12, heads: int = 12, dropout: float = 0.0,
              tie_embeddings: bool = False) -> nn.Sequential:
    """BERT-12's shape (Hydrozoa's BERT-12, 108.9M): d 768, 12 blocks, 12 heads, 512 positions,
    BERT's 30522 tokens. 108,920,634 parameters with the head tied to the embedding (counted
    once); untied (the default) 132,361,530. `mask_token_id` defaults to the last id."""
    return _bert(vocab_size, max_positions, d_model, layers, heads, dropout, tie_embeddings, mask_token_id)


def bert_large(vocab_size: int = 30522, max_positions: int = 512, mask_token_id: int | None = None,
               d_model: int = 1024, layers: int = 24, heads: int = 16, dropout: float = 0.0,
               tie_embeddings: bool = False) -> nn.Sequential:
    """BERT-Large's shape (FuncPipe's BERT-Large, 340M): d 1024, 24 blocks, 16 heads, 512
    positions, 30522 tokens. 334,120,762 parameters tied (counted once); untied (the default)
    365,375,290. `mask_token_id` defaults to the last id."""
    return _bert(vocab_size, max_positions, d_model, layers, heads, dropout, tie_embeddings, mask_token_id)


LANGUAGE_MODELS = {"gpt_mini": gpt_mini, "gpt2_small": gpt2_small, "bert_mini": bert_mini,
                   "bert_base": bert_base, "bert_large": bert_large}
"""The registry's language models (`engine.models.REGISTRY` includes them)."""
