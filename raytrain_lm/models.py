"""Which model a config describes. The architecture itself is pure PyTorch in model.py and
knows nothing of configs; this is the one place that turns `model:` settings into one."""

from __future__ import annotations

from raytrain_lm.config import ModelConfig
from raytrain_lm.model import GPT, GPTShape


def model_shape(cfg: ModelConfig, tokenizer_vocab: int) -> GPTShape:
    """The shape of `cfg`; the vocabulary is the tokenizer's unless `model.vocab_size` is set."""
    return GPTShape(
        vocab_size=cfg.vocab_size or tokenizer_vocab,
        block_size=cfg.block_size,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        n_embd=cfg.n_embd,
        dropout=cfg.dropout,
        bias=cfg.bias,
    )


def build_model(cfg: ModelConfig, tokenizer_vocab: int) -> GPT:
    return GPT(model_shape(cfg, tokenizer_vocab))
