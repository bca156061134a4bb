"""The llama architecture and the model presets: pure PyTorch, checked on CPU in seconds."""

import math
import re
from typing import get_args

import pytest
import torch
import torch.nn.functional as F

from raytrain_lm.causal_lm import attention_flops_per_token
from raytrain_lm.config import MODEL_PRESETS, ModelConfig, load_config
from raytrain_lm.errors import UserError
from raytrain_lm.llama import Llama, LlamaShape, apply_rope, rope_tables, swiglu_hidden
from raytrain_lm.models import build_model, parameter_count

pytestmark = pytest.mark.no_ray

SHAPE = LlamaShape(
    vocab_size=50, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden=64
)


def test_shapes_loss_and_uniform_start():
    torch.manual_seed(0)
    model = Llama(SHAPE)
    idx, targets = torch.randint(0, 50, (3, 16)), torch.randint(0, 50, (3, 16))
    logits, loss = model(idx, targets)
    assert logits.shape == (3, 16, 50) and loss.shape == ()
    assert abs(loss.item() - math.log(50)) < 0.5
    logits, loss = model(idx)
    assert logits.shape == (3, 1, 50) and loss is None


def test_rope_makes_attention_scores_depend_on_distance_only():
    cos, sin = rope_tables(8, 32, 10_000.0)
    torch.manual_seed(0)
    q, k = torch.randn(8), torch.randn(8)

    def score(i: int, j: int) -> float:
        qi = apply_rope(q.view(1, 1, 1, 8), cos[i : i + 1], sin[i : i + 1])
        kj = apply_rope(k.view(1, 1, 1, 8), cos[j : j + 1], sin[j : j + 1])
        return float((qi * kj).sum())

    assert score(3, 1) == pytest.approx(score(20, 18), abs=1e-5)
    assert score(3, 1) != pytest.approx(score(3, 2), abs=1e-3)
    # position 0 is not rotated, and rotation keeps lengths
    assert torch.allclose(apply_rope(q.view(1, 1, 1, 8), cos[:1], sin[:1]).flatten(), q)
    rotated = apply_rope(q.view(1, 1, 1, 8), cos[5:6], sin[5:6])
    assert rotated.norm().item() == pytest.approx(q.norm().item(), rel=1e-6)


def test_grouped_query_attention_shares_each_key_value_head_among_its_query_heads():
    """With every key/value head copied out to its query heads (as full multi-head attention
    with repeated weights), the model computes the same logits."""
    torch.manual_seed(0)
    grouped = Llama(SHAPE).eval()
    full = Llama(LlamaShape(**{**SHAPE.__dict__, "n_kv_head": SHAPE.n_head})).eval()
    state = grouped.state_dict()
    repeat = SHAPE.n_head // SHAPE.n_kv_head
    for key in list(state):
        if key.endswith(("k_proj.weight", "v_proj.weight")):
            heads = state[key].view(SHAPE.n_kv_head, SHAPE.head_dim, SHAPE.n_embd)
            state[key] = heads.repeat_interleave(repeat, dim=0).reshape(-1, SHAPE.n_embd)
    full.load_state_dict(state)
    idx = torch.randint(0, 50, (2, 16))
    assert torch.allclose(grouped(idx, idx)[0], full(idx, idx)[0], atol=1e-5)
    assert grouped.num_params() < full.num_params()


def test_no_biases_tied_or_untied_and_hugging_face_names():
    tied = Llama(SHAPE)
    assert tied.lm_head.weight is tied.embed_tokens.weight
    assert not [n for n, _ in tied.named_parameters() if n.endswith("bias")]
    names = set(tied.state_dict())
    assert {
        "embed_tokens.weight",
        "layers.0.input_layernorm.weight",
        "layers.0.self_attn.q_proj.weight",
        "layers.0.self_attn.k_proj.weight",
        "layers.0.self_attn.v_proj.weight",
        "layers.0.self_attn.o_proj.weight",
        "layers.0.post_attention_layernorm.weight",
        "layers.0.mlp.gate_proj.weight",
        "layers.0.mlp.up_proj.weight",
        "layers.0.mlp.down_proj.weight",
        "norm.weight",
        "lm_head.weight",
    } == {n for n in names if not n.startswith("layers.1.")}
    untied = Llama(LlamaShape(**{**SHAPE.__dict__, "tie_embeddings": False}))
    assert untied.lm_head.weight is not untied.embed_tokens.weight
    assert untied.num_params(False) - tied.num_params(False) == 50 * 32
    # the lookup table is not multiplied per token; a tied output projection is
    assert untied.num_params() == tied.num_params() == tied.num_params(False)


