"""Issue 42, item 2: the registry's language models (engine/transformers.py): their shapes, their
parameter counts (the large ones counted on `meta`, no weights drawn), their children that a
pipeline can cut between, and their weights fixed by the seed."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from core.errors import ZooidValueError
from engine.models import REGISTRY, build_model, input_shape
from engine.transformers import Block, Embeddings

COUNTS = {  # (untied, tied with the embedding counted once)
    "gpt_mini": (141_312, 124_800),
    "gpt2_small": (163_037_184, 124_439_808),  # GPT-2 small: 124M
    "bert_mini": (141_570, 125_058),
    "bert_base": (132_361_530, 108_920_634),  # Hydrozoa's BERT-12: 108.9M
    "bert_large": (365_375_290, 334_120_762),  # FuncPipe's BERT-Large: 340M
}
SHAPES = {  # d, layers, heads, vocab, positions
    "gpt_mini": (64, 2, 4, 258, 128),
    "gpt2_small": (768, 12, 12, 50257, 1024),
    "bert_mini": (64, 2, 4, 258, 128),
    "bert_base": (768, 12, 12, 30522, 512),
    "bert_large": (1024, 24, 16, 30522, 512),
}


def _on_meta(name: str, **kwargs) -> nn.Module:
    with torch.device("meta"):
        return REGISTRY[name](**kwargs)


@pytest.mark.parametrize("name", sorted(COUNTS))
def test_parameter_counts_and_shapes_on_meta(name):
    d, layers, heads, vocab, positions = SHAPES[name]
    untied, tied = _on_meta(name), _on_meta(name, tie_embeddings=True)
    assert sum(p.numel() for p in untied.parameters()) == COUNTS[name][0]
    assert sum(p.numel() for p in tied.parameters()) == COUNTS[name][1]  # parameters() counts a shared one once
    assert (untied.vocab_size, untied.max_positions) == (vocab, positions)
    assert hasattr(untied, "mask_token_id") == name.startswith("bert")
    children = list(untied.children())
    assert len(children) == layers + 3
    assert isinstance(children[0], Embeddings) and children[0].tok.weight.shape == (vocab, d)
    assert all(isinstance(c, Block) and c.attn.heads == heads for c in children[1:-2])
    assert isinstance(children[-2], nn.LayerNorm) and isinstance(children[-1], nn.Linear)
    assert children[-1].weight is not children[0].tok.weight
    assert tied[-1].weight is tied[0].tok.weight
    out = untied(torch.empty(2, positions, dtype=torch.long, device="meta"))
    assert out.shape == (2, positions, vocab)
    assert input_shape(name) == (positions,)


@pytest.mark.parametrize("name", ["gpt_mini", "bert_mini"])
def test_the_tiny_models_run_their_children_in_order_on_token_ids(name):
    model = build_model(name, 0).eval()
    ids = torch.randint(0, 258, (3, 16), generator=torch.Generator().manual_seed(0))
    h = ids
    for child in model.children():
        h = child(h)
    with torch.no_grad():
        assert torch.equal(h, model(ids))
    assert h.shape == (3, 16, 258) and h.dtype == torch.float32


def test_gpt_is_causal_and_bert_sees_every_position():
    ids = torch.randint(0, 258, (1, 12), generator=torch.Generator().manual_seed(1))
    changed = ids.clone()
    changed[0, -1] = (changed[0, -1] + 1) % 258
    with torch.no_grad():
        gpt, bert = build_model("gpt_mini", 0).eval(), build_model("bert_mini", 0).eval()
        assert torch.equal(gpt(ids)[:, :-1], gpt(changed)[:, :-1])  # no position sees a later one
        assert not torch.equal(bert(ids)[:, 0], bert(changed)[:, 0])


def test_gpt_mini_is_fixed_by_its_seed():
    a, b, c = build_model("gpt_mini", 7), build_model("gpt_mini", 7), build_model("gpt_mini", 8)
    assert a.state_dict().keys() == b.state_dict().keys()
    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())
    assert not torch.equal(a.state_dict()["0.tok.weight"], c.state_dict()["0.tok.weight"])
    ids = torch.randint(0, 258, (2, 32), generator=torch.Generator().manual_seed(0))
    assert torch.equal(a(ids), b(ids))  # dropout 0: the forward is deterministic too


def test_weights_are_drawn_as_gpt2_draws_them():
    model = build_model("gpt_mini", 0)
    assert abs(float(model[0].tok.weight.detach().std()) - 0.02) < 0.002
    assert abs(float(model[1].attn.proj.weight.detach().std()) - 0.02 / 2) < 0.002  # 1/sqrt(2 * 2 layers)
    assert float(model[1].attn.qkv.bias.detach().abs().sum()) == 0.0
    assert torch.equal(model[-2].weight, torch.ones(64))


def test_factories_take_the_vocabulary_and_the_mask_token():
    model = build_model("bert_mini", 0, vocab_size=100, mask_token_id=99, max_positions=32)
    assert (model.vocab_size, model.mask_token_id, model.max_positions) == (100, 99, 32)
    assert model(torch.zeros(1, 32, dtype=torch.long)).shape == (1, 32, 100)
    assert build_model("bert_mini", 0, vocab_size=100).mask_token_id == 99  # default: the last id
    with pytest.raises(ZooidValueError, match="^mask_token_id: "):
        build_model("bert_mini", 0, vocab_size=100, mask_token_id=100)
    with pytest.raises(ZooidValueError, match="^heads: 5 heads do not divide d_model 64"):
        build_model("gpt_mini", 0, heads=5)
