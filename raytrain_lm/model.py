"""GPT: a decoder-only transformer, pure PyTorch.

Reads top to bottom like nanoGPT: pre-LayerNorm blocks, causal self-attention through
`scaled_dot_product_attention` (flash attention on CUDA), tied input/output embeddings and
GPT-2 initialisation. No Ray and no torch.distributed here: parallelism is applied from outside.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from raytrain_lm.causal_lm import CausalLM


@dataclass(frozen=True)
class GPTShape:
    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float = 0.0
    bias: bool = False


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (PyTorch's cannot drop only the bias)."""

    def __init__(self, ndim: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, shape: GPTShape):
        super().__init__()
        self.n_head = shape.n_head
        self.dropout = shape.dropout
        self.c_attn = nn.Linear(shape.n_embd, 3 * shape.n_embd, bias=shape.bias)
        self.c_proj = nn.Linear(shape.n_embd, shape.n_embd, bias=shape.bias)
        self.resid_dropout = nn.Dropout(shape.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)  # each (B, T, C)
        # (B, T, C) -> (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, shape: GPTShape):
        super().__init__()
        self.c_fc = nn.Linear(shape.n_embd, 4 * shape.n_embd, bias=shape.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * shape.n_embd, shape.n_embd, bias=shape.bias)
        self.dropout = nn.Dropout(shape.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, shape: GPTShape):
        super().__init__()
        self.ln_1 = LayerNorm(shape.n_embd, bias=shape.bias)
        self.attn = CausalSelfAttention(shape)
        self.ln_2 = LayerNorm(shape.n_embd, bias=shape.bias)
        self.mlp = MLP(shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(CausalLM):
    def __init__(self, shape: GPTShape):
        super().__init__()
        self.shape = shape
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(shape.vocab_size, shape.n_embd),
                wpe=nn.Embedding(shape.block_size, shape.n_embd),
                drop=nn.Dropout(shape.dropout),
                h=nn.ModuleList([Block(shape) for _ in range(shape.n_layer)]),
                ln_f=LayerNorm(shape.n_embd, bias=shape.bias),
            )
        )
        self.lm_head = nn.Linear(shape.n_embd, shape.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        # GPT-2: scale residual projections by 1/sqrt(2 * n_layer)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * shape.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    @property
    def blocks(self) -> nn.ModuleList:
        return self.transformer.h

    def num_params(self, non_embedding: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.transformer.wpe.weight.numel()
        return n

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, T = idx.size()
        if self.shape.block_size < T:
            raise ValueError(f"sequence of length {T} exceeds block_size {self.shape.block_size}")
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)  # (T,)
        x = self.transformer.drop(
            self.transformer.wte(idx) + self.transformer.wpe(pos)
        )  # (B, T, C)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        return self.logits_and_loss(x, targets)
