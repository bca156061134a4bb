"""Llama: the decoder-only transformer most LMs are trained as today, pure PyTorch.

Like model.py it reads top to bottom: pre-RMSNorm blocks, rotary position embeddings (RoPE)
on queries and keys, grouped-query attention (`n_kv_head` key/value heads shared by
`n_head` query heads) through `scaled_dot_product_attention`, a SwiGLU MLP, no biases, and
an output projection tied to the token embedding or not. Module names follow Hugging Face's
`LlamaForCausalLM` (`embed_tokens`, `layers.N.self_attn.q_proj`, ...) and RoPE rotates halves
as it does, so weights map one to one. No Ray and no torch.distributed here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from raytrain_lm.causal_lm import CausalLM


@dataclass(frozen=True)
class LlamaShape:
    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    n_kv_head: int
    n_embd: int
    ffn_hidden: int
    tie_embeddings: bool = True
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


def swiglu_hidden(n_embd: int, multiple_of: int = 64) -> int:
    """Llama's MLP width: 2/3 of GPT's 4 * n_embd (SwiGLU has three matrices, not two), rounded
    up to `multiple_of`, so that it costs what GPT's MLP costs."""
    return multiple_of * math.ceil(int(8 * n_embd / 3) / multiple_of)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # in fp32 whatever the activations' dtype, as Llama does: small squares underflow in bf16
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rope_tables(head_dim: int, block_size: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every position's rotation angles, each (block_size, head_dim)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(block_size, dtype=torch.float32), inv_freq)  # (T, hs/2)
    angles = torch.cat((angles, angles), dim=-1)  # (T, hs): halves rotate together
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates x (B, heads, T, hs) by position: pairs (i, i + hs/2) turn by the same angle."""
    first, second = x.chunk(2, dim=-1)
    rotated_half = torch.cat((-second, first), dim=-1)
    return (x * cos + rotated_half * sin).type_as(x)


class Attention(nn.Module):
    def __init__(self, shape: LlamaShape):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = shape.n_head, shape.n_kv_head, shape.head_dim
        self.q_proj = nn.Linear(shape.n_embd, shape.n_head * shape.head_dim, bias=False)
        self.k_proj = nn.Linear(shape.n_embd, shape.n_kv_head * shape.head_dim, bias=False)
        self.v_proj = nn.Linear(shape.n_embd, shape.n_kv_head * shape.head_dim, bias=False)
        self.o_proj = nn.Linear(shape.n_head * shape.head_dim, shape.n_embd, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        # (B, T, heads * hs) -> (B, heads, T, hs). Heads are counted from the projections'
        # outputs: under tensor parallelism each rank holds only its own heads' columns.
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.n_kv_head != self.n_head
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)
        return self.o_proj(y)


class SwiGLU(nn.Module):
    def __init__(self, shape: LlamaShape):
        super().__init__()
        self.gate_proj = nn.Linear(shape.n_embd, shape.ffn_hidden, bias=False)
        self.up_proj = nn.Linear(shape.n_embd, shape.ffn_hidden, bias=False)
        self.down_proj = nn.Linear(shape.ffn_hidden, shape.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self, shape: LlamaShape):
        super().__init__()
        self.input_layernorm = RMSNorm(shape.n_embd, shape.norm_eps)
        self.self_attn = Attention(shape)
        self.post_attention_layernorm = RMSNorm(shape.n_embd, shape.norm_eps)
        self.mlp = SwiGLU(shape)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(CausalLM):
    def __init__(self, shape: LlamaShape):
        super().__init__()
        if shape.n_embd % shape.n_head or shape.n_head % shape.n_kv_head:
            raise ValueError(f"heads must divide n_embd and n_kv_head must divide n_head: {shape}")
        self.shape = shape
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.n_embd)
        self.layers = nn.ModuleList([LlamaBlock(shape) for _ in range(shape.n_layer)])
        self.norm = RMSNorm(shape.n_embd, shape.norm_eps)
        self.lm_head = nn.Linear(shape.n_embd, shape.vocab_size, bias=False)
        if shape.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # Recomputed, never saved: a checkpoint holds weights only, and any device rebuilds them.
        cos, sin = rope_tables(shape.head_dim, shape.block_size, shape.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.apply(self._init_weights)
        # as GPT-2: residual projections scaled by 1/sqrt(2 * n_layer)
        for name, p in self.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * shape.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    @property
    def blocks(self) -> nn.ModuleList:
        return self.layers

    def num_params(self, non_embedding: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())
        if non_embedding and not self.shape.tie_embeddings:
            n -= self.embed_tokens.weight.numel()
        return n

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, T = idx.size()
        if self.block_size < T:
            raise ValueError(f"sequence of length {T} exceeds block_size {self.block_size}")
        cos, sin = self.rope_cos[:T].to(idx.device), self.rope_sin[:T].to(idx.device)  # (T, hs)
        x = self.embed_tokens(idx)  # (B, T, C)
        for block in self.layers:
            x = block(x, cos, sin)
        x = self.norm(x)
        return self.logits_and_loss(x, targets)
