"""What every architecture here shares: a decoder-only language model over token ids.

`GPT` (model.py) and `Llama` (llama.py) subclass `CausalLM`; the training loop, `generate` and
the checkpoint code see only this interface. Pure PyTorch, like the architectures.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalLM(nn.Module):
    """`forward(idx, targets)` -> (logits, loss); subclasses set `block_size` and give
    `blocks`, the transformer blocks that sharding and activation recomputation wrap."""

    block_size: int

    @property
    def blocks(self) -> nn.ModuleList:
        raise NotImplementedError

    def num_params(self, non_embedding: bool = True) -> int:
        """All parameters; with `non_embedding`, only those that cost a multiply per token
        (a lookup table does not, an output projection tied to it does)."""
        raise NotImplementedError

    def flops_per_token(self) -> float:
        raise NotImplementedError

    def optimizer_groups(self, weight_decay: float) -> list[dict]:
        """Decay matrices and embeddings; never biases or norm gains (as nanoGPT)."""
        params = [p for p in self.parameters() if p.requires_grad]
        return [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Autoregressive sampling; idx is (B, T) token ids, returns (B, T + max_new_tokens)."""
        for _ in range(max_new_tokens):
            idx_cond = idx[:, -self.block_size :]
            logits, _ = self(idx_cond)
            logits = logits[:, -1, :].float() / max(temperature, 1e-6)
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("inf")
            probs = F.softmax(logits, dim=-1)
            idx_next = torch.multinomial(probs, num_samples=1, generator=generator)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx


def attention_flops_per_token(n_layer: int, n_head: int, head_dim: int, seq_len: int) -> int:
    """Forward + backward FLOPs per token of QK^T and AV at full context (PaLM, appendix B)."""
    return 12 * n_layer * n_head * head_dim * seq_len