def test_the_model_learns_a_repeating_sequence():
    torch.manual_seed(0)
    model = Llama(SHAPE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx = torch.arange(17).remainder(7).repeat(4, 1)
    for _ in range(60):
        _, loss = model(idx[:, :-1], idx[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.1
    out = model.eval().generate(idx[:1, :8], 8, top_k=1)
    assert out[0, 8:].tolist() == idx[0, 8:16].tolist()


def test_swiglu_width_costs_what_gpt_mlp_costs():
    assert swiglu_hidden(4096, 256) == 11008  # Llama 2 7B
    assert swiglu_hidden(768) == 2048
    assert 3 * 768 * swiglu_hidden(768) == 2 * 768 * 4 * 768


@pytest.mark.parametrize(
    ("preset", "vocab", "expected"),
    [
        ("tiny", 257, None),
        ("125m", 50_257, 123_551_232),
        ("1b", 128_256, 1_235_814_400),  # Llama 3.2 1B as published
        ("7b", 32_000, 6_738_415_616),  # Llama 2 7B as published
    ],
)
def test_presets_match_the_closed_form_counts_and_flops(preset, vocab, expected):
    cfg = load_config(None, [f"model.preset={preset}"]).model
    with torch.device("meta"):  # shapes only: a 7B model allocates nothing
        model = build_model(cfg, vocab)
    counted = sum(p.numel() for p in model.parameters())
    assert counted == model.num_params(non_embedding=False) == parameter_count(cfg, vocab)
    if expected:
        assert counted == expected
    s = model.shape
    embedding_lookup = 0 if s.tie_embeddings else vocab * s.n_embd
    assert model.flops_per_token() == 6 * (counted - embedding_lookup) + (
        12 * s.n_layer * s.n_head * s.head_dim * s.block_size
    )


@pytest.mark.parametrize("overrides", [[], ["model.bias=true", "model.n_layer=3"]])
def test_gpt2_matches_its_closed_form_count(overrides):
    cfg = load_config(None, overrides).model
    model = build_model(cfg, 257)
    assert model.num_params(non_embedding=False) == parameter_count(cfg, 257)
    s = model.shape
    assert model.flops_per_token() == 6 * (
        parameter_count(cfg, 257) - s.block_size * s.n_embd
    ) + attention_flops_per_token(s.n_layer, s.n_head, s.n_embd // s.n_head, s.block_size)


def test_keys_beside_a_preset_win():
    cfg = load_config(None, ["model.preset=125m", "model.block_size=256", "model.n_layer=2"]).model
    assert (cfg.arch, cfg.n_embd, cfg.block_size, cfg.n_layer) == ("llama", 768, 256, 2)
    assert set(MODEL_PRESETS) == set(
        get_args(get_args(ModelConfig.model_fields["preset"].annotation)[0])
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.preset=125M"], "model.preset"),
        (["model.n_kv_head=2"], "model.n_kv_head is a llama setting: set model.arch=llama"),
        (["model.tie_embeddings=false"], "model.tie_embeddings is a llama setting"),
        (["model.arch=llama", "model.n_kv_head=3"], "must be divisible by model.n_kv_head (3)"),
        (["model.arch=llama", "model.dropout=0.1"], "llama has no dropout or biases"),
        (["model.arch=llama", "model.n_embd=36", "model.n_head=4"], "even head size"),
        (["model.arch=lama"], "model.arch"),
    ],
)
def test_inconsistent_model_settings_are_refused_naming_the_key(overrides, message):
    with pytest.raises(UserError, match=re.escape(message)):
        load_config(None, overrides)


def test_sdpa_with_grouped_heads_matches_explicit_attention():
    """`enable_gqa` is what the model relies on; checked against the textbook formula."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    got = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    k2, v2 = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    scores = (q @ k2.transpose(-1, -2)) / math.sqrt(8)
    scores = scores.masked_fill(torch.ones(6, 6).triu(1).bool(), float("-inf"))
    assert torch.allclose(got, scores.softmax(-1) @ v2, atol=1e-5)


@pytest.mark.parametrize("tie", [True, False])
def test_a_checkpoint_round_trips_tied_or_untied_weights(tmp_path, tie):
    """Tied weights are stored once (safetensors refuses shared storage) and tied again on
    load; untied ones are both stored."""
    from safetensors.torch import load_file

    from raytrain_lm.checkpoints import TrainState, load_checkpoint, save_checkpoint

    shape = LlamaShape(**{**SHAPE.__dict__, "tie_embeddings": tie})
    torch.manual_seed(0)
    model = Llama(shape)
    optimizer = torch.optim.AdamW(model.parameters())
    directory = tmp_path / "checkpoint_0001"
    save_checkpoint(directory, model, optimizer, TrainState(step=1), {"config.yaml": "x: 1\n"})
    stored = load_file(str(directory / "model.safetensors"))
    assert ("lm_head.weight" in stored) is not tie and "embed_tokens.weight" in stored
    torch.manual_seed(1)
    restored = Llama(shape)
    load_checkpoint(directory, restored, torch.optim.AdamW(restored.parameters()), "cpu")
    assert (restored.lm_head.weight is restored.embed_tokens.weight) is tie
    for (name, a), b in zip(
        model.state_dict().items(), restored.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name
