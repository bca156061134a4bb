"""Which model a config describes. The architectures themselves are pure PyTorch (model.py,
llama.py) and know nothing of configs; this is the one place that turns `model:` settings
into one."""

from __future__ import annotations

from raytrain_lm.causal_lm import CausalLM
from raytrain_lm.config import ModelConfig
from raytrain_lm.llama import Llama, LlamaShape, swiglu_hidden
from raytrain_lm.model import GPT, GPTShape


def model_shape(cfg: ModelConfig, tokenizer_vocab: int) -> GPTShape | LlamaShape:
    """The shape of `cfg`; the vocabulary is the tokenizer's unless `model.vocab_size` is set."""
    vocab_size = cfg.vocab_size or tokenizer_vocab
    if cfg.arch == "llama":
        return LlamaShape(
            vocab_size=vocab_size,
            block_size=cfg.block_size,
            n_layer=cfg.n_layer,
            n_head=cfg.n_head,
            n_kv_head=cfg.n_kv_head or cfg.n_head,
            n_embd=cfg.n_embd,
            ffn_hidden=cfg.ffn_hidden or swiglu_hidden(cfg.n_embd),
            tie_embeddings=cfg.tie_embeddings,
            rope_theta=cfg.rope_theta,
            norm_eps=cfg.norm_eps,
        )
    return GPTShape(
        vocab_size=vocab_size,
        block_size=cfg.block_size,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        n_embd=cfg.n_embd,
        dropout=cfg.dropout,
        bias=cfg.bias,
    )


def build_model(cfg: ModelConfig, tokenizer_vocab: int) -> CausalLM:
    shape = model_shape(cfg, tokenizer_vocab)
    return Llama(shape) if isinstance(shape, LlamaShape) else GPT(shape)


def parameter_count(cfg: ModelConfig, vocab_size: int) -> int:
    """Closed form of the number of parameters `build_model` makes (tied weights once)."""
    shape = model_shape(cfg, vocab_size)
    d, L, V = shape.n_embd, shape.n_layer, shape.vocab_size
    if isinstance(shape, GPTShape):
        biases = shape.bias
        per_block = 12 * d * d + 2 * d * (2 if biases else 1) + (9 * d if biases else 0)
        return V * d + shape.block_size * d + L * per_block + d * (2 if biases else 1)
    q_and_o = 2 * d * shape.n_head * shape.head_dim
    k_and_v = 2 * d * shape.n_kv_head * shape.head_dim
    per_block = q_and_o + k_and_v + 3 * d * shape.ffn_hidden + 2 * d
    embeddings = V * d * (1 if shape.tie_embeddings else 2)
    return embeddings + L * per_block + d
