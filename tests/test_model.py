import math

import pytest
import torch

from raytrain_lm.llama import Llama, LlamaShape
from raytrain_lm.model import GPT, GPTShape

pytestmark = pytest.mark.no_ray

SHAPE = GPTShape(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=32)


def test_shapes_and_loss():
    model = GPT(SHAPE)
    idx = torch.randint(0, 50, (3, 16))
    logits, loss = model(idx, idx)
    assert logits.shape == (3, 16, 50)
    assert loss.shape == ()
    # at initialisation the model is close to uniform over the vocabulary
    assert abs(loss.item() - math.log(50)) < 0.5
    logits, loss = model(idx)
    assert logits.shape == (3, 1, 50) and loss is None


@pytest.mark.parametrize(
    "build",
    [
        lambda: GPT(SHAPE),
        lambda: Llama(
            LlamaShape(50, 16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden=64)
        ),
    ],
    ids=["gpt2", "llama"],
)
def test_causality_future_tokens_do_not_change_the_past(build):
    torch.manual_seed(0)
    model = build().eval()
    a = torch.randint(0, 50, (1, 16))
    b = a.clone()
    b[0, 10:] = (b[0, 10:] + 1) % 50
    la, _ = model(a, a)
    lb, _ = model(b, b)
    assert torch.allclose(la[0, :10], lb[0, :10], atol=1e-6)
    assert not torch.allclose(la[0, 10:], lb[0, 10:])


def test_tied_embeddings_and_gpt2_init():
    torch.manual_seed(0)
    model = GPT(GPTShape(vocab_size=500, block_size=16, n_layer=4, n_head=2, n_embd=64))
    assert model.lm_head.weight is model.transformer.wte.weight
    proj = model.transformer.h[0].attn.c_proj.weight
    assert proj.std().item() == pytest.approx(0.02 / math.sqrt(2 * 4), rel=0.15)
    assert model.transformer.h[0].mlp.c_fc.weight.std().item() == pytest.approx(0.02, rel=0.1)


def test_sequence_longer_than_context_is_refused():
    with pytest.raises(ValueError, match="block_size"):
        GPT(SHAPE)(torch.zeros(1, 17, dtype=torch.long))


def test_weight_decay_groups_cover_every_parameter_once():
    model = GPT(SHAPE)
    decay, no_decay = model.optimizer_groups(0.1)
    ids = [id(p) for g in (decay, no_decay) for p in g["params"]]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    assert all(p.dim() >= 2 for p in decay["params"])


def test_flops_per_token_counts_parameters_and_attention():
    model = GPT(SHAPE)
    expected = 6 * model.num_params() + 12 * 2 * 2 * 16 * 16
    assert model.flops_per_token() == expected


def test_generate_extends_the_prompt():
    model = GPT(SHAPE).eval()
    out = model.generate(
        torch.zeros(1, 3, dtype=torch.long), 20, generator=torch.Generator().manual_seed(0)
    )
    assert out.shape == (1, 23)
